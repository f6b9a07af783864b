"""GGML's original block types (llama.cpp's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1): encode and decode.

Pure functions on tensors. A block is 32 consecutive weights of a row; its bytes are GGML's
(``ggml-common.h``), little-endian:

| type | bytes | layout | value of code q |
|---|---|---|---|
| Q8_0 | 34 | d (fp16), 32 int8 codes | q * d |
| Q4_0 | 18 | d (fp16), 16 bytes of nibbles | (q - 8) * d |
| Q4_1 | 20 | d (fp16), m (fp16), 16 bytes of nibbles | q * d + m |
| Q5_0 | 22 | d (fp16), qh (32 fifth bits, uint32), 16 bytes of nibbles | (q - 16) * d |
| Q5_1 | 24 | d (fp16), m (fp16), qh, 16 bytes of nibbles | q * d + m |

Nibbles: byte j holds element j in its low nibble and element j + 16 in its high one; qh's bit
j is the fifth bit of element j.

Encoding is llama.cpp's reference quantizer (``quantize_row_*_ref``), byte for byte, which is
*not* lowbit's usual round-to-nearest-even: the format's definition says otherwise.
- Q8_0: d = amax / 127; q = roundf(x * (1/d)) (ties away from zero).
- Q4_0 / Q5_0: d = v / -8 (-16), v the element of largest magnitude (the first one on a tie), so
  that v takes the code 0; q = min(15 (31), trunc(x * (1/d) + 8.5 (16.5))).
- Q4_1 / Q5_1: d = (max - min) / 15 (31), m = min; q = min(15 (31), trunc((x - min) * (1/d) + 0.5)).
The inverse 1/d is taken of the float32 d before d is rounded to fp16 (as llama.cpp does); a zero
d gives inverse 0. Decoding is float32 as llama.cpp's ``dequantize_row_*``: q * d, then + m.
A NaN or infinite weight is a QuantizationError naming the tensor.
"""

from __future__ import annotations

import torch

from lowbit.errors import QuantizationError
from lowbit.numerics.ggml import GEOMETRY, GgmlType, bytes_in_blocks, fp16_bytes, fp16_value, weights_in_rows

BLOCK = 32


#: bytes per block of 32 weights
BLOCK_BYTES = {t: GEOMETRY[t][1] for t in (GgmlType.Q8_0, GgmlType.Q4_0, GgmlType.Q4_1, GgmlType.Q5_0,
                                              GgmlType.Q5_1)}
_BITS = {GgmlType.Q4_0: 4, GgmlType.Q4_1: 4, GgmlType.Q5_0: 5, GgmlType.Q5_1: 5}
_MIN_TYPES = (GgmlType.Q4_1, GgmlType.Q5_1)


def roundf(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: to nearest, ties away from zero (exact: the fraction is taken without rounding)."""
    a = x.abs()
    t = torch.trunc(a)
    return torch.copysign(t + (a - t >= 0.5).to(x.dtype), x)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """1/d by IEEE division (not ``1.0 / d``: torch turns a number over a tensor into a
    multiplication by the reciprocal), 0 where d is 0."""
    safe = torch.where(d == 0, torch.ones_like(d), d)
    return torch.where(d == 0, torch.zeros_like(d), torch.ones_like(d) / safe)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """codes [N, 32] (< 16 after masking) -> [N, 16]: element j low nibble, j + 16 high."""
    q = q.to(torch.uint8)
    return (q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)


def fifth_bits(q: torch.Tensor) -> torch.Tensor:
    """codes [N, 32] -> qh [N, 4]: bit j (little-endian uint32) is bit 4 of element j."""
    bits = ((q.to(torch.int64) >> 4) & 1) << torch.arange(BLOCK, dtype=torch.int64)
    word = bits.sum(dim=1)
    return torch.stack([(word >> (8 * i)) & 0xFF for i in range(4)], dim=1).to(torch.uint8)


def encode(x: torch.Tensor, kind: GgmlType, name: str = "tensor") -> torch.Tensor:
    """llama.cpp's reference encoding of ``x`` [..., K] (K a multiple of 32) as uint8 [..., K / 32 * B]."""
    kind = GgmlType(kind)
    if kind not in BLOCK_BYTES:
        raise QuantizationError(f"{kind.value} is not one of GGML's 32-weight block types")
    lead = x.shape[:-1]
    b = weights_in_rows(x, BLOCK, name)
    if kind is GgmlType.Q8_0:
        d = b.abs().amax(dim=1) / 127
        q = roundf(b * _inverse(d)[:, None]).to(torch.int8).view(torch.uint8)
        out = torch.cat([fp16_bytes(d), q], dim=1)
    elif kind in _MIN_TYPES:
        top = (1 << _BITS[kind]) - 1
        lo, hi = b.amin(dim=1), b.amax(dim=1)
        d = (hi - lo) / top
        q = torch.trunc((b - lo[:, None]) * _inverse(d)[:, None] + 0.5).clamp(0, top)
        head = [fp16_bytes(d), fp16_bytes(lo)] + ([fifth_bits(q)] if _BITS[kind] == 5 else [])
        out = torch.cat(head + [pack_nibbles(q)], dim=1)
    else:  # Q4_0 / Q5_0
        half = 1 << (_BITS[kind] - 1)
        v = b.gather(1, b.abs().argmax(dim=1, keepdim=True)).squeeze(1)  # argmax: the first on a tie
        d = v / -half
        q = torch.trunc(b * _inverse(d)[:, None] + (half + 0.5)).clamp(0, 2 * half - 1)
        head = [fp16_bytes(d)] + ([fifth_bits(q)] if _BITS[kind] == 5 else [])
        out = torch.cat(head + [pack_nibbles(q)], dim=1)
    return out.reshape(*lead, -1)


def decode(data: torch.Tensor, kind: GgmlType) -> torch.Tensor:
    """uint8 [..., n * B] blocks of ``kind`` -> float32 [..., n * 32], as llama.cpp dequantizes."""
    kind = GgmlType(kind)
    if kind not in BLOCK_BYTES:
        raise QuantizationError(f"{kind.value} is not one of GGML's 32-weight block types")
    lead = data.shape[:-1]
    blk = bytes_in_blocks(data, kind)
    d = fp16_value(blk[:, 0:2])[:, None]
    if kind is GgmlType.Q8_0:
        q = blk[:, 2:].contiguous().view(torch.int8).to(torch.float32)
        return (q * d).reshape(*lead, -1)
    at = 4 if kind in _MIN_TYPES else 2
    qs = blk[:, at + (4 if _BITS[kind] == 5 else 0):]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1).to(torch.int32)
    if _BITS[kind] == 5:
        qh = blk[:, at:at + 4].to(torch.int64)
        word = qh[:, 0] | (qh[:, 1] << 8) | (qh[:, 2] << 16) | (qh[:, 3] << 24)
        q = q | (((word[:, None] >> torch.arange(BLOCK, dtype=torch.int64)) & 1) << 4).to(torch.int32)
    if kind in _MIN_TYPES:
        m = fp16_value(blk[:, 2:4])[:, None]
        return (q.to(torch.float32) * d + m).reshape(*lead, -1)
    return ((q - (1 << (_BITS[kind] - 1))).to(torch.float32) * d).reshape(*lead, -1)
