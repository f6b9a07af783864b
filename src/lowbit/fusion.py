"""Which linears runtimes fuse (and so must share input scales and NVFP4 global scales).

q/k/v projections read the same input and are fused by vLLM into one qkv matmul; gate/up
likewise. Siblings are found by exact name components (same parent module, last component in
one of FUSED_SETS), never by substring.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from lowbit.quant import global_scale_from_amax
from lowbit.schemes import Scheme

FUSED_SETS: tuple[frozenset[str], ...] = (
    frozenset({"q_proj", "k_proj", "v_proj"}),
    frozenset({"gate_proj", "up_proj"}),
    frozenset({"w1", "w3"}),  # Mixtral experts
    frozenset({"q_a_proj", "kv_a_proj_with_mqa"}),  # DeepSeek MLA with q_lora_rank: vLLM's fused_qkv_a_proj
)


def _split(name: str) -> tuple[str, str]:
    parent, _, last = name.rpartition(".")
    return parent, last


def fused_groups(linear_names: list[str]) -> list[list[str]]:
    """Partition ``linear_names`` into fusion groups (singletons for unfused linears).

    Order follows first appearance; members keep their input order."""
    buckets: dict[tuple[str, int], list[str]] = defaultdict(list)
    order: list[tuple[str, int] | str] = []
    for name in linear_names:
        parent, last = _split(name)
        key = None
        for i, s in enumerate(FUSED_SETS):
            if last in s:
                key = (parent, i)
                break
        if key is None:
            order.append(name)
            continue
        if key not in buckets:
            order.append(key)
        buckets[key].append(name)
    return [[k] if isinstance(k, str) else buckets[k] for k in order]


def group_of(name: str, linear_names: list[str]) -> list[str]:
    for g in fused_groups(linear_names):
        if name in g:
            return g
    return [name]


def shared_amax(tensors: list[torch.Tensor]) -> torch.Tensor:
    """amax over a fused group (float32 scalar tensor [1])."""
    return torch.stack([t.detach().abs().amax().to(torch.float32) for t in tensors]).amax().reshape(1)


def shared_weight_global_scales(weights: dict[str, torch.Tensor], scheme: Scheme) -> dict[str, torch.Tensor]:
    """NVFP4-style weight global scales, one per fused group (empty if the spec has none)."""
    spec = scheme.weights
    if not spec.global_scale:
        return {}
    out: dict[str, torch.Tensor] = {}
    for group in fused_groups(list(weights)):
        gs = global_scale_from_amax(shared_amax([weights[n] for n in group]), spec)
        for n in group:
            out[n] = gs
    return out
