"""E8M0: the OCP MX scale format, a bare power of two 2^(code-127), code 0..254; 0xFF is NaN.

It has no zero and no sign. Values that are not powers of two are rounded in one of two
documented ways:

- ``rounding="floor"`` (the default): the largest power of two not above the value, i.e.
  2^floor(log2 x). This is the OCP MX scale rule, which derives the shared exponent from
  floor(log2(amax)).
- ``rounding="nearest"``: nearest in the linear domain with exact ties (3*2^k) rounding up,
  as IEEE round-to-nearest-even does on a significand with no stored mantissa bits. This
  matches ``ml_dtypes.float8_e8m0fnu``.

Zero and anything below 2^-127 encode to code 0 (2^-127); values above 2^127 (and +Inf)
saturate to code 254. Negative input is an error; NaN maps to 0xFF.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from lowbit.numerics.keys import key_table


_LUT: dict = {}


@dataclass(frozen=True)
class E8M0Format:
    name: str = "e8m0"
    bits: int = 8
    bias: int = 127
    nan_code: int = 0xFF
    max_code_magnitude: int = 254

    @property
    def max_finite(self) -> float:
        return 2.0**127

    @property
    def min_value(self) -> float:
        return 2.0**-127

    has_key_table = True  # floor rounding reads only the exponent field, which a key keeps

    @cached_property
    def key_table(self) -> torch.Tensor:
        """uint8 [65536] (CPU): ``encode`` (floor) of every 16-bit key (lowbit.numerics.keys); every
        float32 subnormal encodes to code 0, negative keys are refused before any lookup."""
        return key_table(self)

    def exponent_floor(self, x: torch.Tensor) -> torch.Tensor:
        """floor(log2 x) as int32 for positive finite float32 x (exact, via frexp)."""
        _, e = torch.frexp(x.to(torch.float32))
        return (e - 1).to(torch.int32)

    def encode(self, x: torch.Tensor, rounding: str = "floor") -> torch.Tensor:
        x = x.to(torch.float32)
        if bool((x < 0).any()):
            raise ValueError("e8m0 is unsigned: cannot encode negative values")
        nan = torch.isnan(x)
        safe = torch.where(nan | (x == 0), torch.ones_like(x), x.clamp(max=torch.finfo(torch.float32).max))
        mant, e = torch.frexp(safe)  # safe = mant * 2^e, mant in [0.5, 1)
        exp = e.to(torch.int32) - 1
        if rounding == "nearest":
            exp = exp + (mant >= 0.75).to(torch.int32)  # 1.5*2^k is the tie: round up
        elif rounding != "floor":
            raise ValueError(f"unknown e8m0 rounding {rounding!r}: use 'floor' or 'nearest'")
        code = torch.clamp(exp + self.bias, 0, self.max_code_magnitude)
        code = torch.where(x == 0, torch.zeros_like(code), code)
        code = torch.where(nan, torch.full_like(code, self.nan_code), code)
        return code.to(torch.uint8)

    def encode_exponent(self, exp: torch.Tensor) -> torch.Tensor:
        """Codes of 2^exp for integer exponents (clamped to the representable range)."""
        return torch.clamp(exp.to(torch.int32) + self.bias, 0, self.max_code_magnitude).to(torch.uint8)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.dtype != torch.uint8:
            raise TypeError(f"e8m0.decode expects uint8 codes, got {codes.dtype}")
        return self.code_values().to(codes.device).index_select(0, codes.reshape(-1).to(torch.int32)).reshape(codes.shape)

    def code_values(self) -> torch.Tensor:
        """float32 [256]: 2^(code - 127) for each code, NaN for 0xFF (built once; a lookup is
        much faster than ldexp per element)."""
        cache = _LUT.get(self)
        if cache is None:
            c = torch.arange(256, dtype=torch.int32)
            v = torch.ldexp(torch.ones(256, dtype=torch.float32), (c - self.bias).to(torch.float32))
            cache = _LUT[self] = torch.where(c == self.nan_code, torch.full_like(v, float("nan")), v)
        return cache

    def qdq(self, x: torch.Tensor, rounding: str = "floor") -> torch.Tensor:
        return self.decode(self.encode(x, rounding))

    def finite_codes(self) -> torch.Tensor:
        return torch.arange(0, 255, dtype=torch.uint8)


E8M0 = E8M0Format()
