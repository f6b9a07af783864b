"""A layer call as the layer-by-layer paths hold it: (args, kwargs), moved between devices."""

from __future__ import annotations

import torch


def move_call(call: tuple[tuple, dict], device: torch.device | None) -> tuple[tuple, dict]:
    """A layer call's (args, kwargs) with every tensor in it (also inside tuples, e.g. RoPE's
    (cos, sin)) on ``device`` (None: unchanged)."""
    if device is None:
        return call

    def mv(v):
        if isinstance(v, torch.Tensor):
            return v.to(device)
        if isinstance(v, tuple):
            return tuple(mv(x) for x in v)
        if isinstance(v, list):
            return [mv(x) for x in v]
        return v

    args, kwargs = call
    return tuple(mv(a) for a in args), {k: mv(v) for k, v in kwargs.items()}
