"""Small floating-point formats (FP4 E2M1, FP6 E2M3/E3M2, FP8 E4M3FN/E5M2, UE4M3, UE5M3).

One parametrised definition serves every format: an element is sign (optional), ``exp_bits``
exponent bits with ``bias`` and ``man_bits`` mantissa bits; exponent field 0 is subnormal.
Encoding rounds to nearest with ties to even and saturates to the largest finite value.

The arithmetic is exact in float32: inputs are widened to float32 first, the rounding step
scales by a power of two (exact) and rounds with ``torch.round`` (ties to even). Because the
code's lowest bit is the mantissa's lowest bit, ties-to-even on the significand equals
ties-to-even on the code, including when the mantissa carries into the next binade.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import torch

from lowbit.numerics.keys import MAX_MAN_BITS, key_table, key_steps


@dataclass(frozen=True)
class MiniFloat:
    """A small float format. Codes are ``torch.uint8``, one per element.

    ``max_code_magnitude`` is the magnitude code of the largest finite value; codes above it
    (when any) are NaN/Inf patterns. ``nan_code`` is the magnitude code used for NaN, or None
    when the format has no NaN (E2M1); then NaN input is an error. ``unused_sign_bit`` marks an
    unsigned format stored in a signed layout with the sign forced to 0 (UE4M3: 8 bits).
    """

    name: str
    exp_bits: int
    man_bits: int
    bias: int
    signed: bool
    max_code_magnitude: int
    nan_code: int | None
    has_inf: bool = False
    unused_sign_bit: bool = False
    description: str = field(default="", compare=False)

    # ------------------------------------------------------------------ constants
    @property
    def bits(self) -> int:
        return self.exp_bits + self.man_bits + (1 if self.signed or self.unused_sign_bit else 0)

    @property
    def sign_bit(self) -> int:
        return 1 << (self.exp_bits + self.man_bits)

    @property
    def min_normal_exp(self) -> int:
        return 1 - self.bias

    @property
    def min_normal(self) -> float:
        return 2.0 ** self.min_normal_exp

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.min_normal_exp - self.man_bits)

    @cached_property
    def max_finite(self) -> float:
        return float(self._magnitude_value(self.max_code_magnitude))

    @cached_property
    def emax(self) -> int:
        """floor(log2 max_finite): the OCP MX ``emax`` of the format as an element format."""
        return math.frexp(self.max_finite)[1] - 1

    @cached_property
    def round_magic(self) -> tuple[int, int, int]:
        """The int32 constants of the "magic number" rounding to the format's grid (the torch
        kernels, lowbit.kernels.rounding, and the native GPTQ loop): (exponent-field mask, the
        bits of the smallest normal binade, the addend that turns 2^e into 1.5 * 2^(e + 23 - m))."""
        return 0x7F800000, (self.min_normal_exp + 127) << 23, ((23 - self.man_bits) << 23) | (1 << 22)

    @property
    def has_key_table(self) -> bool:
        """Whether ``encode`` equals a lookup of the round-to-odd 16-bit key (lowbit.numerics.keys):
        at most 5 mantissa bits, and a NaN code or at most 4 bits (so NaN keys can be marked)."""
        return self.man_bits <= MAX_MAN_BITS and (self.nan_code is not None or self.bits <= 4)

    @cached_property
    def key_table(self) -> torch.Tensor:
        """uint8 [65536] (CPU): ``encode`` of every 16-bit key (lowbit.numerics.keys), built once."""
        if not self.has_key_table:
            raise ValueError(f"{self.name} is not encoded through a key table")
        return key_table(self)

    @cached_property
    def key_steps(self) -> tuple[tuple[int, ...], int] | None:
        """``key_table`` as (bounds, sign bits) (lowbit.numerics.keys.key_steps), or None."""
        return key_steps(self.key_table, self.signed) if self.has_key_table else None

    def _magnitude_value(self, code: int) -> float:
        e = code >> self.man_bits
        m = code & ((1 << self.man_bits) - 1)
        if e == 0:
            return m * 2.0 ** (self.min_normal_exp - self.man_bits)
        return (1 + m / 2**self.man_bits) * 2.0 ** (e - self.bias)

    def finite_codes(self) -> torch.Tensor:
        """Every code that decodes to a finite value (both signs where signed), as uint8."""
        mags = list(range(self.max_code_magnitude + 1))
        codes = mags + ([m | self.sign_bit for m in mags] if self.signed else [])
        return torch.tensor(codes, dtype=torch.uint8)

    def values(self) -> torch.Tensor:
        """Sorted distinct finite non-negative values of the format (float32)."""
        return torch.tensor(
            [self._magnitude_value(c) for c in range(self.max_code_magnitude + 1)], dtype=torch.float32
        )

    # ------------------------------------------------------------------ encode
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Round ``x`` to the nearest representable value (ties to even, saturating).

        NaN maps to the NaN code (an error for formats without NaN); +-Inf saturates to the
        largest finite value like every other out-of-range value. Unsigned formats refuse
        negative input (-0.0 encodes as 0).
        """
        bits, nan = self._checked_bits(x)
        code = self._encode_magnitude(bits & 0x7FFFFFFF)
        if self.nan_code is not None:
            code = torch.where(nan, torch.full_like(code, self.nan_code), code)
        if self.signed:
            # sign bit of the input (-0.0 keeps its sign), except for NaN
            sign = (bits >> 31) & 1
            sign = torch.where(nan, torch.zeros_like(sign), sign)
            code = code | (sign << (self.exp_bits + self.man_bits))
        return code.to(torch.uint8)

    def _checked_bits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(int32 bit patterns of x as float32, NaN mask), refusing NaN for formats without NaN
        and negative values for unsigned formats."""
        x = x.to(torch.float32)
        nan = torch.isnan(x)
        if self.nan_code is None and bool(nan.any()):
            raise ValueError(f"{self.name} has no NaN: cannot encode NaN input")
        if not self.signed and bool((x < 0).any()):
            raise ValueError(f"{self.name} is unsigned: cannot encode negative values")
        return x.view(torch.int32), nan

    def _binade(self, abs_bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(|x| saturated to max_finite, its binade exponent e, 2^(man_bits - e)) from the bits of |x|.

        The exponent is read from the float32 exponent field; zero and float32 subnormals fall
        below the format's smallest binade and are clamped to it. The factor is a normal power
        of two built from its bits, so multiplying by it is exact."""
        a = torch.clamp(abs_bits.view(torch.float32), max=self.max_finite)  # saturate (also +Inf)
        e = torch.clamp(((a.view(torch.int32) >> 23) & 0xFF) - 127, min=self.min_normal_exp)
        factor = ((self.man_bits + 127 - e) << 23).view(torch.float32)
        return a, e, factor

    def _encode_magnitude(self, abs_bits: torch.Tensor) -> torch.Tensor:
        """int32 magnitude codes from the int32 bit patterns of |x| (float32; NaN -> garbage)."""
        a, e, factor = self._binade(abs_bits)
        steps = torch.round(a * factor).to(torch.int32)  # exact multiple of the binade's quantum
        # steps counts quanta of size 2^(e-man_bits). For a normal binade, steps lies in
        # [2^m, 2^(m+1)] and the code is (e+bias-1)*2^m + steps, which also covers the carry
        # into the next binade (steps == 2^(m+1)). For the subnormal range (e == emin),
        # steps in [0, 2^(m+1)] and the same formula with e+bias-1 == 0 holds.
        code = (e + (self.bias - 1)) * (1 << self.man_bits) + steps
        return torch.clamp(code, max=self.max_code_magnitude)

    # ------------------------------------------------------------------ decode
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """float32 values of uint8 ``codes`` (NaN codes decode to NaN, Inf codes to Inf)."""
        if codes.dtype != torch.uint8:
            raise TypeError(f"{self.name}.decode expects uint8 codes, got {codes.dtype}")
        return self.code_values().to(codes.device).index_select(0, codes.reshape(-1).to(torch.int32)).reshape(codes.shape)

    def code_values(self) -> torch.Tensor:
        """float32 [256]: the value of each uint8 code (NaN for codes outside the format's bit
        width and for its NaN codes), built once; ``decode`` is a gather through it."""
        cache = self.__dict__.get("_lut_cache")
        if cache is None:
            n_mag = 1 << (self.exp_bits + self.man_bits)
            n_codes = n_mag * (2 if self.signed else 1)
            inf_code = ((1 << self.exp_bits) - 1) << self.man_bits
            table = []
            for code in range(256):
                mag = code & (n_mag - 1)
                if code >= n_codes:
                    v = float("nan")  # outside the format's bit width
                elif mag <= self.max_code_magnitude:
                    v = self._magnitude_value(mag)
                elif self.has_inf and mag == inf_code:
                    v = float("inf")
                else:
                    v = float("nan")
                negative = self.signed and code < n_codes and bool(code & self.sign_bit)
                table.append(-v if negative else v)
            cache = torch.tensor(table, dtype=torch.float32)
            object.__setattr__(self, "_lut_cache", cache)
        return cache

    # ------------------------------------------------------------------ QDQ
    def qdq(self, x: torch.Tensor) -> torch.Tensor:
        """Quantize-dequantize: the nearest representable float32 value of each element.

        Equal bit for bit to ``decode(encode(x))`` (zero signs and NaN included), computed in
        float32 without building codes: the same binade exponent and power-of-two factor as
        ``encode``, rounding, then scaling back by the inverse power of two (exact)."""
        bits, nan = self._checked_bits(x)
        a, e, factor = self._binade(bits & 0x7FFFFFFF)
        inverse = ((127 - self.man_bits + e) << 23).view(torch.float32)  # 2^(e - man_bits)
        q = torch.round(a * factor) * inverse
        if self.signed:
            q = (q.view(torch.int32) | (bits & -(1 << 31))).view(torch.float32)
        if self.nan_code is not None:
            q = torch.where(nan, torch.full_like(q, float("nan")), q)
        return q

    def __repr__(self) -> str:  # keep reprs short in scheme listings
        return f"MiniFloat({self.name})"


