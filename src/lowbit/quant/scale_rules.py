"""Scale rules: the scales (and zero points, global scales) of each scale group.

The arithmetic is float32 and its order of operations is part of the contract (see
lowbit.quant.qdq for the whole list of rules).
"""

from __future__ import annotations

import torch

from lowbit.errors import QuantizationError
from lowbit.kernels import codes
from lowbit.numerics import E8M0, FormatName, IntFormat, get_format
from lowbit.quant.groups import reduce_groups
from lowbit.schemes import Dynamic, Granularity, WeightObserver, QuantSpec


def elem_max(spec: QuantSpec) -> float:
    """The largest finite element value of the spec's format (qmax for INT)."""
    return get_format(spec.format).max_finite


def amax_divisor(spec: QuantSpec) -> float:
    """What an amax is divided by to give an fp32 scale: the format's largest finite value, or
    for the ``half-step`` observer (symmetric INT) (qmax - qmin) / 2 = qmax + 1/2."""
    if spec.observer is WeightObserver.HALF_STEP:
        fmt = get_format(spec.format)
        assert isinstance(fmt, IntFormat)
        return (fmt.qmax - fmt.qmin) / 2
    return elem_max(spec)


def divide(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """t / divisor, correctly rounded on every device: the divisor is a one-element tensor on
    t's device, because CUDA turns division by a Python scalar into multiplication by its
    (rounded) reciprocal, which differs from IEEE division in the last bit."""
    return t / torch.tensor([divisor], dtype=torch.float32, device=t.device)


def global_scale_from_amax(tensor_amax: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The NVFP4-style global scale, stored as the divisor scale_max * elem_max / amax.

    An all-zero tensor gets 1.0 (its block scales are then all zero)."""
    a = tensor_amax.to(torch.float32).reshape(1)
    num = torch.tensor([get_format(spec.scale_format).max_finite * elem_max(spec)], dtype=torch.float32,
                       device=a.device)
    return torch.where(a > 0, num / torch.where(a > 0, a, torch.ones_like(a)), torch.ones_like(a))


def fp32_scales(a: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """fp32 scales from a float32 amax: amax / divisor, raised to ``spec.scale_floor`` when set."""
    s = divide(a, amax_divisor(spec))
    return s if spec.scale_floor is None else torch.clamp_min(s, spec.scale_floor)


def scales_from_amax(a: torch.Tensor, spec: QuantSpec, global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Scales (symmetric) from an amax tensor, following the rules of lowbit.quant.qdq."""
    a = a.to(torch.float32)
    sf = spec.scale_format
    if sf is FormatName.FP32:
        return fp32_scales(a, spec)
    if sf is FormatName.E8M0:
        return codes.decode(E8M0, mx_scale_codes(a, spec))
    return codes.qdq(get_format(sf), raw_block_scales(a, spec, global_scale))  # fmt.qdq(raw), bit for bit


def scales_and_codes_from_amax(a: torch.Tensor, spec: QuantSpec,
                               global_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(``scales_from_amax(a, spec, global_scale)``, their codes in ``spec.scale_format``, None
    for FP32 scales): the codes a layout stores, found on the way (not encoded a second time)."""
    a = a.to(torch.float32)
    sf = spec.scale_format
    if sf is FormatName.FP32:
        return fp32_scales(a, spec), None
    fmt = get_format(sf)
    c = (mx_scale_codes(a, spec) if sf is FormatName.E8M0
         else codes.encode(fmt, raw_block_scales(a, spec, global_scale)))
    return codes.decode(fmt, c), c  # a minifloat's qdq is decode(encode(.)), bit for bit


def raw_block_scales(a: torch.Tensor, spec: QuantSpec, global_scale: torch.Tensor | None) -> torch.Tensor:
    """amax / elem_max (times the global scale), before rounding to the scale format."""
    raw = divide(a, elem_max(spec))
    if spec.global_scale:
        if global_scale is None:
            raise QuantizationError("this spec needs a global scale")
        raw = raw * global_scale.to(torch.float32)
    return raw


def mx_scale_codes(a: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """E8M0 codes of the OCP MX scales 2^(floor(log2 amax) - emax) (emax: the element format's
    largest exponent), clamped to 2^-127 .. 2^127; an all-zero group gets 2^-127.

    Read from the float32 bits of the (finite, non-negative) amaxes: a normal amax's biased
    exponent field is floor(log2 amax) + 127, so the exponent is that field - 127 - emax. A
    subnormal amax (field 0) lies below 2^-126, and zero is given 2^-127: both get code 0, as the
    clamp of floor(log2 amax) - emax <= -127 does. The code of 2^e is e + 127 (E8M0's bias), so the
    code is the field - emax, clamped to E8M0's codes (``E8M0.encode_exponent``, in place)."""
    field = (a.to(torch.float32).contiguous().view(torch.int32) >> 23) & 0xFF
    return field.sub_(mx_emax(spec)).clamp_(0, E8M0.max_code_magnitude).to(torch.uint8)


def mx_emax(spec: QuantSpec) -> int:
    """floor(log2) of the element format's largest finite value: the OCP MX ``emax``."""
    return get_format(spec.format).emax


def effective_scale(scale: torch.Tensor, spec: QuantSpec, global_scale: torch.Tensor | None) -> torch.Tensor:
    """The factor that multiplies element values: scale, or scale / global for NVFP4."""
    if spec.global_scale:
        return scale / global_scale.to(torch.float32)
    return scale


def group_range(v: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) of each scale group of the group view ``v``, widened to include 0."""
    lo = torch.clamp(reduce_groups(v, spec, lambda t, d: t.amin(d)), max=0.0)
    hi = torch.clamp(reduce_groups(v, spec, lambda t, d: t.amax(d)), min=0.0)
    return lo, hi


def asymmetric_from_range(lo: torch.Tensor, hi: torch.Tensor, fmt: IntFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric INT scale and int8 zero point from a range lo <= 0 <= hi."""
    scale = divide(hi - lo, float(fmt.qmax - fmt.qmin))
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    zp = torch.clamp(torch.round(fmt.qmin - lo / safe), fmt.qmin, fmt.qmax)
    zp = torch.where(scale > 0, zp, torch.zeros_like(zp))
    return scale, zp.to(torch.int8)


def static_scale_from_amax(a: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Per-tensor static scale for an activation spec from a calibrated amax (> 0)."""
    if spec.granularity is not Granularity.TENSOR or spec.dynamic is not Dynamic.STATIC:
        raise QuantizationError(f"static scales are per-tensor and static, not {spec.describe()}")
    a = a.to(torch.float32).reshape(1)
    return scales_from_amax(torch.where(a > 0, a, torch.ones_like(a)), spec)


def full_range_scales(v: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The ``full-range`` rule for symmetric INT: scale = extreme / qmin per scale group, where
    the extreme is the group's value of largest magnitude with its sign (the negative one when
    +a and -a tie, so that the scale is positive). It maps the extreme exactly onto qmin and
    uses all 2^bits codes; the scale is negative when the extreme is positive. An all-zero
    group gets +0.0 (zero codes)."""
    lo = reduce_groups(v, spec, lambda t, d: t.amin(d))
    hi = reduce_groups(v, spec, lambda t, d: t.amax(d))
    return full_range_from_range(lo, hi, spec)


def full_range_from_range(lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The ``full-range`` scales from each group's signed min and max (see full_range_scales)."""
    fmt = get_format(spec.format)
    assert isinstance(fmt, IntFormat)
    extreme = torch.where(-lo >= hi, lo, hi)
    return divide(extreme, float(fmt.qmin)) + 0.0
