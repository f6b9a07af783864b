"""Scale groups: views of a tensor [..., in] as [..., G, g] and reductions per group.

All granularities run along the last dimension (the input dimension of a weight [out, in] or
of an activation [..., in]); GROUP splits it into groups of ``group_size`` (the last one
zero-padded when ragged), every other granularity is one group. BLOCK groups the last dimension
as GROUP does and also reduces over tiles of ``group_size`` rows (the rows before the last
dimension; a ragged last tile has its own extremes): its scales keep GROUP's per-row shape
[..., rows, G], equal across the rows of a tile (``block_scales`` / ``row_scales`` convert to
and from the compact [ceil(rows/b), G] files hold).
"""

from __future__ import annotations

import torch

from lowbit.errors import QuantizationError
from lowbit.schemes import Granularity, QuantSpec


def check_finite(x: torch.Tensor, name: str) -> None:
    """QuantizationError naming ``x`` if it holds NaN or Inf. One min/max pass (NaN propagates
    into both, an Inf is one of them); the count is taken only for the error message."""
    if not x.numel() or not x.is_floating_point():
        return
    lo, hi = torch.aminmax(x)
    if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
        bad = int((~torch.isfinite(x)).sum())
        raise QuantizationError(f"tensor {name!r} (shape {tuple(x.shape)}) has {bad} NaN/Inf values")


def allows_ragged(spec: QuantSpec) -> bool:
    """A last group shorter than group_size is exact for plain fp32-scaled groups (it has its
    own amax); microscaled formats need whole blocks, as their file layouts do."""
    return grouped(spec) and not spec.is_microscaled


def grouped(spec: QuantSpec) -> bool:
    """Whether the last dimension is split into groups of ``group_size`` (GROUP, BLOCK)."""
    return spec.granularity in (Granularity.GROUP, Granularity.BLOCK)


def num_groups(in_features: int, spec: QuantSpec, name: str = "tensor", shape: tuple = ()) -> int:
    if not grouped(spec):
        return 1
    g = spec.group_size
    assert g is not None
    if in_features % g and not allows_ragged(spec):
        raise QuantizationError(
            f"tensor {name!r} with shape {tuple(shape) or (in_features,)}: last dimension {in_features} "
            f"is not a multiple of the block size {g} required by {spec.describe()}"
        )
    return -(-in_features // g)


def group_view(x: torch.Tensor, spec: QuantSpec, name: str = "tensor") -> torch.Tensor:
    """x [..., in] as [..., G, g] (zero-padded if the last group is ragged); G = 1 unless GROUP."""
    n = x.shape[-1]
    if not grouped(spec):
        return x.unsqueeze(-2)
    G = num_groups(n, spec, name, tuple(x.shape))
    g = spec.group_size
    if G * g != n:
        x = torch.nn.functional.pad(x, (0, G * g - n))
    return x.reshape(*x.shape[:-1], G, g)


def ungroup(v: torch.Tensor, in_features: int) -> torch.Tensor:
    """Inverse of group_view: [..., G, g] -> [..., in] (drops padding)."""
    v = v.reshape(*v.shape[:-2], v.shape[-2] * v.shape[-1])
    return v[..., :in_features] if v.shape[-1] != in_features else v


def reduce_groups(v: torch.Tensor, spec: QuantSpec, op) -> torch.Tensor:
    """Reduce a group view [..., G, g] to the scale shape of ``spec``."""
    if spec.granularity is Granularity.TENSOR:
        return op(v.reshape(-1), 0).reshape(1)
    r = op(v, -1)  # [..., G]; G == 1 for CHANNEL/TOKEN
    if spec.granularity is Granularity.BLOCK:
        r = _over_row_tiles(r, spec.group_size, op)
    return r


def _over_row_tiles(r: torch.Tensor, b: int, op) -> torch.Tensor:
    """``op`` over tiles of ``b`` rows of r [..., rows, G], broadcast back to every row (the last
    tile padded by repeating its last row, neutral for max and min)."""
    rows = r.shape[-2]
    if rows == 0:
        return r
    pad = (-rows) % b
    if pad:
        r = torch.cat([r, r[..., -1:, :].expand(*r.shape[:-2], pad, r.shape[-1])], dim=-2)
    t = op(r.reshape(*r.shape[:-2], -1, b, r.shape[-1]), -2)
    return t.repeat_interleave(b, dim=-2)[..., :rows, :]


def block_scales(scale: torch.Tensor, b: int) -> torch.Tensor:
    """Per-row BLOCK scales [rows, G] -> the compact [ceil(rows/b), G] (the first row of each tile)."""
    return scale[::b].contiguous()


def row_scales(compact: torch.Tensor, b: int, rows: int) -> torch.Tensor:
    """Compact BLOCK scales [ceil(rows/b), G] -> per-row [rows, G]."""
    return compact.repeat_interleave(b, dim=0)[:rows].contiguous()


def amax(x: torch.Tensor, spec: QuantSpec, name: str = "tensor") -> torch.Tensor:
    """Absolute max per scale group (the shape of the scales of ``spec``), float32."""
    v = group_view(x.to(torch.float32), spec, name).abs()
    return reduce_groups(v, spec, lambda t, d: t.amax(d))
