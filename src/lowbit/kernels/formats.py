"""Kernel parameters of lowbit's number formats, derived from lowbit.numerics (never redefined).

A Triton kernel takes a format as a handful of constexpr integers; ``minifloat_params`` reads
them off the one definition in lowbit.numerics, so that a format has a single source.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from lowbit.numerics import FormatName, MiniFloat, get_format


def f32_bits(v: float) -> int:
    """The IEEE-754 float32 bit pattern of ``v`` as a Python int."""
    return struct.unpack("<I", struct.pack("<f", v))[0]


@dataclass(frozen=True)
class MiniFloatParams:
    man: int          # mantissa bits
    bias: int
    emin: int         # minimum normal exponent (unbiased)
    maxcode: int      # largest finite magnitude code
    maxbits: int      # float32 bits of the largest finite value
    sign_shift: int   # position of the sign bit in the code (signed formats)
    max_finite: float
    emax_floor: int   # floor(log2(max_finite)): the OCP MX "emax_elem"

    def kwargs(self, prefix: str) -> dict[str, int]:
        """constexpr keyword arguments MAN/BIAS/EMIN/MAXCODE/MAXBITS with a prefix."""
        return {f"{prefix}MAN": self.man, f"{prefix}BIAS": self.bias, f"{prefix}EMIN": self.emin,
                f"{prefix}MAXCODE": self.maxcode, f"{prefix}MAXBITS": self.maxbits}


def minifloat_params(name: FormatName) -> MiniFloatParams:
    fmt = get_format(name)
    if not isinstance(fmt, MiniFloat):
        raise TypeError(f"{name} is not a small float format")
    mf = fmt.max_finite
    return MiniFloatParams(man=fmt.man_bits, bias=fmt.bias, emin=fmt.min_normal_exp,
                           maxcode=fmt.max_code_magnitude, maxbits=f32_bits(mf),
                           sign_shift=fmt.exp_bits + fmt.man_bits, max_finite=mf, emax_floor=fmt.emax)
