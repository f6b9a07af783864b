"""Scale selection, quantization and dequantization: pure functions on tensors.

All granularities run along the last dimension (the input dimension of a weight [out, in] or
of an activation [..., in]). The arithmetic is float32 and its order of operations is part of
the contract (every backend reproduces it bit for bit):

- INT symmetric:   scale = amax / qmax;                      q = round_half_even(x / scale)
  (symmetric fp32 scales, INT or FP, are raised to ``spec.scale_floor`` when it is set)
- INT asymmetric:  scale = (max - min) / (qmax - qmin) with min <= 0 <= max;
                   zp = clamp(round(qmin - min / scale));    q = clamp(round(x / scale) + zp)
- FP, fp32 scale:  scale = amax / elem_max;                  q = elem(x / scale)
- block, UE4M3/UE5M3 scale, no global:  s = fmt(amax_b / elem_max);      q = elem(x / s)
- block with global (NVFP4): g = (scale_max * elem_max) / amax_tensor   (the stored divisor)
                   s = fmt((amax_b / elem_max) * g); eff = s / g;       q = elem(x / eff)
- block, E8M0 (MX): s = 2^clamp(floor(log2 amax_b) - floor(log2 elem_max), -127, 127)
                   q = elem(x / s)    (saturating, as the OCP MX rule implies)

These are the ``max`` observer's scales. A spec with observer ``mse`` starts from them and
keeps, per scale group, the candidate scale with the smallest squared error
(lowbit.quant.mse_scales); the global scale stays amax-based. Given scales are used as they are.

A zero scale (all-zero group, or a block scale that rounds to zero) gives zero codes, never
a division by zero. NaN or Inf in the input is a QuantizationError naming the tensor.

``quantize`` and ``fake_quantize`` are the entry points of the quantize-groups and QDQ kernels:
the functions here are their reference, and the kernel setting (lowbit.kernels.select) decides
whether a faster implementation runs instead (native: lowbit.quant.native_quant; torch:
lowbit.quant.fast_qdq), bit-identical by test.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.kernels import codes as element_codes, triton_ops
from lowbit.kernels.select import Implementation, allows
from lowbit.numerics import IntFormat, get_format
from lowbit.quant.groups import (
    allows_ragged, amax, check_finite, group_view, num_groups, reduce_groups, ungroup,
)
from lowbit.quant import fast_qdq, native_quant
from lowbit.quant.qtensor import QuantizedTensor
from lowbit.quant.scale_rules import (
    asymmetric_from_range, effective_scale, full_range_scales, global_scale_from_amax, group_range, scales_from_amax,
    static_scale_from_amax,
)
from lowbit.quant.mse_scales import search_scales
from lowbit.schemes import WeightObserver, QuantSpec

# the views and scale rules (lowbit.quant.groups, lowbit.quant.scale_rules) stay importable from here
__all__ = [
    "quantize", "dequantize", "fake_quantize", "allows_ragged", "amax", "check_finite", "group_view",
    "num_groups", "reduce_groups", "ungroup", "asymmetric_from_range", "effective_scale",
    "global_scale_from_amax", "group_range", "scales_from_amax", "static_scale_from_amax",
]


# ---------------------------------------------------------------------------- quantize
def quantize(
    x: torch.Tensor,
    spec: QuantSpec,
    *,
    scale: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
    name: str = "tensor",
) -> QuantizedTensor:
    """Quantize ``x`` [..., in] under ``spec``.

    scale: a given per-tensor scale (static activations). Required for STATIC TENSOR specs of
        activations when ``dynamic`` is STATIC and no scale should be derived from ``x``; when
        None the scale is computed from ``x`` (weights, dynamic activations).
    global_scale: the NVFP4 divisor; computed from ``x`` when None (weights), given for
        LOCAL activations.

    CPU tensors under symmetric ``max``/``half-step``/``full-range`` specs take the native
    implementation (lowbit.quant.native_quant) where the kernel setting allows it; same bits.
    """
    if scale is None:
        qt = quantize_into(x, spec, global_scale=global_scale, name=name)
        if qt is not None:
            return qt
    p = _prepare(x, spec, scale, global_scale, name)
    scaled = p.v / p.divisor
    if p.zero_point is not None:  # round first, then add the zero point (the documented order)
        scaled = torch.round(scaled) + p.zero_point.to(torch.float32).unsqueeze(-1)
    codes = element_codes.encode(p.fmt, scaled)  # p.fmt.encode, bit for bit
    if not bool(p.nonzero.all()):
        codes.masked_fill_(~p.nonzero.unsqueeze(-1), 0)
    codes = ungroup(codes, p.n)
    return QuantizedTensor(codes=codes, scale=p.scale, spec=spec, zero_point=p.zero_point,
                           global_scale=p.global_scale)


@dataclass
class _Prepared:
    """Everything quantize and fake_quantize share: the group view and its scales."""

    fmt: object
    v: torch.Tensor               # [..., G, g] float32 group view
    n: int                        # original last dimension
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    global_scale: torch.Tensor | None
    eff: torch.Tensor             # effective scale (scale, or scale / global)
    nonzero: torch.Tensor         # eff != 0
    divisor: torch.Tensor         # eff with zeros replaced by 1, broadcastable to v


def _prepare(x, spec, scale, global_scale, name) -> _Prepared:
    check_finite(x, name)
    x32 = x.to(torch.float32)
    fmt = get_format(spec.format)
    v = group_view(x32, spec, name)
    zp = None
    if spec.global_scale and global_scale is None:
        global_scale = global_scale_from_amax(x32.abs().amax(), spec)
    if scale is None:
        if not spec.symmetric:
            scale, zp = asymmetric_from_range(*group_range(v, spec), fmt)
        elif spec.observer.rule is WeightObserver.FULL_RANGE:
            scale = full_range_scales(v, spec)
        else:
            scale = scales_from_amax(reduce_groups(v.abs(), spec, lambda t, d: t.amax(d)), spec, global_scale)
        if spec.observer.searches:
            scale, zp = search_scales(v, spec, scale, zp, global_scale)
    else:
        scale = scale.to(torch.float32)
    eff = effective_scale(scale, spec, global_scale)
    nonzero = eff != 0  # the full-range rule's scales may be negative
    divisor = torch.where(nonzero, eff, torch.ones_like(eff)).unsqueeze(-1)
    gs = global_scale.reshape(1).to(torch.float32) if spec.global_scale else None
    return _Prepared(fmt, v, x32.shape[-1], scale, zp, gs, eff, nonzero, divisor)


def dequantize(qt: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode ``qt`` back to real values: (element - zero_point) * effective scale."""
    spec = qt.spec
    n = qt.codes.shape[-1]
    vals = group_view(get_format(spec.format).decode(qt.codes), spec)
    if qt.zero_point is not None:
        vals = vals - qt.zero_point.to(torch.float32).unsqueeze(-1)
    eff = effective_scale(qt.scale, spec, qt.global_scale)
    return ungroup(vals * eff.unsqueeze(-1), n).to(dtype)