E2M1 = MiniFloat("e2m1", exp_bits=2, man_bits=1, bias=1, signed=True, max_code_magnitude=0b111,
                 nan_code=None, description="FP4 E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6; no NaN/Inf")
E2M3 = MiniFloat("e2m3", exp_bits=2, man_bits=3, bias=1, signed=True, max_code_magnitude=0b11111,
                 nan_code=None, description="FP6 E2M3 (OCP MX): max 7.5, subnormals down to 0.125; no NaN/Inf")
E3M2 = MiniFloat("e3m2", exp_bits=3, man_bits=2, bias=3, signed=True, max_code_magnitude=0b11111,
                 nan_code=None, description="FP6 E3M2 (OCP MX): max 28, subnormals down to 0.0625; no NaN/Inf")
E4M3 = MiniFloat("e4m3", exp_bits=4, man_bits=3, bias=7, signed=True, max_code_magnitude=0x7E,
                 nan_code=0x7F, description="FP8 E4M3FN: max 448, NaN 0x7F/0xFF, no Inf")
E5M2 = MiniFloat("e5m2", exp_bits=5, man_bits=2, bias=15, signed=True, max_code_magnitude=0x7B,
                 nan_code=0x7E, has_inf=True, description="FP8 E5M2: max 57344, IEEE Inf/NaN")
UE4M3 = MiniFloat("ue4m3", exp_bits=4, man_bits=3, bias=7, signed=False, max_code_magnitude=0x7E,
                  nan_code=0x7F, unused_sign_bit=True, description="unsigned E4M3 (NVFP4 block scale): max 448")
UE5M3 = MiniFloat("ue5m3", exp_bits=5, man_bits=3, bias=15, signed=False, max_code_magnitude=0xFE,
                  nan_code=0xFF, description="unsigned E5M3 (NVFP4-E5M3 block scale): max 114688, "
                  "subnormals down to 2^-17, only 0xFF is NaN")
