"""GGML's k-quant super-blocks (llama.cpp's Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): decode.

Pure functions on tensors. A super-block is 256 consecutive weights of a row, in sub-blocks with
their own scales (and, but for Q6_K, mins) quantized against the super-block's fp16 ``d`` (and
``dmin``). Bytes as GGML's ``block_q*_K`` (``ggml-common.h``), little-endian:

| type | bytes | layout | value |
|---|---|---|---|
| Q2_K | 84 | scales[16] (low nibble scale, high nibble min), qs[64] (2-bit), d, dmin | d*sc * q - dmin*m |
| Q3_K | 110 | hmask[32] (third bits), qs[64] (2-bit), scales[12] (sixteen 6-bit, offset 32), d | d*(sc-32) * (q-4) |
| Q4_K | 144 | d, dmin, scales[12] (eight 6-bit scales and mins), qs[128] (nibbles) | d*sc * q - dmin*m |
| Q5_K | 176 | d, dmin, scales[12], qh[32] (fifth bits), qs[128] | d*sc * q - dmin*m |
| Q6_K | 210 | ql[128] (low nibbles), qh[64] (2 high bits), scales[16] (int8), d | d*sc * (q - 32) |

Sub-blocks: 16 of 16 weights (Q2_K, Q3_K, Q6_K) or 8 of 32 (Q4_K, Q5_K). The arithmetic is float32 in
llama.cpp's order (``dequantize_row_q*_K``): the sub-block's scale ``d * sc`` and offset
``dmin * m`` first, then ``scale * q - offset``. Encoding: every type, in ``ggml_kquant_search``.
"""

from __future__ import annotations

import torch

from lowbit.errors import QuantizationError
from lowbit.numerics.ggml import GEOMETRY, GgmlType, bytes_in_blocks, fp16_value

SUPER = 256


#: bytes per super-block of 256 weights
SUPER_BYTES = {t: GEOMETRY[t][1] for t in (GgmlType.Q2_K, GgmlType.Q3_K, GgmlType.Q4_K, GgmlType.Q5_K, GgmlType.Q6_K)}


def _fp16(b: torch.Tensor) -> torch.Tensor:
    """2 bytes [N, 2] -> float32 [N, 1] of the fp16 they hold, to scale a super-block's rows."""
    return fp16_value(b)[:, None]


