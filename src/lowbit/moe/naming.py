"""The checkpoint names of a family, read from transformers' conversion mapping.

In the model (transformers 5, after ``split_experts``) expert e of a block is
``<block>.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``. A family's checkpoints may name
things otherwise: transformers renames them when it loads a checkpoint and writes them back when it
saves one, with the family's conversion mapping
(``transformers.conversion_mapping.get_checkpoint_conversion_mapping``): Mixtral, MiniMax and
PhiMoE store the block as ``block_sparse_moe`` and the expert linears as ``w1`` (gate), ``w3`` (up)
and ``w2`` (down); Nemotron-H stores ``backbone.`` for ``model.``. lowbit writes the names
transformers' ``save_pretrained`` writes, and reads them back (``model_names``), from the same
mapping, so there is no table of lowbit's:

- the per-expert linear names come from the converters that stack per-expert tensors into the
  fused ones (``MergeModulelist``, then ``Concatenate`` for ``gate_up_proj``: its first source is
  the gate, its second the up projection);
- every other name goes through the mapping's ``WeightRenaming`` s, reversed and in reverse order
  on the way out, as ``revert_weight_conversion`` applies them (``PrefixChange``, which adds a
  prefix only to checkpoints that had one, is left out, as transformers leaves it out for a model
  not loaded from a checkpoint).

``FUSED_ON_DISK``: families whose checkpoints keep the experts fused, as the model holds them
(gpt-oss: ``<block>.experts.gate_up_proj`` [E, H, 2I] interleaved, ``down_proj`` [E, I, H], with
``gate_up_proj_bias`` / ``down_proj_bias``), and their layout; model-free quantization splits
them per expert (``lowbit.moe.slices``) and writes ``<block>.experts.{e}.gate_proj.weight`` ...,
the names lowbit writes from memory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping

from lowbit.moe.slices import FusedLayout

FUSED_ON_DISK: dict[str, FusedLayout] = {"gpt_oss": FusedLayout(transposed=True, concatenated=False)}
FUSED_WEIGHTS = ("gate_up_proj", "down_proj")            # <block>.experts.<leaf>, 3-D
FUSED_BIASES = ("gate_up_proj_bias", "down_proj_bias")   # <block>.experts.<leaf>, 2-D
_PER_EXPERT = re.compile(r"experts\.\*\.([A-Za-z0-9_]+)\.weight$")


@dataclass(frozen=True)
class _Names:
    renamings: tuple          # transformers' WeightRenaming s, checkpoint -> model
    reversed: tuple           # the same, model -> checkpoint, in the order to apply them
    to_disk: dict             # model expert linear -> checkpoint expert linear ("gate_proj" -> "w1")

    @property
    def to_model(self) -> dict:
        return {v: k for k, v in self.to_disk.items()}


@lru_cache(maxsize=None)
def _names(model_type: str | None) -> _Names | None:
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import (Concatenate, MergeModulelist, PrefixChange, WeightConverter,
                                                     WeightRenaming)
    except ImportError:  # pragma: no cover - a transformers without conversion mappings
        return None
    mapping = get_checkpoint_conversion_mapping(model_type) if model_type else None
    if not mapping:
        return None
    renamings = tuple(t for t in mapping if isinstance(t, WeightRenaming) and not isinstance(t, PrefixChange))
    to_disk: dict[str, str] = {}
    for c in mapping:
        if not isinstance(c, WeightConverter) or len(c._original_target_patterns) != 1:
            continue
        if not all(isinstance(op, (MergeModulelist, Concatenate)) for op in c.operations):
            continue
        leaf = c._original_target_patterns[0].rpartition(".")[2]
        found = [_PER_EXPERT.search(s) for s in c._original_source_patterns]
        if not all(found):
            continue
        linears = [m.group(1) for m in found]
        if leaf == "gate_up_proj" and len(linears) == 2:
            to_disk.update(gate_proj=linears[0], up_proj=linears[1])
        elif leaf in ("up_proj", "down_proj") and len(linears) == 1:
            to_disk[leaf] = linears[0]
    return _Names(renamings, tuple(t.reverse_transform() for t in reversed(renamings)), to_disk)


def _expert_linears(key: str, names: dict) -> str:
    """``key`` with the linear of ``<block>.experts.{e}.<linear>`` renamed by ``names``."""
    parts = key.split(".")
    for i in range(len(parts) - 2):
        if parts[i] == "experts" and parts[i + 1].isdigit() and parts[i + 2] in names:
            parts[i + 2] = names[parts[i + 2]]
            return ".".join(parts)
    return key


def checkpoint_names(model_type: str | None, keys: list[str]) -> dict[str, str]:
    """model key -> the key the family's checkpoints use (as transformers saves it)."""
    n = _names(model_type)
    if n is None:
        return {k: k for k in keys}
    out = {}
    for k in keys:
        disk = _expert_linears(k, n.to_disk)
        for r in n.reversed:
            disk, _ = r.rename_source_key(disk)
        out[k] = disk
    return out


def stored_key(model_type: str | None, key: str, stored, renames: Mapping[str, str]) -> str | None:
    """The checkpoint key of the model tensor ``key`` if the checkpoint (``stored``: its keys)
    holds it whole: its name in the family's checkpoints (``checkpoint_names``), else the key
    transformers renames to it on load (``renames``: ``lowbit.renames.checkpoint_renames`` of the
    model before its experts were split); None when neither is stored (an expert of a fused tensor)."""
    disk = checkpoint_names(model_type, [key])[key]
    if disk in stored:
        return disk
    disk = renames.get(key)
    return disk if disk in stored else None


def model_names(model_type: str | None, keys: list[str]) -> dict[str, str]:
    """checkpoint key -> the model key (the inverse of ``checkpoint_names``, as transformers loads it)."""
    n = _names(model_type)
    if n is None:
        return {k: k for k in keys}
    out = {}
    for k in keys:
        key = k
        for r in n.renamings:
            key, _ = r.rename_source_key(key)
        out[k] = _expert_linears(key, n.to_model)
    return out


def module_checkpoint_names(model_type: str | None, modules: list[str]) -> dict[str, str]:
    """model module -> its name in the family's checkpoints (its weight's key, less ``.weight``:
    renamings written for a weight's key, PhiMoE's ``.router.weight`` -> ``.gate.weight``, apply)."""
    disk = checkpoint_names(model_type, [f"{m}.weight" for m in modules])
    return {m: disk[f"{m}.weight"].removesuffix(".weight") for m in modules}


def ignore_names(model_type: str | None, modules: list[str], from_checkpoint: bool = False) -> list[str]:
    """The names a quantization config's ``ignore`` lists for the float linears ``modules``: each
    one's checkpoint name (what an engine that builds its modules from the checkpoint's names
    matches: vLLM) and, where transformers' model calls it otherwise, its model name too (what
    compressed-tensors matches inside transformers, on the model it built). ``from_checkpoint``:
    ``modules`` are checkpoint names already (model-free)."""
    if from_checkpoint:
        as_model = model_names(model_type, [f"{m}.weight" for m in modules])
        pairs = [(m, as_model[f"{m}.weight"].removesuffix(".weight")) for m in modules]
    else:
        disk = module_checkpoint_names(model_type, modules)
        pairs = [(disk[m], m) for m in modules]
    return list(dict.fromkeys(n for pair in pairs for n in pair))
