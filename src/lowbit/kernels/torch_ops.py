"""The ``torch`` implementation of the element kernels: the formats' reference ``encode`` and
``qdq`` in fewer eager passes, bit for bit (reached through lowbit.kernels.codes and
lowbit.kernels.rounding, which choose it; tested against the reference in
tests/kernels/test_kernel_conformance.py).

- Key-table formats (MiniFloat with at most 5 mantissa bits, lowbit.numerics.keys): the float32
  input is cut to its upper 16 bits with *round to odd* (the lowest kept bit is set when any
  dropped bit is) and that key indexes the format's ``key_table``. Keys that are NaN map to the
  format's NaN code; for E2M1 (no NaN) to a marker that makes the encoder raise the reference's
  error. Five in-place integer passes and one gather replace the reference's ~20 eager passes.
- INTn: round half to even, clamp, cast; NaN detected from a min/max pass (NaN propagates).
- Nearest rounding of finite float32 values to a signed minifloat's grid (ties to even,
  saturating), up to the sign of zero, by the "magic number" addition: with |y| clamped to
  max_finite and e = max(floor(log2 |y|), emin), M = 1.5 * 2^(e + 23 - m) puts y + M in
  [2^(e+23-m), 2^(e+24-m)), whose float32 spacing is the format's quantum 2^(e-m) in that
  binade, so (y + M) - M is y rounded to the quantum (ties to even, as float32 addition does)
  and exact. M is built from the exponent field of y's bits (``MiniFloat.round_magic``), clamped
  to the smallest normal binade, which also covers subnormals and zero; M is an even multiple
  of the quantum, so -y rounds to minus what y rounds to (an unsigned format's non-negative values
  round the same way). INT: ``round`` (half to even), clamp.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

import torch

from lowbit.numerics.integer import IntFormat
from lowbit.numerics.keys import KEY_BITS, NO_CODE
from lowbit.numerics.minifloat import MiniFloat


# ---------------------------------------------------------------------------- encode
def has_table(fmt: object) -> bool:
    """Whether ``fmt`` is a minifloat encoded here through its key table."""
    return isinstance(fmt, MiniFloat) and fmt.has_key_table


def key_table(fmt, device: torch.device | str = "cpu") -> torch.Tensor:
    """``fmt.key_table`` on ``device`` (copied once per device)."""
    return fmt.key_table if str(device) == "cpu" else _on_device(fmt, str(torch.device(device)))


@lru_cache(maxsize=None)
def _on_device(fmt, device: str) -> torch.Tensor:
    return fmt.key_table.to(device)


def round_to_odd_keys(x: torch.Tensor) -> torch.Tensor:
    """int32 keys in [0, 65536): the upper 16 bits of float32 ``x``, lowest bit ORed with
    whether any of the lower 16 bits is set."""
    bits = x.view(torch.int32)
    k = bits & 0xFFFF
    k += 0xFFFF        # bit 16 set iff a dropped bit is set
    k |= bits
    k >>= KEY_BITS
    k &= 0xFFFF        # drop the sign extension of the arithmetic shift
    return k


def encode_minifloat(fmt: MiniFloat, x: torch.Tensor) -> torch.Tensor:
    """``fmt.encode(x)`` through the key table (``has_table(fmt)`` must hold)."""
    x = x.to(torch.float32).contiguous()
    if not fmt.signed and bool((x < 0).any()):
        raise ValueError(f"{fmt.name} is unsigned: cannot encode negative values")
    keys = round_to_odd_keys(x)
    codes = key_table(fmt, x.device).index_select(0, keys.reshape(-1)).reshape(x.shape)
    if fmt.nan_code is None and codes.numel() and int(codes.max()) == NO_CODE:
        raise ValueError(f"{fmt.name} has no NaN: cannot encode NaN input")
    return codes


def encode_int(fmt: IntFormat, x: torch.Tensor) -> torch.Tensor:
    """``fmt.encode(x)``: round half to even, saturate, n-bit two's complement in uint8."""
    q = torch.round(x.to(torch.float32))
    q.clamp_(fmt.qmin, fmt.qmax)
    if q.numel():
        lo, hi = torch.aminmax(q)  # NaN propagates to both
        if bool(torch.isnan(lo) | torch.isnan(hi)):
            raise ValueError(f"{fmt.name} has no NaN: cannot encode NaN input")
    codes = q.to(torch.int8).view(torch.uint8)
    if fmt.bits < 8:
        codes &= (1 << fmt.bits) - 1
    return codes


def encode(fmt: object, x: torch.Tensor) -> torch.Tensor | None:
    """``fmt.encode(x)`` for a key-table minifloat or INTn, else None (no torch kernel)."""
    if has_table(fmt):
        return encode_minifloat(fmt, x)  # type: ignore[arg-type]
    if isinstance(fmt, IntFormat):
        return encode_int(fmt, x)
    return None


# ---------------------------------------------------------------------------- nearest rounding
def supports_rounding(fmt) -> bool:
    """Whether ``fmt`` has an in-place nearest rounding here: INT, and minifloats (an unsigned
    one only for non-negative values)."""
    return isinstance(fmt, IntFormat) or (isinstance(fmt, MiniFloat) and fmt.man_bits <= 21)


@lru_cache(maxsize=None)
def _magic(fmt: MiniFloat, device: str) -> tuple[float, torch.Tensor, torch.Tensor, torch.Tensor]:
    i32 = dict(dtype=torch.int32, device=device)
    mask, lowest, shift = fmt.round_magic
    return float(fmt.max_finite), torch.tensor(mask, **i32), torch.tensor(lowest, **i32), torch.tensor(shift, **i32)


def _round_magic_(y: torch.Tensor, consts, bits: torch.Tensor | None = None) -> torch.Tensor:
    """The magic-number rounding of float32 ``y`` in place (``bits``: an int32 scratch of y's
    shape, or None)."""
    mx, mask, lowest, shift = consts
    y.clamp_(-mx, mx)
    bits = torch.bitwise_and(y.view(torch.int32), mask, out=bits)
    torch.maximum(bits, lowest, out=bits)
    m = bits.add_(shift).view(torch.float32)
    return y.add_(m).sub_(m)


def round_nearest_(y: torch.Tensor, fmt) -> torch.Tensor:
    """``fmt.qdq(y)`` up to the sign of zero, in place, for a contiguous float32 tensor of finite
    values (non-negative for an unsigned format; +Inf saturates as in ``qdq``), where
    ``supports_rounding(fmt)``; returns y."""
    if isinstance(fmt, IntFormat):
        return y.round_().clamp_(fmt.qmin, fmt.qmax)
    return _round_magic_(y, _magic(fmt, str(y.device)))


def column_rounder(fmt, n: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """(y, f): a float32 buffer ``y`` [n] on ``device`` and ``f()`` that applies
    ``round_nearest_(y, fmt)`` with its scratch and constants made once (GPTQ rounds ~100k columns
    per model, where the cost is the number of eager operations per call)."""
    y = torch.empty(n, dtype=torch.float32, device=device)
    if isinstance(fmt, IntFormat):
        lo, hi = float(fmt.qmin), float(fmt.qmax)
        return y, lambda: y.round_().clamp_(lo, hi)
    consts, bits = _magic(fmt, str(y.device)), torch.empty(n, dtype=torch.int32, device=device)
    return y, lambda: _round_magic_(y, consts, bits)
