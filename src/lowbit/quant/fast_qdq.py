"""The ``torch`` implementation of the QDQ of a spec (activations): the numbers of the reference
``fake_quantize`` (lowbit.quant.qdq), in fewer passes, for CPU tensors. Reached only through
``fake_quantize`` and ``int_values``, which choose it (lowbit.kernels.select); ``qdq`` returns None
for what it has no fast route for, and the reference runs. It only reorders work that is exact in
float32:

- Finiteness is read from the amax the scales need anyway (max propagates NaN and Inf), or
  from one sum for static per-tensor scales (a NaN or Inf element makes the sum non-finite);
  only a non-finite amax or sum runs the reference check, so the error is the reference's
  (an overflowing sum of finite values just costs that check).
- Scales are computed on tensors of one value per block or row (small) by the reference scale
  rules (``scales_from_amax``, ``effective_scale``); block scales in UE4M3 / UE5M3 take the
  reference's raw scales (``raw_block_scales``: amax / elem_max, times the global scale) rounded
  by the nearest-rounding kernel (non-negative values: ``fmt.qdq``, bit for bit).
- The element division is the reference's division by the same divisor. For E8M0 scales the
  divisor is a power of two 2^k with |k| <= 127 whose inverse is a normal float32, and
  ``v * 2^-k`` is the correctly rounded ``v / 2^k`` just as the division is: equal.
- Element rounding to a signed minifloat (E4M3, E2M1) by the nearest-rounding kernel
  (lowbit.kernels.rounding, the magic-number addition), then the sign of y (copysign: -0.0 and
  negative values that round to zero keep their sign, as ``MiniFloat.qdq`` does).
- INT rows (w8a8-int8): ``round`` (ties to even), clamp, ``+ 0.0`` (no -0.0), as the reference.
- All element passes after the first run in place on one float32 temporary.
"""

from __future__ import annotations

import torch

from lowbit.kernels.rounding import round_nearest_
from lowbit.numerics import FormatName, IntFormat, MiniFloat, get_format
from lowbit.quant.groups import check_finite
from lowbit.quant.scale_rules import effective_scale, global_scale_from_amax, raw_block_scales, scales_from_amax
from lowbit.schemes import Granularity, WeightObserver, QuantSpec

_AMAX_RULES = (WeightObserver.MAX, WeightObserver.HALF_STEP)  # scales from the amax (scales_from_amax)


# ---------------------------------------------------------------------------- element rounding
def round_minifloat_(y: torch.Tensor, fmt: MiniFloat, sign_source: torch.Tensor) -> torch.Tensor:
    """``fmt.qdq(y)`` for finite float32 ``y`` (contiguous, overwritten) of a signed minifloat.

    ``sign_source`` has y's signs (zeros included) and y's shape, or broadcasts to it: the
    tensor y was divided from by a positive divisor. Returns y."""
    return round_nearest_(y, fmt).copysign_(sign_source)


def round_int_(y: torch.Tensor, fmt: IntFormat, positive_zero: bool = True) -> torch.Tensor:
    """``fmt.qdq(y) + 0.0`` for finite float32 ``y`` (overwritten): round half to even, saturate
    and (``positive_zero``) turn -0.0 into the +0.0 an integer code decodes to. Returns y."""
    round_nearest_(y, fmt)
    return y.add_(0.0) if positive_zero else y


def _signed_minifloat(spec: QuantSpec) -> MiniFloat | None:
    fmt = get_format(spec.format)
    return fmt if isinstance(fmt, MiniFloat) and fmt.signed and fmt.man_bits <= 21 else None


# ---------------------------------------------------------------------------- routes
def block_route(spec: QuantSpec, n: int, scale) -> bool:
    """Symmetric minifloat groups over whole blocks, microscaled (block-scale-format) or with plain
    fp32 scales (FP8 block's per-token groups), scales computed from the input (dynamic / local
    activations)."""
    return (scale is None and spec.symmetric and spec.observer in _AMAX_RULES and spec.granularity is Granularity.GROUP
            and (spec.is_microscaled or spec.scale_format is FormatName.FP32) and n % spec.group_size == 0
            and _signed_minifloat(spec) is not None)


def row_route(spec: QuantSpec, scale) -> bool:
    """fp32-scaled per-tensor (static given scale, or from the input) or per-token rows,
    symmetric, INT or signed minifloat elements."""
    if not spec.symmetric or spec.scale_format is not FormatName.FP32 or spec.global_scale:
        return False
    if spec.observer not in _AMAX_RULES and scale is None:
        return False
    if spec.granularity not in (Granularity.TENSOR, Granularity.TOKEN):
        return False
    if scale is not None and spec.granularity is not Granularity.TENSOR:
        return False
    return isinstance(get_format(spec.format), IntFormat) or _signed_minifloat(spec) is not None


