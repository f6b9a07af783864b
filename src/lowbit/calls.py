"""A layer call as the layer-by-layer paths hold it: (args, kwargs), moved between devices or cut
to some of its windows."""

from __future__ import annotations

from typing import Callable

import torch


def map_tensors(call: tuple[tuple, dict], fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[tuple, dict]:
    """A layer call's (args, kwargs) with ``fn`` applied to every tensor in it (also inside tuples
    and lists, e.g. RoPE's (cos, sin)); everything else kept."""

    def mp(v):
        if isinstance(v, torch.Tensor):
            return fn(v)
        if isinstance(v, tuple):
            return tuple(mp(x) for x in v)
        if isinstance(v, list):
            return [mp(x) for x in v]
        return v

    args, kwargs = call
    return tuple(mp(a) for a in args), {k: mp(v) for k, v in kwargs.items()}


def move_call(call: tuple[tuple, dict], device: torch.device | None) -> tuple[tuple, dict]:
    """A layer call's (args, kwargs) with every tensor in it on ``device`` (None: unchanged)."""
    if device is None:
        return call
    return map_tensors(call, lambda t: t.to(device))


def slice_call(call: tuple[tuple, dict], batch: int, start: int, stop: int) -> tuple[tuple, dict]:
    """The windows ``start:stop`` of a layer call over ``batch`` windows: every tensor of two or
    more dimensions whose first dimension is ``batch`` (hidden states, masks, per-window position
    ids and RoPE tables) is sliced there; a tensor of three or more dimensions whose first
    dimension is ``m * batch`` (m > 1) and whose last is the hidden states' length (BLOOM's ALiBi
    bias [batch * heads, 1, T]: window-major) is sliced at rows ``start * m : stop * m``; the rest
    (shared position tables [1, ...], 1-D cache positions, non-tensors) is kept."""
    if start == 0 and stop == batch:
        return call
    args, kwargs = call
    hidden = args[0] if args else kwargs.get("hidden_states")
    seq = hidden.shape[1] if isinstance(hidden, torch.Tensor) and hidden.dim() >= 3 else None

    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.dim() >= 2 and t.shape[0] == batch:
            return t[start:stop]
        m = t.shape[0] // batch if t.dim() >= 3 and batch else 0
        if m > 1 and t.shape[0] == m * batch and seq is not None and t.shape[-1] == seq:
            return t[start * m:stop * m]
        return t

    return map_tensors(call, cut)
