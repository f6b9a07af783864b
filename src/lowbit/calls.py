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
    ids and RoPE tables) is sliced there; the rest (shared position tables [1, ...], 1-D cache
    positions, non-tensors) is kept."""
    if start == 0 and stop == batch:
        return call
    return map_tensors(call, lambda t: t[start:stop] if t.dim() >= 2 and t.shape[0] == batch else t)
