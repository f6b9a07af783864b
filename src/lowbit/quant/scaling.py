"""Scale selection, quantization and dequantization: pure functions on tensors.

All granularities run along the last dimension (the input dimension of a weight [out, in] or
of an activation [..., in]). The arithmetic is float32 and its order of operations is part of
the contract (every backend reproduces it bit for bit):

- INT symmetric:   scale = amax / qmax;                      q = round_half_even(x / scale)
- INT asymmetric:  scale = (max - min) / (qmax - qmin) with min <= 0 <= max;
                   zp = clamp(round(qmin - min / scale));    q = clamp(round(x / scale) + zp)
- FP, fp32 scale:  scale = amax / elem_max;                  q = elem(x / scale)
- block, UE4M3/UE5M3 scale, no global:  s = fmt(amax_b / elem_max);      q = elem(x / s)
- block with global (NVFP4): g = (scale_max * elem_max) / amax_tensor   (the stored divisor)
                   s = fmt((amax_b / elem_max) * g); eff = s / g;       q = elem(x / eff)
- block, E8M0 (MX): s = 2^clamp(floor(log2 amax_b) - floor(log2 elem_max), -127, 127)
                   q = elem(x / s)    (saturating, as the OCP MX rule implies)

A zero scale (all-zero group, or a block scale that rounds to zero) gives zero codes, never
a division by zero. NaN or Inf in the input is a QuantizationError naming the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.errors import QuantizationError
from lowbit.numerics import E8M0, FormatName, IntFormat, fast_encode, get_format
from lowbit.quant.qtensor import QuantizedTensor
from lowbit.schemes import Dynamic, Granularity, QuantSpec


# ---------------------------------------------------------------------------- checks & views
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


def _reduce(v: torch.Tensor, spec: QuantSpec, op) -> torch.Tensor:
    """Reduce a group view [..., G, g] to the scale shape of ``spec``."""
    if spec.granularity is Granularity.TENSOR:
        return op(v.reshape(-1), 0).reshape(1)
    return op(v, -1)  # [..., G]; G == 1 for CHANNEL/TOKEN


def amax(x: torch.Tensor, spec: QuantSpec, name: str = "tensor") -> torch.Tensor:
    """Absolute max per scale group (the shape of the scales of ``spec``), float32."""
    v = group_view(x.to(torch.float32), spec, name).abs()
    return _reduce(v, spec, lambda t, d: t.amax(d))


# ---------------------------------------------------------------------------- scales
def _elem_max(spec: QuantSpec) -> float:
    return get_format(spec.format).max_finite


def _div(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """t / divisor, correctly rounded on every device: the divisor is a one-element tensor on
    t's device, because CUDA turns division by a Python scalar into multiplication by its
    (rounded) reciprocal, which differs from IEEE division in the last bit."""
    return t / torch.tensor([divisor], dtype=torch.float32, device=t.device)


def global_scale_from_amax(tensor_amax: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The NVFP4-style global scale, stored as the divisor scale_max * elem_max / amax.

    An all-zero tensor gets 1.0 (its block scales are then all zero)."""
    a = tensor_amax.to(torch.float32).reshape(1)
    num = torch.tensor([get_format(spec.scale_format).max_finite * _elem_max(spec)], dtype=torch.float32,
                       device=a.device)
    return torch.where(a > 0, num / torch.where(a > 0, a, torch.ones_like(a)), torch.ones_like(a))


def scales_from_amax(a: torch.Tensor, spec: QuantSpec, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Scales (symmetric) from an amax tensor, following the rules in the module docstring."""
    a = a.to(torch.float32)
    sf = spec.scale_format
    if sf is FormatName.FP32:
        return _div(a, _elem_max(spec))
    if sf is FormatName.E8M0:
        emax = int(E8M0.exponent_floor(torch.tensor(_elem_max(spec))))
        safe = torch.where(a > 0, a, torch.ones_like(a))
        e = torch.where(a > 0, E8M0.exponent_floor(safe) - emax, torch.full_like(a, -127, dtype=torch.int32))
        return E8M0.decode(E8M0.encode_exponent(torch.clamp(e, -127, 127)))
    fmt = get_format(sf)
    raw = _div(a, _elem_max(spec))
    if spec.global_scale:
        if global_scale is None:
            raise QuantizationError("this spec needs a global scale")
        raw = raw * global_scale.to(torch.float32)
    return fmt.qdq(raw)


def effective_scale(scale: torch.Tensor, spec: QuantSpec, global_scale: torch.Tensor | None) -> torch.Tensor:
    """The factor that multiplies element values: scale, or scale / global for NVFP4."""
    if spec.global_scale:
        return scale / global_scale.to(torch.float32)
    return scale


def _asymmetric(v: torch.Tensor, spec: QuantSpec, fmt: IntFormat) -> tuple[torch.Tensor, torch.Tensor]:
    lo = torch.clamp(_reduce(v, spec, lambda t, d: t.amin(d)), max=0.0)
    hi = torch.clamp(_reduce(v, spec, lambda t, d: t.amax(d)), min=0.0)
    scale = _div(hi - lo, float(fmt.qmax - fmt.qmin))
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    zp = torch.clamp(torch.round(fmt.qmin - lo / safe), fmt.qmin, fmt.qmax)
    zp = torch.where(scale > 0, zp, torch.zeros_like(zp))
    return scale, zp.to(torch.int8)


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
    """
    p = _prepare(x, spec, scale, global_scale, name)
    scaled = p.v / p.divisor
    if p.zero_point is not None:  # round first, then add the zero point (the documented order)
        scaled = torch.round(scaled) + p.zero_point.to(torch.float32).unsqueeze(-1)
    codes = fast_encode.encode(p.fmt, scaled)  # p.fmt.encode, bit for bit
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
    nonzero: torch.Tensor         # eff > 0
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
            scale, zp = _asymmetric(v, spec, fmt)
        else:
            scale = scales_from_amax(_reduce(v.abs(), spec, lambda t, d: t.amax(d)), spec, global_scale)
    else:
        scale = scale.to(torch.float32)
    eff = effective_scale(scale, spec, global_scale)
    nonzero = eff > 0
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


def fake_quantize(
    x: torch.Tensor,
    spec: QuantSpec,
    *,
    scale: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
    name: str = "tensor",
) -> torch.Tensor:
    """Quantize-dequantize in float32 (the reference path for activations).

    Bit-identical to ``dequantize(quantize(...))`` but without building codes: symmetric specs
    round with the format's ``qdq`` (the same nearest value ``decode(encode(.))`` gives; +0.0
    added for INT so that -0.0 becomes the +0.0 an integer code decodes to)."""
    if not spec.symmetric:
        return dequantize(quantize(x, spec, scale=scale, global_scale=global_scale, name=name))
    p = _prepare(x, spec, scale, global_scale, name)
    q = p.fmt.qdq(p.v / p.divisor)
    if isinstance(p.fmt, IntFormat):
        q = q + 0.0
    q = torch.where(p.nonzero.unsqueeze(-1), q, torch.zeros_like(q))
    return ungroup(q * p.eff.unsqueeze(-1), p.n)


def static_scale_from_amax(a: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Per-tensor static scale for an activation spec from a calibrated amax (> 0)."""
    if spec.granularity is not Granularity.TENSOR or spec.dynamic is not Dynamic.STATIC:
        raise QuantizationError(f"static scales are per-tensor and static, not {spec.describe()}")
    a = a.to(torch.float32).reshape(1)
    return scales_from_amax(torch.where(a > 0, a, torch.ones_like(a)), spec)
