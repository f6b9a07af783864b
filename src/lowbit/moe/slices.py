"""One expert's projection out of fused expert tensors: the single definition the in-memory split
(``lowbit.moe.split``) and model-free quantization (``lowbit.modelfree.plan``) both use.

Fused layouts, as transformers 5 defines them:

- ``gate_up_proj`` [E, 2I, H] (``transposed``: [E, H, 2I]); its rows (after transposing) are the
  gate rows then the up rows (``concatenated``) or interleaved g0, u0, g1, u1, ... (gpt-oss);
  without a gate (``has_gate`` False) the tensor is ``up_proj`` and holds the up rows only;
- ``down_proj`` [E, H, I] (``transposed``: [E, I, H]);
- biases (``has_bias``): ``gate_up_proj_bias`` [E, 2I] (split like the rows), ``down_proj_bias`` [E, H];
- ``separate``: each projection fused on its own, ``gate_proj`` / ``up_proj`` [E, I, H] and
  ``down_proj`` [E, H, I] (``transposed``: [E, in, out]), expert e's weight the tensor's [e]
  (Inkling's weighted shared experts, ``lowbit.moe.weighted_shared``).

``expert_part(t, e, proj, layout)`` returns expert e's ``proj`` weight [out, in] (or bias [out])
as a new contiguous tensor; ``part_shape`` its shape without reading data.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn as nn


class Proj(str, Enum):
    GATE = "gate_proj"
    UP = "up_proj"
    DOWN = "down_proj"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class FusedLayout:
    """How a fused tensor holds its parts. ``row_groups`` > 0: a 2-D [G * out, in] weight (or
    [G * out] bias) of a linear applied per input group (``lowbit.moe.row_groups``), part g its
    row block g; the other fields are then unused."""

    transposed: bool = False
    concatenated: bool = True
    has_gate: bool = True
    row_groups: int = 0
    separate: bool = False  # one fused tensor per projection, named after it (module docstring)


def _rows(proj: Proj, layout: FusedLayout, n: int) -> slice:
    """Which rows of a gate_up tensor (n rows) belong to ``proj``."""
    if proj is Proj.DOWN or not layout.has_gate or layout.separate:
        return slice(None)
    if layout.concatenated:
        return slice(0, n // 2) if proj is Proj.GATE else slice(n // 2, n)
    return slice(0, None, 2) if proj is Proj.GATE else slice(1, None, 2)


def part_rows(proj: Proj, layout: FusedLayout, n: int) -> slice:
    """Which rows of one expert's matrix (n rows, after transposing a ``transposed`` layout)
    hold ``proj`` (gate and up halves or interleaved rows of a gate_up tensor; all otherwise)."""
    return _rows(proj, layout, n)


def expert_part(t: torch.Tensor, e: int, proj: Proj, layout: FusedLayout) -> torch.Tensor:
    """Expert ``e``'s ``proj`` out of the fused tensor ``t`` (3-D weight or 2-D bias): [out, in]
    or [out], contiguous, a copy."""
    if layout.row_groups:
        return t.reshape(layout.row_groups, -1, *t.shape[1:])[e].clone(memory_format=torch.contiguous_format)
    x = t[e]
    if x.dim() == 2 and layout.transposed:
        x = x.t()
    return x[_rows(proj, layout, x.shape[0])].clone(memory_format=torch.contiguous_format)


def part_shape(shape: tuple[int, ...], proj: Proj, layout: FusedLayout) -> tuple[int, ...]:
    """The shape ``expert_part`` returns for a fused tensor of ``shape``."""
    if layout.row_groups:
        return (shape[0] // layout.row_groups,) + tuple(shape[1:])
    inner = tuple(shape[1:])
    if len(inner) == 2 and layout.transposed:
        inner = inner[::-1]
    n = inner[0]
    rows = len(range(n)[_rows(proj, layout, n)])
    return (rows,) + inner[1:]


def linear_of(w: torch.Tensor) -> nn.Linear:
    """An ``nn.Linear`` (no bias) holding ``w`` [out, in] as its weight, built without allocating."""
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
    lin.weight = nn.Parameter(w, requires_grad=False)
    return lin


def positional_arity(module: nn.Module) -> int:
    """How many positional parameters ``module.forward`` takes (the fused-expert kinds tell
    themselves apart by it: batched experts take the tokens, grouped linears tokens and counts)."""
    import inspect

    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
               for p in inspect.signature(module.forward).parameters.values())
