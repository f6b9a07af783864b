"""Where a split model tensor lies in a tensor its checkpoint stores fused: pure name resolution.

After ``lowbit.moe.split_experts`` (and ``moe.row_groups``, ``moe.grouped``,
``moe.weighted_shared``) a model holds per-part tensors (``<block>.experts.{e}.gate_proj.weight``)
that some checkpoints keep fused: gpt-oss's and Granite's ``experts.gate_up_proj`` / ``down_proj``
([E, ...], ``lowbit.moe.slices`` says how), Inkling's one tensor per projection, DeepSeek-V4's
grouped ``o_a_proj`` (group g its row block g), grouped per-expert matrices (one row an expert).
``fused_source(model, key, stored)`` answers with the fused checkpoint tensor, the part's index
and projection and the layout (``expert_part`` then reads it), from the split modules' own
records (their ``layout``) and ``stored`` (model key -> checkpoint key of a tensor stored whole,
or None). The streamed skeleton reads its tensors through it; a GGUF file's calibration stacks
per-expert results back onto the fused tensors through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.nn as nn

from lowbit.moe.grouped import GroupedLinears
from lowbit.moe.naming import FUSED_ON_DISK
from lowbit.moe.slices import FusedLayout, Proj


@dataclass(frozen=True)
class FusedSource:
    """A per-part model tensor read out of a tensor fused on disk: ``expert_part(disk tensor,
    expert, proj, layout)``."""

    disk: str
    expert: int
    proj: Proj
    layout: FusedLayout


def _module(model: nn.Module, name: str):
    try:
        return model.get_submodule(name) if name else None
    except AttributeError:
        return None


def fused_source(model: nn.Module, key: str, stored: Callable[[str], str | None]) -> FusedSource | None:
    """Where the checkpoint keeps the split model tensor ``key`` inside a fused tensor (module
    docstring); None when it is not a part of one (``stored`` gives checkpoint keys)."""
    parts = key.split(".")
    model_type = getattr(getattr(model, "config", None), "model_type", None)

    def split_layout(container: str):
        return getattr(_module(model, container), "layout", None)

    # <module>.<e>.<proj>.weight of experts fused per projection (moe.weighted_shared): <module>.<proj>[e]
    split = split_layout(".".join(parts[:-3])) if len(parts) >= 4 and parts[-3].isdigit() else None
    if getattr(split, "separate", False) and parts[-1] == "weight" and parts[-2] in {p.value for p in Proj}:
        fused = stored(".".join(parts[:-3] + [parts[-2]]))
        if fused is not None:
            return FusedSource(fused, int(parts[-3]), Proj(parts[-2]), split)
    layout = FUSED_ON_DISK.get(model_type or "") or split_layout(".".join(parts[:-3]))
    # <block>.experts.<e>.<proj>.<weight|bias> from <block>.experts.<gate_up_proj|down_proj>[_bias]
    if layout is not None and len(parts) >= 4 and parts[-4] == "experts" and parts[-3].isdigit():
        proj = Proj(parts[-2]) if parts[-2] in {p.value for p in Proj} else None
        if proj is not None:
            leaf = "down_proj" if proj is Proj.DOWN else "gate_up_proj" if layout.has_gate else "up_proj"
            leaf += "_bias" if parts[-1] == "bias" else ""
            fused = stored(".".join(parts[:-3] + [leaf]))
            if fused is not None:
                return FusedSource(fused, int(parts[-3]), proj, layout)
    # <module>.<g>.<weight|bias> of a linear applied per input group (moe.row_groups): row block g of <module>.<leaf>
    split = split_layout(".".join(parts[:-2])) if len(parts) >= 3 and parts[-2].isdigit() else None
    if split is not None and split.row_groups:
        whole = stored(".".join(parts[:-2] + [parts[-1]]))
        if whole is not None:
            return FusedSource(whole, int(parts[-2]), Proj.DOWN, split)
    # <module>.<e>.weight of per-expert matrices grouped by expert (moe.grouped) from <module>.<leaf>[e]
    grouped = _module(model, ".".join(parts[:-2])) if len(parts) >= 3 and parts[-2].isdigit() else None
    if isinstance(grouped, GroupedLinears) and parts[-1] == "weight":
        fused = stored(".".join(parts[:-2] + [grouped.leaf]))
        if fused is not None:
            return FusedSource(fused, int(parts[-2]), Proj.DOWN, FusedLayout(transposed=grouped.transposed))
    return None