def scales_and_mins_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of Q4_K / Q5_K [N, 12] -> eight 6-bit scales and mins [N, 8] each:
    sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 in the
    nibbles of bytes 8-11 with their top two bits in the top bits of bytes 0-3 and 4-7."""
    s = s.to(torch.int32)
    lo_sc, lo_m = s[:, 0:4] & 63, s[:, 4:8] & 63
    hi_sc = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    hi_m = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], dim=1), torch.cat([lo_m, hi_m], dim=1)


def _q2_k(blk: torch.Tensor) -> torch.Tensor:
    sc = blk[:, 0:16].to(torch.int32)
    qs = blk[:, 16:80].to(torch.int32).reshape(-1, 2, 32)           # two halves of 128 weights
    d, dmin = _fp16(blk[:, 80:82]), _fp16(blk[:, 82:84])
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32).reshape(1, 1, 4, 1)
    q = (qs[:, :, None, :] >> shifts) & 3                            # [N, half, shift, 32]
    q = q.reshape(-1, 2, 4, 2, 16).to(torch.float32)                  # the 32 bytes as two runs of 16
    scale = (d * (sc & 0x0F).to(torch.float32)).reshape(-1, 2, 4, 2, 1)
    offset = (dmin * (sc >> 4).to(torch.float32)).reshape(-1, 2, 4, 2, 1)
    return (scale * q - offset).reshape(-1, SUPER)


def q3_k_scales(s: torch.Tensor) -> torch.Tensor:
    """The 12 packed bytes of Q3_K [N, 12] -> sixteen 6-bit scales [N, 16] (0..63, offset 32 not
    taken): low nibbles of bytes 0-7 for sub-blocks 0-7, their high nibbles for 8-15, and the top
    two bits of sub-block j in bits 2*(j // 4) of byte 8 + j % 4."""
    s = s.to(torch.int32)
    low = torch.cat([s[:, 0:8] & 0x0F, s[:, 0:8] >> 4], dim=1)
    j = torch.arange(16)
    high = (s[:, 8 + j % 4] >> (2 * (j // 4))) & 3
    return low | (high << 4)


def _q3_k(blk: torch.Tensor) -> torch.Tensor:
    hmask = blk[:, 0:32].to(torch.int32)
    qs = blk[:, 32:96].to(torch.int32).reshape(-1, 2, 1, 32)         # [N, half, 1, 32]
    sc = (q3_k_scales(blk[:, 96:108]) - 32).to(torch.float32)       # [N, 16]
    d = _fp16(blk[:, 108:110]).reshape(-1, 1)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32).reshape(1, 1, 4, 1)
    q = (qs >> shifts) & 3                                           # [N, half, shift, 32]
    bit = torch.arange(8, dtype=torch.int32).reshape(1, 2, 4, 1)     # hmask bit: half * 4 + shift
    high = (hmask[:, None, None, :] >> bit) & 1
    q = (q - torch.where(high == 1, 0, 4)).to(torch.float32).reshape(-1, 2, 4, 2, 16)
    scale = (d * sc).reshape(-1, 2, 4, 2, 1)
    return (scale * q).reshape(-1, SUPER)


def _q45_k(blk: torch.Tensor, five: bool) -> torch.Tensor:
    d, dmin = _fp16(blk[:, 0:2]), _fp16(blk[:, 2:4])
    sc, m = scales_and_mins_k4(blk[:, 4:16])
    qs = blk[:, 48:176] if five else blk[:, 16:144]
    qs = qs.to(torch.int32).reshape(-1, 4, 32)                       # four chunks of 64 weights
    q = torch.stack([qs & 0x0F, qs >> 4], dim=2)                     # [N, chunk, nibble, 32]
    if five:
        qh = blk[:, 16:48].to(torch.int32)                           # bit 2c (2c+1) of byte l: chunk c
        bit = torch.arange(8, dtype=torch.int32).reshape(1, 4, 2, 1)
        q = q + (((qh[:, None, None, :] >> bit) & 1) << 4)
    scale = (d * sc.to(torch.float32)).reshape(-1, 4, 2, 1)
    offset = (dmin * m.to(torch.float32)).reshape(-1, 4, 2, 1)
    return (scale * q.to(torch.float32) - offset).reshape(-1, SUPER)


def _q6_k(blk: torch.Tensor) -> torch.Tensor:
    ql = blk[:, 0:128].to(torch.int32).reshape(-1, 2, 2, 32)         # [N, half, run of 32 bytes, 32]
    qh = blk[:, 128:192].to(torch.int32).reshape(-1, 2, 1, 32)
    sc = blk[:, 192:208].contiguous().view(torch.int8).to(torch.float32).reshape(-1, 2, 8)
    d = _fp16(blk[:, 208:210]).reshape(-1, 1, 1)
    # per half of 128: weights l, l+32, l+64, l+96 take ql[l] low, ql[l+32] low, ql[l] high,
    # ql[l+32] high, with qh[l]'s bit pairs 0, 1, 2, 3 on top
    low = torch.stack([ql[:, :, 0] & 0x0F, ql[:, :, 1] & 0x0F, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], dim=2)
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.int32).reshape(1, 1, 4, 1)) & 3
    q = ((low | (high << 4)) - 32).to(torch.float32)                 # [N, half, quarter, 32]
    scale = (d * sc).reshape(-1, 2, 8)                                # sub-blocks of 16: quarter*2 + l//16
    scale = scale.reshape(-1, 2, 4, 2, 1)
    return (scale * q.reshape(-1, 2, 4, 2, 16)).reshape(-1, SUPER)


def decode(data: torch.Tensor, kind: GgmlType) -> torch.Tensor:
    """uint8 [..., n * B] super-blocks of ``kind`` -> float32 [..., n * 256], as llama.cpp dequantizes."""
    kind = GgmlType(kind)
    if kind not in SUPER_BYTES:
        raise QuantizationError(f"{kind.value} is not a k-quant type")
    lead = data.shape[:-1]
    blk = bytes_in_blocks(data, kind)
    if kind is GgmlType.Q2_K:
        out = _q2_k(blk)
    elif kind is GgmlType.Q3_K:
        out = _q3_k(blk)
    elif kind is GgmlType.Q6_K:
        out = _q6_k(blk)
    else:
        out = _q45_k(blk, kind is GgmlType.Q5_K)
    return out.reshape(*lead, -1)
