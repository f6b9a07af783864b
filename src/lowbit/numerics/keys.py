"""Key tables: a format's reference codes of every 16-bit float32 key (derived data, filled by the
format's own ``encode``; the formats expose them as cached properties).

A key is the upper 16 bits of a float32 (sign, 8 exponent bits, 7 mantissa bits). For a
minifloat with at most ``MAX_MAN_BITS`` mantissa bits, rounding the input to odd at 7 mantissa
bits and then looking its key up equals the reference's round-to-nearest-even (the intermediate
has at least m + 2 bits; below the format's normal range its quantum is finer still), and the cut
is monotonic, so saturation, ties, subnormals and signed zeros come out as the reference encodes
them. E8M0's floor rounding reads only the exponent field, which the key keeps.
"""

from __future__ import annotations

import torch

KEY_BITS = 16     # kept upper bits of float32: sign, 8 exponent bits, 7 mantissa bits
MAX_MAN_BITS = 5  # round to odd at 7 bits is exact for targets of up to 7 - 2 mantissa bits
NO_CODE = 0xFF    # table entry for NaN keys of a format without NaN (never a 4-bit code)


def key_table(fmt) -> torch.Tensor:
    """uint8 [65536]: the reference code of each key read as the float32 ``key << 16``.

    NaN keys hold the format's NaN code (a format without NaN: NO_CODE); negative keys of
    unsigned formats hold NO_CODE and are never looked up (negative input is refused first)."""
    keys = torch.arange(1 << KEY_BITS, dtype=torch.int64)
    vals = ((keys << KEY_BITS) & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    nan = torch.isnan(vals)
    usable = ~nan if getattr(fmt, "signed", False) else ~nan & ~(vals < 0)
    table = torch.full((1 << KEY_BITS,), NO_CODE, dtype=torch.uint8)
    table[usable] = fmt.encode(vals[usable])
    if fmt.nan_code is not None:
        table[nan] = fmt.encode(vals[nan][:1])  # the reference's NaN code (sign dropped)
    return table


def key_steps(table: torch.Tensor, signed: bool) -> tuple[tuple[int, ...], int] | None:
    """(bounds, sign bits) of a key table whose magnitude codes rise by at most one from key to
    key: the first magnitude key (sign bit clear) of each magnitude code 1.., and the code bits
    of the sign (the entry of key 0x8000). A key's code is then the number of bounds its
    magnitude reaches, ORed with the sign bits when negative; checked on every non-NaN key
    (None when the table is not of that shape)."""
    t = table.to(torch.int32)
    mags = t[: 0x7F80 + 1]  # +0 .. +Inf; keys above are NaN, which encoders refuse first
    step = mags[1:] - mags[:-1]
    if int(mags[0]) != 0 or bool((step < 0).any()) or bool((step > 1).any()):
        return None
    bounds = tuple((torch.nonzero(step).flatten() + 1).tolist())
    sign = int(t[0x8000]) if signed else 0
    if sign and not torch.equal(t[0x8000: 0x8000 + mags.numel()], mags | sign):
        return None
    return bounds, sign
