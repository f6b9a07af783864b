"""Number formats: one definition of each, used by every scheme, module, writer and backend.

    from lowbit.numerics import E2M1, E4M3, UE4M3, UE5M3, E8M0
    codes = UE5M3.encode(x)      # uint8, one code per element, bit layout as the spec
    vals = UE5M3.decode(codes)   # float32

Every format has ``encode`` (round to nearest, ties to even, saturating), ``decode``,
``qdq`` and its constants (``max_finite``, ``bits``...). ``FormatName`` names them in
schemes and files; ``get_format`` maps a name to its definition.
"""

from __future__ import annotations

from enum import Enum
from typing import Union

from lowbit.numerics.e8m0 import E8M0, E8M0Format
from lowbit.numerics.integer import INT2, INT3, INT4, INT5, INT6, INT7, INT8, IntFormat
from lowbit.numerics.minifloat import E2M1, E2M3, E3M2, E4M3, E5M2, UE4M3, UE5M3, MiniFloat

NumberFormat = Union[MiniFloat, IntFormat, E8M0Format]


class FormatName(str, Enum):
    INT2 = "int2"
    INT3 = "int3"
    INT4 = "int4"
    INT5 = "int5"
    INT6 = "int6"
    INT7 = "int7"
    INT8 = "int8"
    E2M1 = "e2m1"
    E2M3 = "e2m3"
    E3M2 = "e3m2"
    E4M3 = "e4m3"
    E5M2 = "e5m2"
    UE4M3 = "ue4m3"
    UE5M3 = "ue5m3"
    E8M0 = "e8m0"
    FP32 = "fp32"  # plain float32 scales (no rounding)

    def __str__(self) -> str:
        return self.value


_FORMATS: dict[FormatName, NumberFormat] = {
    FormatName.INT2: INT2, FormatName.INT3: INT3, FormatName.INT4: INT4, FormatName.INT5: INT5,
    FormatName.INT6: INT6, FormatName.INT7: INT7, FormatName.INT8: INT8,
    FormatName.E2M1: E2M1, FormatName.E2M3: E2M3, FormatName.E3M2: E3M2, FormatName.E4M3: E4M3, FormatName.E5M2: E5M2,
    FormatName.UE4M3: UE4M3, FormatName.UE5M3: UE5M3, FormatName.E8M0: E8M0,
}


def get_format(name: FormatName | str) -> NumberFormat:
    """The format definition for ``name`` (FP32 has none: it means unrounded float32)."""
    key = FormatName(name)
    if key is FormatName.FP32:
        raise KeyError("fp32 is not a quantized number format")
    return _FORMATS[key]


def is_integer(name: FormatName) -> bool:
    return isinstance(_FORMATS.get(FormatName(name)), IntFormat)


__all__ = [
    "E2M1", "E2M3", "E3M2", "E4M3", "E5M2", "UE4M3", "UE5M3", "E8M0", "INT2", "INT3", "INT4", "INT5", "INT6",
    "INT7", "INT8", "MiniFloat", "IntFormat", "E8M0Format", "FormatName", "NumberFormat",
    "get_format", "is_integer",
]
