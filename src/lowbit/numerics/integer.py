"""Signed two's-complement integers of 2 to 8 bits (INTn).

``encode`` rounds to nearest, ties to even, and saturates to [-2^(n-1), 2^(n-1)-1]; the
uint8 code holds the n-bit two's-complement pattern in its low bits (INT8 codes are the
int8 bit pattern). ``to_int``/``from_int`` give the integers themselves as int8/int32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class IntFormat:
    bits: int

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 8:
            raise ValueError(f"INTn needs 2 <= n <= 8, got {self.bits}")

    @property
    def name(self) -> str:
        return f"int{self.bits}"

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    @property
    def max_finite(self) -> float:
        return float(self.qmax)

    @property
    def emax(self) -> int:
        """floor(log2 qmax): the OCP MX ``emax`` of the format as an element format."""
        return self.qmax.bit_length() - 1

    def round(self, x: torch.Tensor) -> torch.Tensor:
        """float32 integers: round half to even, then saturate. NaN is an error."""
        x = x.to(torch.float32)
        if bool(torch.isnan(x).any()):
            raise ValueError(f"{self.name} has no NaN: cannot encode NaN input")
        return torch.clamp(torch.round(x), self.qmin, self.qmax)

    def to_int(self, x: torch.Tensor) -> torch.Tensor:
        return self.round(x).to(torch.int8)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        q = self.round(x).to(torch.int32)
        return (q & ((1 << self.bits) - 1)).to(torch.uint8)

    def codes_to_int(self, codes: torch.Tensor) -> torch.Tensor:
        """Sign-extend n-bit codes to int32."""
        c = codes.to(torch.int32) & ((1 << self.bits) - 1)
        return torch.where(c >= (1 << (self.bits - 1)), c - (1 << self.bits), c)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.dtype != torch.uint8:
            raise TypeError(f"{self.name}.decode expects uint8 codes, got {codes.dtype}")
        return self.codes_to_int(codes).to(torch.float32)

    def qdq(self, x: torch.Tensor) -> torch.Tensor:
        return self.round(x)

    def finite_codes(self) -> torch.Tensor:
        return torch.arange(0, 1 << self.bits, dtype=torch.uint8)


INT2, INT3, INT4, INT5, INT6, INT7, INT8 = (IntFormat(n) for n in range(2, 9))
