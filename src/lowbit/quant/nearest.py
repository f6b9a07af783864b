"""In-place rounding to the nearest value of a number format, up to the sign of zero.

For callers that only need the nearest grid value of finite float32 values: GPTQ's column
loop (the final codes are ``quantize`` of the solved weights with the fixed scales) and the
mse scale search (it sums squared errors). Both overwrite ``y`` with ``fmt.qdq(y)`` (round to
nearest, ties to even, saturating) except that a negative value that rounds to zero may come
back as +0.0 or -0.0. ``column_rounder(fmt, n)`` is the same rounding of one vector with its
buffers and constants made once: GPTQ rounds ~100k columns of ~1000-3000 weights per model,
where the cost is the number of eager operations per call (a Python scalar operand costs a
conversion per call), not the arithmetic.

- INT: ``round`` (half to even) and clamp to [qmin, qmax].
- signed minifloats (E2M1, E4M3, E5M2): the "magic number" addition of
  ``lowbit.quant.fast_qdq.round_minifloat_``: M = 1.5 * 2^(e + 23 - m) from the exponent field
  of the clamped y (at least the format's smallest normal binade) puts y + M in a float32
  binade whose spacing is the format's quantum, so (y + M) - M is y rounded to the quantum,
  ties to even. M is an even multiple of the quantum, so -y rounds to minus what y rounds to
  and no sign fix-up is needed. (A round trip through torch's float8 dtypes measured slower.)
"""

from __future__ import annotations

from typing import Callable

import torch

from lowbit.numerics import IntFormat, MiniFloat

_EXP_MASK = 0x7F800000


def supports(fmt) -> bool:
    """Whether ``fmt`` has an in-place nearest rounding here (INT, signed minifloats)."""
    return isinstance(fmt, IntFormat) or (isinstance(fmt, MiniFloat) and fmt.signed and fmt.man_bits <= 21)


def _constants(fmt: MiniFloat, device) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]:
    i32 = dict(dtype=torch.int32, device=device)
    return (float(fmt.max_finite), torch.tensor(_EXP_MASK, **i32),
            torch.tensor((fmt.min_normal_exp + 127) << 23, **i32),
            torch.tensor(((23 - fmt.man_bits) << 23) | (1 << 22), **i32))


def round_nearest_(y: torch.Tensor, fmt) -> torch.Tensor:
    """``fmt.qdq(y)`` up to the sign of zero, in place, for a contiguous float32 tensor of finite
    values; returns y."""
    if not supports(fmt):
        raise ValueError(f"no in-place nearest rounding for the format {fmt!r}")
    if isinstance(fmt, IntFormat):
        return y.round_().clamp_(fmt.qmin, fmt.qmax)
    mx, mask, lowest, shift = _constants(fmt, y.device)
    y.clamp_(-mx, mx)
    bits = torch.bitwise_and(y.view(torch.int32), mask)
    torch.maximum(bits, lowest, out=bits)
    m = bits.add_(shift).view(torch.float32)
    return y.add_(m).sub_(m)


def column_rounder(fmt, n: int) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """(y, f): a float32 buffer ``y`` [n] and ``f()`` that overwrites it, holding finite values,
    with ``round_nearest_(y, fmt)`` and returns it. Each call has its own buffers."""
    if not supports(fmt):
        raise ValueError(f"no in-place nearest rounding for the format {fmt!r}")
    y = torch.empty(n, dtype=torch.float32)
    if isinstance(fmt, IntFormat):
        lo, hi = float(fmt.qmin), float(fmt.qmax)

        def round_int() -> torch.Tensor:
            return y.round_().clamp_(lo, hi)

        return y, round_int
    mx, mask, lowest, shift = _constants(fmt, y.device)
    y_bits = y.view(torch.int32)
    bits = torch.empty(n, dtype=torch.int32)
    m = bits.view(torch.float32)

    def round_magic() -> torch.Tensor:
        y.clamp_(-mx, mx)
        torch.bitwise_and(y_bits, mask, out=bits)
        torch.maximum(bits, lowest, out=bits)
        bits.add_(shift)
        return y.add_(m).sub_(m)

    return y, round_magic


def native_rounding(fmt) -> tuple[int, float, float, int, int, int]:
    """The rounding arguments of the native GPTQ sub-block (``lb_gptq_sub``): (kind, lo, hi,
    mask, lowest, shift); INT: (0, qmin, qmax, 0, 0, 0), signed minifloats: (1, max finite, 0,
    and the magic number constants of ``round_nearest_``)."""
    if not supports(fmt):
        raise ValueError(f"no in-place nearest rounding for the format {fmt!r}")
    if isinstance(fmt, IntFormat):
        return 0, float(fmt.qmin), float(fmt.qmax), 0, 0, 0
    mx, mask, lowest, shift = _constants(fmt, "cpu")
    return 1, mx, 0.0, int(mask), int(lowest), int(shift)