def qdq(
    x: torch.Tensor,
    spec: QuantSpec,
    *,
    scale: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
    name: str = "tensor",
) -> torch.Tensor | None:
    """The reference ``fake_quantize(x, spec, scale=..., global_scale=..., name=...)``, bit for bit,
    or None where this implementation has no route (the reference then runs)."""
    if x.device.type == "cpu" and x.dim() >= 1 and x.numel() > 0:
        if block_route(spec, x.shape[-1], scale):
            return _block_qdq(x, spec, global_scale, name)
        if row_route(spec, scale):
            x32, y, eff, nonzero = _row_divided(x, spec, scale, name)
            fmt = get_format(spec.format)
            if isinstance(fmt, IntFormat):
                round_int_(y, fmt)
            else:
                round_minifloat_(y, fmt, x32)
            return _scale_back(y.mul_(eff), nonzero)
    return None


def _scale_back(out: torch.Tensor, nonzero: torch.Tensor) -> torch.Tensor:
    """out (already multiplied by the effective scale) with zero-scale groups set to +0.0."""
    if bool(nonzero.all()):
        return out
    return torch.where(nonzero, out, torch.zeros((), dtype=out.dtype))


def block_amax(v: torch.Tensor) -> torch.Tensor:
    """|v|.amax(-1) of a float32 group view [..., G, g], as the reference computes it, via the
    int32 bits with the sign masked off: for non-negative floats the integer order is the
    float order, and NaN patterns are above +Inf, so a NaN or Inf element makes the block's
    amax NaN or Inf as well. (An inner reduction over 16 int32 is cheaper than over 16 float32:
    bench/quantize/RESULTS-quantize.md, "Fast activation QDQ".)"""
    return (v.view(torch.int32) & 0x7FFFFFFF).amax(-1).view(torch.float32)


def _block_qdq(x, spec, global_scale, name) -> torch.Tensor:
    x32 = x.to(torch.float32)
    g = spec.group_size
    v = x32.reshape(*x32.shape[:-1], x32.shape[-1] // g, g)
    a = block_amax(v)                                              # [..., G]
    if not bool(torch.isfinite(a).all()):
        check_finite(x, name)                                      # raises the reference error
    if spec.global_scale and global_scale is None:
        global_scale = global_scale_from_amax(a.amax(), spec)
    if spec.scale_format in (FormatName.E8M0, FormatName.FP32):
        s = scales_from_amax(a, spec, global_scale)
    else:
        s = round_nearest_(raw_block_scales(a, spec, global_scale), get_format(spec.scale_format))
    fmt = _signed_minifloat(spec)
    if spec.scale_format is FormatName.E8M0:                       # 2^-127 <= s <= 2^126: never 0
        y = v * (1.0 / s).unsqueeze(-1)                            # exact: == v / s
        round_minifloat_(y, fmt, v)
        return y.mul_(s.unsqueeze(-1)).reshape(x32.shape)
    eff = effective_scale(s, spec, global_scale if spec.global_scale else None)
    nonzero = eff > 0
    divisor = torch.where(nonzero, eff, torch.ones_like(eff)).unsqueeze(-1)
    y = v / divisor
    round_minifloat_(y, fmt, v)
    out = _scale_back(y.mul_(eff.unsqueeze(-1)), nonzero.unsqueeze(-1))
    return out.reshape(x32.shape)


def row_scale(x32: torch.Tensor, spec: QuantSpec, scale: torch.Tensor | None, name: str):
    """(effective scale, divisor, nonzero) of a row-route spec for float32 ``x32`` [..., n],
    each [1] (per tensor) or [..., 1] (per token), as the reference computes them; NaN/Inf in
    ``x32`` is the reference's error."""
    if scale is not None or spec.granularity is Granularity.TENSOR:
        if not bool(torch.isfinite(x32.sum())):
            check_finite(x32, name)
        if scale is None:
            scale = scales_from_amax(x32.abs().amax().reshape(1), spec)
        eff = scale.to(torch.float32)
    else:
        a = x32.abs().amax(-1, keepdim=True)
        if not bool(torch.isfinite(a).all()):
            check_finite(x32, name)
        eff = scales_from_amax(a, spec)
    nonzero = eff > 0
    return eff, torch.where(nonzero, eff, torch.ones_like(eff)), nonzero


def _row_divided(x, spec, scale, name):
    x32 = x.to(torch.float32)
    eff, divisor, nonzero = row_scale(x32, spec, scale, name)
    return x32, x32 / divisor, eff, nonzero


def int_row_values(x: torch.Tensor, spec: QuantSpec, scale: torch.Tensor | None = None,
                   name: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    # reached through lowbit.quant.qdq.int_values
    """The integer element values (float32) and the effective scale ([1] or [..., 1]) of an
    INT row-route spec: ``fake_quantize`` == values * scale, bit for bit, and
    the values are the decoded codes of ``quantize`` (0 where the scale is 0), except that a
    negative value that rounds to zero is -0.0 here (the same integer; the +0.0 pass is left
    out because the values feed a matmul)."""
    fmt = get_format(spec.format)
    if not (isinstance(fmt, IntFormat) and row_route(spec, scale)):
        raise ValueError(f"int_row_values needs a symmetric per-tensor/per-token INT spec, not {spec.describe()}")
    _, y, eff, nonzero = _row_divided(x, spec, scale, name)
    round_int_(y, fmt, positive_zero=False)
    if not bool(nonzero.all()):
        y = torch.where(nonzero, y, torch.zeros((), dtype=y.dtype))
    return y, eff
