"""In-place nearest-grid rounding of one float32 vector, for GPTQ's column loop.

GPTQ rounds one column of ~1000-3000 weights at a time, ~100k times per model, so the cost
is the number of eager operations per call, not the arithmetic. ``column_rounder(fmt, n)``
returns a float32 buffer ``y`` and ``f()`` that overwrites its finite values with
``fmt.qdq(y)`` (round to nearest, ties to even, saturating), up to the sign of zero (a
negative value that rounds to zero may come back as +0.0 or -0.0): the solve only needs the
nearest grid value, and the final codes are ``quantize`` of the solved weights with the
fixed scales. Every constant is a tensor made once (a Python scalar operand costs a
conversion per call).

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


def column_rounder(fmt, n: int) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """(y, f): a float32 buffer ``y`` [n] and ``f()`` that overwrites it, holding finite values,
    with ``fmt.qdq(y)`` (up to the sign of zero) and returns it. Each call of
    ``column_rounder`` has its own buffers."""
    y = torch.empty(n, dtype=torch.float32)
    if isinstance(fmt, IntFormat):
        lo, hi = float(fmt.qmin), float(fmt.qmax)

        def round_int() -> torch.Tensor:
            return y.round_().clamp_(lo, hi)

        return y, round_int
    if not (isinstance(fmt, MiniFloat) and fmt.signed and fmt.man_bits <= 21):
        raise ValueError(f"no GPTQ column rounding for the format {fmt!r}")
    mx = float(fmt.max_finite)
    mask = torch.tensor(_EXP_MASK, dtype=torch.int32)
    lowest = torch.tensor((fmt.min_normal_exp + 127) << 23, dtype=torch.int32)
    shift = torch.tensor(((23 - fmt.man_bits) << 23) | (1 << 22), dtype=torch.int32)
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