def quantize_into(x: torch.Tensor, spec: QuantSpec, *, global_scale: torch.Tensor | None = None,
                  name: str = "tensor", pack: bool = False, out: torch.Tensor | None = None) -> QuantizedTensor | None:
    """``quantize(x, spec, global_scale=...)`` by the native implementation, where the kernel
    setting allows it and it takes ``x`` under ``spec``, else None (the caller quantizes by
    ``quantize``). ``pack``: the 4-bit codes nibble-packed as they are encoded (even last
    dimension: a PackedQuantizedTensor); ``out``: contiguous uint8 where the (packed) codes go,
    e.g. a slice of a whole-tensor buffer filled band by band."""
    if not (allows(Implementation.NATIVE) and native_quant.supports(x, spec)):
        return None
    return native_quant.quantize_native(x, spec, global_scale, name, pack=pack, out=out)


def int_values(x: torch.Tensor, spec: QuantSpec, scale: torch.Tensor | None = None,
               name: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """The integer element values (float32) and effective scale ([1] or [..., 1]) of a symmetric
    per-tensor/per-token INT spec with fp32 scales: ``fake_quantize`` == values * scale, bit for
    bit, up to the sign of zero (a negative value that rounds to zero may be -0.0: the values
    feed a matmul)."""
    if allows(Implementation.TORCH):
        return fast_qdq.int_row_values(x, spec, scale, name)
    if not (isinstance(get_format(spec.format), IntFormat) and fast_qdq.row_route(spec, scale)):
        raise ValueError(f"int_values needs a symmetric per-tensor/per-token INT spec, not {spec.describe()}")
    qt = quantize(x, spec, scale=scale, name=name)
    vals = get_format(spec.format).decode(qt.codes)
    return vals, effective_scale(qt.scale, spec, None).to(torch.float32)


def fake_quantize(
    x: torch.Tensor,
    spec: QuantSpec,
    *,
    scale: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
    name: str = "tensor",
) -> torch.Tensor:
    """Quantize-dequantize in float32 (activations).

    Bit-identical to ``dequantize(quantize(...))`` but without building codes: symmetric specs
    round with the format's ``qdq`` (the same nearest value ``decode(encode(.))`` gives; +0.0
    added for INT so that -0.0 becomes the +0.0 an integer code decodes to). The torch
    implementation (lowbit.quant.fast_qdq) runs where the kernel setting allows it, the Triton
    kernels (lowbit.kernels.triton_ops) for CUDA tensors under ``using(Implementation.TRITON)``."""
    if x.is_cuda and allows(Implementation.TRITON):
        q = triton_ops.fake_quantize(x, spec, scale=scale, global_scale=global_scale, name=name)
        if q is not None:
            return q
    if allows(Implementation.TORCH):
        q = fast_qdq.qdq(x, spec, scale=scale, global_scale=global_scale, name=name)
        if q is not None:
            return q
    if not spec.symmetric:
        return dequantize(quantize(x, spec, scale=scale, global_scale=global_scale, name=name))
    p = _prepare(x, spec, scale, global_scale, name)
    q = p.fmt.qdq(p.v / p.divisor)
    if isinstance(p.fmt, IntFormat):
        q = q + 0.0
    q = torch.where(p.nonzero.unsqueeze(-1), q, torch.zeros_like(q))
    return ungroup(q * p.eff.unsqueeze(-1), p.n)
