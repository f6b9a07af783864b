"""Scale groups: views of a tensor [..., in] as [..., G, g] and reductions per group.

All granularities run along the last dimension (the input dimension of a weight [out, in] or
of an activation [..., in]); GROUP splits it into groups of ``group_size`` (the last one
zero-padded when ragged), every other granularity is one group.
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
    return spec.granularity is Granularity.GROUP and not spec.is_microscaled


def num_groups(in_features: int, spec: QuantSpec, name: str = "tensor", shape: tuple = ()) -> int:
    if spec.granularity is not Granularity.GROUP:
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
    if spec.granularity is not Granularity.GROUP:
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
    return op(v, -1)  # [..., G]; G == 1 for CHANNEL/TOKEN


def amax(x: torch.Tensor, spec: QuantSpec, name: str = "tensor") -> torch.Tensor:
    """Absolute max per scale group (the shape of the scales of ``spec``), float32."""
    v = group_view(x.to(torch.float32), spec, name).abs()
    return reduce_groups(v, spec, lambda t, d: t.amax(d))
