"""Which modules of a model get quantized: exact rules on module types and name components.

Quantized: every ``nn.Linear`` except the output embedding (lm_head, unless asked), MoE
router gates (last name component exactly ``gate`` or ``router``), modules under a non-text
tower (a name component exactly one of NON_TEXT_COMPONENTS), and names matching an ``ignore``
pattern (an exact name, or a regular expression that must match the whole name).
"""

from __future__ import annotations

import re
from typing import Iterable

import torch.nn as nn

ROUTER_COMPONENTS = frozenset({"gate", "router"})
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
