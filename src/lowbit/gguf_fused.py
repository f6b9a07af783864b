"""Experts a checkpoint stores fused, in a calibrated GGUF file (``lowbit.quantize_gguf``).

gpt-oss, GraniteMoE and Llama 4 keep each block's experts in one tensor per projection ([E, ...],
``lowbit.moe.slices``); the converter writes it as ``ffn_*_exps`` [E, out, in]. In memory the
experts are split into linears (``lowbit.linearize``), so each expert gets its own importance
vector and Hessian from the tokens routed to it, and GPTQ rounds it. This module names the split
weights' fused sources (``lowbit.moe.fused_source``) and stacks their results back: the
importance of a fused tensor is [E, in] (expert e's vector; gate and up read the same input), and
its encoded rows are [E, rows, bytes] in the row order the plan reads that tensor in (an expert's
matrix, transposed for a ``transposed`` layout, gate and up rows where ``part_rows`` puts them).
A fused tensor whose plan orientation differs from its layout's, or whose parts do not all come
encoded in one type, keeps the writer's encoding (with its importance when it has one).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Mapping

import torch
import torch.nn as nn

from lowbit.moe.fused_source import FusedSource, fused_source
from lowbit.moe.slices import part_rows
from lowbit.numerics.ggml import GgmlType


def fused_parts(model: nn.Module, weights: list[str], stored: Callable[[str], str | None]) -> dict[str, FusedSource]:
    """Split linear weight name -> its fused checkpoint source, for the ``weights`` the checkpoint
    keeps inside a fused [E, ...] tensor (a linear applied per input group is not one: its rows
    are a 2-D tensor's own)."""
    out = {}
    for w in weights:
        if stored(w) is None:
            src = fused_source(model, w, stored)
            if src is not None and not src.layout.row_groups:
                out[w] = src
    return out


def with_parts(kinds: Mapping[str, GgmlType], parts: Mapping[str, FusedSource]) -> dict[str, GgmlType]:
    """``kinds`` (HF weight name -> the GGML type GPTQ rounds it in) with every split part of
    ``parts`` given its fused tensor's type: the parts are rounded as linears, then stacked."""
    return {**kinds, **{w: kinds[p.disk] for w, p in parts.items() if p.disk in kinds}}


@contextmanager
def experts_split(model: nn.Module) -> Iterator[dict[str, FusedSource]]:
    """For the block: ``model``'s fused experts split into linears (``lowbit.moe.split_experts``,
    a copy of each block's experts), yielding split weight name -> its fused source, a parameter of
    the model as it was (``fused_parts``); afterwards the fused modules are put back as they were
    (also on error). For a model in memory whose experts are fused (transformers 5 holds them so),
    so that each expert gets its own importance vector and Hessian: memory holds the experts twice
    meanwhile."""
    from lowbit.moe import split_experts
    from lowbit.targets import set_submodule

    keys = set(model.state_dict())
    before = dict(model.named_modules())
    replaced = split_experts(model)
    try:
        linears = [f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        yield fused_parts(model, linears, lambda k: k if k in keys else None)
    finally:
        for name in replaced:
            set_submodule(model, name, before[name])


def _orientation(plan, disk: str) -> bool | None:
    """Whether the plan reads ``disk`` transposed (None: no row map reads it, or two disagree)."""
    from lowbit.formats.gguf.rowmap import RowMap

    seen = {t.is_transposed(k) for t in plan.tensors if isinstance(t, RowMap)
            for k, s in enumerate(t.sources) if s == disk}
    return next(iter(seen)) if len(seen) == 1 else None


def stack(plan, parts: Mapping[str, FusedSource], importance: dict, encoded: dict) -> None:
    """Add each fused source's stacked importance [E, in] to ``importance`` and, when every part
    came encoded in one type, its stacked rows (type, uint8 [E, rows, bytes]) to ``encoded``; the
    parts' own entries are removed from ``encoded`` (module docstring)."""
    by_disk: dict[str, dict[tuple[int, object], str]] = {}
    for w, src in parts.items():
        by_disk.setdefault(src.disk, {})[(src.expert, src.proj)] = w
    for disk, members in by_disk.items():
        layout = next(parts[w].layout for w in members.values())
        if _orientation(plan, disk) is not bool(layout.transposed):
            continue
        experts = sorted({e for e, _ in members})
        projs = list(dict.fromkeys(p for _, p in members))
        if experts != list(range(len(experts))) or any((e, p) not in members for e in experts for p in projs):
            continue
        first = [members[(e, projs[0])] for e in experts]
        if all(w in importance for w in first):
            importance[disk] = torch.stack([torch.as_tensor(importance[w], dtype=torch.float32) for w in first])
        got = [encoded.pop(members[(e, p)], None) for e in experts for p in projs]
        kinds = {g[0] for g in got if g is not None}
        if any(g is None for g in got) or len(kinds) != 1:
            continue
        kind: GgmlType = kinds.pop()
        rows = [torch.as_tensor(g[1]) for g in got]
        per = [r.shape[0] for r in rows[:len(projs)]]
        n = sum(per)
        out = torch.empty((len(experts), n, rows[0].shape[-1]), dtype=torch.uint8)
        for e in experts:
            for i, p in enumerate(projs):
                out[e, part_rows(p, layout, n)] = rows[e * len(projs) + i]
        encoded[disk] = (kind, out)
