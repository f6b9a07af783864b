"""Exact float32 helpers for Triton kernels, built on integer bit operations.

Every rounding step of lowbit.numerics is reproduced here with integer arithmetic on the
IEEE-754 bit pattern, so that the kernels are bit-exact with the CPU reference on any GPU:
no dependence on flush-to-zero of float32 subnormals, on approximate division, on libdevice
rint/frexp, or on FMA contraction. The only float operations the kernels use are
``tl.math.div_rn`` (IEEE round-to-nearest division) and multiplications whose operands and
results are normal float32 (or exact), plus int -> float conversions of integers below 2^24
(exact).

Conventions: magnitudes are non-negative float32 tensors; "codes" are int32 magnitude codes
of a format described by constexpr parameters (MAN mantissa bits, BIAS, EMIN = the minimum
normal exponent, MAXCODE the largest finite magnitude code, MAXBITS the float32 bit pattern
of the largest finite value). lowbit.kernels.formats derives them from lowbit.numerics.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rshift_rne(sig, r):
    """round_half_even(sig / 2^r) for int32 0 <= sig < 2^24 and int32 r >= 1 (any size)."""
    r = tl.minimum(r, 30)  # sig < 2^24 <= 2^(r-1) for r >= 25: the result is 0 either way
    q = sig >> r
    rem = sig - (q << r)
    half = (rem * 0 + 1) << (r - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    return q + up.to(tl.int32)


@triton.jit
def f32_bits(x):
    return x.to(tl.int32, bitcast=True)


@triton.jit
def bits_f32(b):
    return b.to(tl.float32, bitcast=True)


@triton.jit
def encode_mag(a, MAN: tl.constexpr, BIAS: tl.constexpr, EMIN: tl.constexpr, MAXCODE: tl.constexpr,
               MAXBITS: tl.constexpr):
    """Magnitude code (int32) of the non-negative float32 ``a`` in a small float format:
    round to nearest, ties to even, saturating (lowbit.numerics.MiniFloat._encode_magnitude).

    float32 subnormals (and zero) give code 0: every target format's half smallest subnormal
    is far above 2^-126."""
    b = tl.minimum(f32_bits(a), MAXBITS)  # non-negative floats order like their bits
    e_field = b >> 23
    sig = (b & 0x7FFFFF) | 0x800000
    p = e_field - 127  # unbiased exponent of a (normal a)
    eb = tl.maximum(p, EMIN)  # the binade whose quantum rounds a
    steps = rshift_rne(sig, (23 - MAN) + (eb - p))
    code = (eb + (BIAS - 1)) * (1 << MAN) + steps
    code = tl.minimum(code, MAXCODE)
    return tl.where(e_field == 0, 0, code)


@triton.jit
def decode_mag(code, MAN: tl.constexpr, BIAS: tl.constexpr, EMIN: tl.constexpr):
    """float32 value of an int32 magnitude code (finite codes only; exact)."""
    e_field = code >> MAN
    m = code & ((1 << MAN) - 1)
    normal = bits_f32(((e_field - BIAS + 127) << 23) | (m << (23 - MAN)))
    sub = m.to(tl.float32) * (2.0 ** (EMIN - MAN))  # exact, a normal float32
    return tl.where(e_field == 0, sub, normal)


@triton.jit
def floor_log2(a):
    """floor(log2 a) as int32 for positive float32 a, subnormals included (exact)."""
    b = f32_bits(a)
    e_field = b >> 23
    m = b & 0x7FFFFF
    # a subnormal a = m * 2^-149 with m < 2^23: m converts to float32 exactly (normal)
    e_sub = (f32_bits(m.to(tl.float32)) >> 23) - 127 - 149
    return tl.where(e_field == 0, e_sub, e_field - 127)


@triton.jit
def ldexp_exact(a, k):
    """a * 2^k for non-negative finite float32 ``a`` and int32 ``k``, correctly rounded
    (ties to even) where the result is a float32 subnormal, saturating to +Inf above the
    range. Works on bits only, so subnormal inputs and results are exact on any GPU."""
    b = f32_bits(a)
    e_field = b >> 23
    m = b & 0x7FFFFF
    # a = sig * 2^ex with sig < 2^24 an integer
    sig = tl.where(e_field == 0, m, m | 0x800000)
    ex = tl.where(e_field == 0, -149, e_field - 150)
    f = f32_bits(sig.to(tl.float32))  # sig as a normal float32 (exact): its exponent = bit length
    fe = f >> 23
    fm = f & 0x7FFFFF
    new_e = fe - 127 + ex + k + 127  # biased exponent of the result
    normal = (new_e << 23) | fm
    shift = 1 - new_e  # >= 1 where the result is subnormal
    sub = rshift_rne(fm | 0x800000, tl.maximum(shift, 1))
    out = tl.where(new_e >= 1, normal, sub)
    out = tl.where(new_e >= 255, 0x7F800000, out)
    out = tl.where(sig == 0, 0, out)
    return bits_f32(out)


@triton.jit
def round_half_even_int(a, LIMIT_BITS: tl.constexpr):
    """round_half_even(a) as int32 for non-negative float32 a, saturated at the float32 whose
    bit pattern is LIMIT_BITS (a value below 2^23)."""
    b = tl.minimum(f32_bits(a), LIMIT_BITS)
    e_field = b >> 23
    sig = (b & 0x7FFFFF) | 0x800000
    p = e_field - 127
    # a = sig * 2^(p-23); p <= 22 here (LIMIT < 2^23), so the shift 23 - p >= 1
    q = rshift_rne(sig, tl.maximum(23 - p, 1))
    return tl.where(e_field == 0, 0, q)


@triton.jit
def store_f32_as(ptr, val_bits, mask, OUT_BF16: tl.constexpr):
    """Store float32 values given as int32 bits to ``ptr``: float32, or bfloat16 rounded to
    nearest even in integer arithmetic (``ptr`` then points at an int16 view of the bf16
    output), exactly as torch's float32 -> bfloat16 conversion for finite values."""
    if OUT_BF16:
        r = (val_bits + (0x7FFF + ((val_bits >> 16) & 1))) >> 16
        tl.store(ptr, (r & 0xFFFF).to(tl.int16), mask=mask)
    else:
        tl.store(ptr, bits_f32(val_bits), mask=mask)
