"""Which modules of a model get quantized: exact rules on module types and name components.

Quantized: every ``nn.Linear`` except the output embedding (lm_head, unless asked), MoE
routers (last name component exactly ``gate``, ``router`` or ``shared_expert_gate``), modules under a non-text
tower (a name component exactly one of NON_TEXT_COMPONENTS), and names matching an ``ignore``
pattern (an exact name, or a regular expression that must match the whole name).
"""

from __future__ import annotations

import re
from typing import Iterable

import torch.nn as nn

ROUTER_COMPONENTS = frozenset({"gate", "router", "shared_expert_gate"})  # MoE routers stay in float
NON_TEXT_COMPONENTS = frozenset({
    "vision_tower", "vision_model", "visual", "vision_encoder", "audio_tower", "audio_model",
    "multi_modal_projector", "mm_projector",
})


def matches_ignore(name: str, ignore: Iterable[str]) -> bool:
    for pat in ignore:
        if name == pat or re.fullmatch(pat, name):
            return True
    return False


def is_excluded_name(name: str, ignore: Iterable[str] = ()) -> bool:
    """The name-based exclusions shared by in-memory and model-free quantization."""
    parts = name.split(".")
    if parts[-1] in ROUTER_COMPONENTS:
        return True
    if any(p in NON_TEXT_COMPONENTS for p in parts):
        return True
    return matches_ignore(name, ignore)


def output_embedding_names(model: nn.Module) -> set[str]:
    out = getattr(model, "get_output_embeddings", lambda: None)()
    if out is None:
        return set()
    return {n for n, m in model.named_modules() if m is out}


def quantizable_linears(model: nn.Module, ignore: Iterable[str] = (), include_lm_head: bool = False) -> list[str]:
    """Names of the nn.Linear modules to quantize, in model order."""
    ignore = list(ignore)
    heads = set() if include_lm_head else output_embedding_names(model)
    names = []
    for name, mod in model.named_modules():
        if type(mod) is not nn.Linear and not isinstance(mod, nn.Linear):
            continue
        if name in heads or is_excluded_name(name, ignore):
            continue
        names.append(name)
    return names


def unquantizable_targets(model: nn.Module, ignore: Iterable[str] = (), include_lm_head: bool = False
                          ) -> list[tuple[str, tuple[int, ...]]]:
    """Weight matrices a scheme targets that lowbit cannot quantize: (parameter name, shape).

    A target is a floating-point parameter of two or more dimensions that is not an
    ``nn.Linear`` weight (those are quantized), not an embedding table, not the output embedding
    (unless ``include_lm_head``) and not excluded by name (routers, non-text towers, ``ignore``
    patterns matched against the module's name). Examples: the fused 3-D expert weights of
    transformers' MoE blocks (``experts.gate_up_proj`` [E, 2I, H]), GPT-2's ``Conv1D``."""
    ignore = list(ignore)
    heads = set() if include_lm_head else output_embedding_names(model)
    out = []
    for mod_name, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, nn.Embedding)) or mod_name in heads or is_excluded_name(mod_name, ignore):
            continue
        for p_name, p in mod.named_parameters(recurse=False):
            if p.dim() >= 2 and p.is_floating_point():
                out.append((f"{mod_name}.{p_name}" if mod_name else p_name, tuple(p.shape)))
    return out


def set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` at the dotted ``name`` of ``model`` (replacing what is there)."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)
