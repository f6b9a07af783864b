"""The integer codes of GGML's affine types and the grid their stored scales lay: read, replace.

Every type of ``ggml_blocks`` and ``ggml_kquants`` stores, per group of ``group`` consecutive
weights of a row, a step and an offset (from its fp16 and 4/6/8-bit scale bytes), and per weight
an integer code c in [cmin, cmax]; llama.cpp dequantizes it as ``step * (c - zero) - offset``:

| type | group | codes | zero | step | offset |
|---|---|---|---|---|---|
| Q8_0 | 32 | -128..127 (int8) | 0 | d | 0 |
| Q4_0 / Q5_0 | 32 | 0..15 / 0..31 | 8 / 16 | d | 0 |
| Q4_1 / Q5_1 | 32 | 0..15 / 0..31 | 0 | d | -m |
| Q2_K | 16 | 0..3 | 0 | d * sc | dmin * m |
| Q3_K | 16 | 0..7 | 4 | d * (sc - 32) | 0 |
| Q4_K / Q5_K | 32 | 0..15 / 0..31 | 0 | d * sc | dmin * m |
| Q6_K | 16 | 0..63 | 32 | d * sc | 0 |

``grid_of(data, kind)`` reads the steps and offsets of encoded rows, ``codes_of`` their codes,
``with_codes(data, kind, codes)`` writes other codes under the same scales: an error-compensating
rounding (``lowbit.algorithms.gptq_grid``) keeps the scales an encoder chose and picks the codes.
``GgmlGrid.values(codes)`` computes the values in llama.cpp's order, bit-identical to ``decode``
(tests/numerics/test_ggml_codes.py). MXFP4 and NVFP4 are not affine in their codes: not here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.errors import QuantizationError
from lowbit.numerics.ggml import GEOMETRY, GgmlType, fp16_value
from lowbit.numerics.ggml_kquants import q3_k_scales, scales_and_mins_k4


@dataclass(frozen=True)
class GgmlGrid:
    """The values GGML ``kind`` allows for rows [R, K] under fixed stored scales: weight (r, k)
    takes ``step[r, k // group] * (c - zero) - offset[r, k // group]`` for c in [cmin, cmax]."""

    kind: GgmlType
    step: torch.Tensor    # float32 [R, K / group]
    offset: torch.Tensor  # float32 [R, K / group]
    group: int
    zero: int
    cmin: int
    cmax: int

    def values(self, codes: torch.Tensor) -> torch.Tensor:
        """float32 [R, K] of integer ``codes`` [R, K], as llama.cpp dequantizes them."""
        r, k = codes.shape
        c = (codes.to(torch.int32) - self.zero).to(torch.float32).reshape(r, -1, self.group)
        return (self.step[:, :, None] * c - self.offset[:, :, None]).reshape(r, k)


AFFINE = (GgmlType.Q8_0, GgmlType.Q4_0, GgmlType.Q4_1, GgmlType.Q5_0, GgmlType.Q5_1, GgmlType.Q2_K,
          GgmlType.Q3_K, GgmlType.Q4_K, GgmlType.Q5_K, GgmlType.Q6_K)
_LAYOUT = {  # group, zero, cmin, cmax
    GgmlType.Q8_0: (32, 0, -128, 127), GgmlType.Q4_0: (32, 8, 0, 15), GgmlType.Q5_0: (32, 16, 0, 31),
    GgmlType.Q4_1: (32, 0, 0, 15), GgmlType.Q5_1: (32, 0, 0, 31), GgmlType.Q2_K: (16, 0, 0, 3),
    GgmlType.Q3_K: (16, 4, 0, 7), GgmlType.Q4_K: (32, 0, 0, 15), GgmlType.Q5_K: (32, 0, 0, 31),
    GgmlType.Q6_K: (16, 32, 0, 63)}


def _blocks(data: torch.Tensor, kind: GgmlType) -> torch.Tensor:
    kind = GgmlType(kind)
    if kind not in _LAYOUT:
        raise QuantizationError(f"{kind.value} has no affine codes (GGML types with them: "
                                f"{', '.join(t.value for t in AFFINE)})")
    nb = GEOMETRY[kind][1]
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[-1] % nb:
        raise QuantizationError(f"{kind.value} rows must be uint8 [R, whole blocks of {nb} bytes], got "
                                f"{data.dtype} {list(data.shape)}")
    return data.reshape(-1, nb).to(torch.int32)


def grid_of(data: torch.Tensor, kind: GgmlType) -> GgmlGrid:
    """The steps and offsets stored in encoded rows ``data`` uint8 [R, row bytes] of ``kind``."""
    kind = GgmlType(kind)
    blk = _blocks(data, kind)
    rows = data.shape[0]
    group, zero, cmin, cmax = _LAYOUT[kind]
    d = fp16_value(blk[:, 0:2].to(torch.uint8))[:, None]
    if kind in (GgmlType.Q8_0, GgmlType.Q4_0, GgmlType.Q5_0):
        step, offset = d, torch.zeros_like(d)
    elif kind in (GgmlType.Q4_1, GgmlType.Q5_1):
        step, offset = d, -fp16_value(blk[:, 2:4].to(torch.uint8))[:, None]
    elif kind is GgmlType.Q2_K:
        sc = blk[:, 0:16]
        d, dmin = (fp16_value(blk[:, a:a + 2].to(torch.uint8))[:, None] for a in (80, 82))
        step, offset = d * (sc & 0x0F).to(torch.float32), dmin * (sc >> 4).to(torch.float32)
    elif kind is GgmlType.Q3_K:
        d = fp16_value(blk[:, 108:110].to(torch.uint8))[:, None]
        step = d * (q3_k_scales(blk[:, 96:108]) - 32).to(torch.float32)
        offset = torch.zeros_like(step)
    elif kind in (GgmlType.Q4_K, GgmlType.Q5_K):
        dmin = fp16_value(blk[:, 2:4].to(torch.uint8))[:, None]
        sc, m = scales_and_mins_k4(blk[:, 4:16])
        step, offset = d * sc.to(torch.float32), dmin * m.to(torch.float32)
    else:  # Q6_K
        d = fp16_value(blk[:, 208:210].to(torch.uint8))[:, None]
        step = d * blk[:, 192:208].to(torch.uint8).view(torch.int8).to(torch.float32)
        offset = torch.zeros_like(step)
    return GgmlGrid(kind, step.reshape(rows, -1), offset.reshape(rows, -1), group, zero, cmin, cmax)


def codes_of(data: torch.Tensor, kind: GgmlType) -> torch.Tensor:
    """The codes [R, K] (int32, in [cmin, cmax]) of encoded rows ``data`` uint8 [R, row bytes]."""
    kind = GgmlType(kind)
    blk = _blocks(data, kind)
    rows = data.shape[0]
    if kind is GgmlType.Q8_0:
        c = blk[:, 2:].to(torch.uint8).view(torch.int8).to(torch.int32)
    elif kind in (GgmlType.Q4_0, GgmlType.Q5_0, GgmlType.Q4_1, GgmlType.Q5_1):
        at = 2 if kind in (GgmlType.Q4_0, GgmlType.Q5_0) else 4
        five = kind in (GgmlType.Q5_0, GgmlType.Q5_1)
        qs = blk[:, at + (4 if five else 0):]
        c = torch.cat([qs & 0x0F, qs >> 4], dim=1)
        if five:
            qh = blk[:, at:at + 4]
            word = qh[:, 0] | (qh[:, 1] << 8) | (qh[:, 2] << 16) | (qh[:, 3] << 24)
            c = c | (((word[:, None] >> torch.arange(32, dtype=torch.int32)) & 1) << 4)
    elif kind is GgmlType.Q2_K:
        qs = blk[:, 16:80].reshape(-1, 2, 1, 32)                       # element h*128 + s*32 + l
        c = (qs >> _SHIFT2) & 3
    elif kind is GgmlType.Q3_K:
        qs = blk[:, 32:96].reshape(-1, 2, 1, 32)
        high = (blk[:, None, None, 0:32] >> _HBIT) & 1                 # hmask bit 4h + s of byte l
        c = ((qs >> _SHIFT2) & 3) | (high << 2)
    elif kind in (GgmlType.Q4_K, GgmlType.Q5_K):
        five = kind is GgmlType.Q5_K
        qs = (blk[:, 48:176] if five else blk[:, 16:144]).reshape(-1, 4, 1, 32)   # element c*64 + n*32 + l
        c = (qs >> torch.tensor([0, 4], dtype=torch.int32).reshape(1, 1, 2, 1)) & 0x0F
        if five:
            c = c | (((blk[:, None, None, 16:48] >> _HBIT.reshape(1, 4, 2, 1)) & 1) << 4)
    else:  # Q6_K: element h*128 + quarter*32 + l
        ql = blk[:, 0:128].reshape(-1, 2, 2, 32)
        low = torch.stack([ql[:, :, 0] & 0x0F, ql[:, :, 1] & 0x0F, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], dim=2)
        c = low | (((blk[:, 128:192].reshape(-1, 2, 1, 32) >> _SHIFT2) & 3) << 4)
    return c.reshape(rows, -1).to(torch.int32)


_SHIFT2 = torch.tensor([0, 2, 4, 6], dtype=torch.int32).reshape(1, 1, 4, 1)
_HBIT = torch.arange(8, dtype=torch.int32).reshape(1, 2, 4, 1)


def with_codes(data: torch.Tensor, kind: GgmlType, codes: torch.Tensor) -> torch.Tensor:
    """``data`` (uint8 [R, row bytes] of ``kind``) with its codes replaced by ``codes`` [R, K]
    (integers in [cmin, cmax], else a QuantizationError); the scale bytes are kept."""
    kind = GgmlType(kind)
    blk = _blocks(data, kind).clone()
    group, zero, cmin, cmax = _LAYOUT[kind]
    n = GEOMETRY[kind][0]
    if codes.shape != (data.shape[0], data.shape[1] // GEOMETRY[kind][1] * n):
        raise QuantizationError(f"{kind.value}: codes {list(codes.shape)} do not match rows {list(data.shape)}")
    c = codes.to(torch.int32).reshape(-1, n)
    if bool((c < cmin).any()) or bool((c > cmax).any()):
        raise QuantizationError(f"{kind.value}: codes must lie in [{cmin}, {cmax}]")
    if kind is GgmlType.Q8_0:
        blk[:, 2:] = c & 0xFF
    elif kind in (GgmlType.Q4_0, GgmlType.Q5_0, GgmlType.Q4_1, GgmlType.Q5_1):
        at = 2 if kind in (GgmlType.Q4_0, GgmlType.Q5_0) else 4
        five = kind in (GgmlType.Q5_0, GgmlType.Q5_1)
        blk[:, at + (4 if five else 0):] = (c[:, :16] & 0x0F) | ((c[:, 16:] & 0x0F) << 4)
        if five:
            word = (((c >> 4) & 1).to(torch.int64) << torch.arange(32, dtype=torch.int64)).sum(dim=1)
            blk[:, at:at + 4] = torch.stack([(word >> (8 * i)) & 0xFF for i in range(4)], dim=1).to(torch.int32)
    elif kind is GgmlType.Q2_K:
        blk[:, 16:80] = ((c.reshape(-1, 2, 4, 32) & 3) << _SHIFT2).sum(dim=2).reshape(-1, 64)
    elif kind is GgmlType.Q3_K:
        c = c.reshape(-1, 2, 4, 32)
        blk[:, 32:96] = ((c & 3) << _SHIFT2).sum(dim=2).reshape(-1, 64)
        blk[:, 0:32] = (((c >> 2) & 1) << _HBIT).sum(dim=(1, 2))
    elif kind in (GgmlType.Q4_K, GgmlType.Q5_K):
        five = kind is GgmlType.Q5_K
        c = c.reshape(-1, 4, 2, 32)
        qs = ((c[:, :, 0] & 0x0F) | ((c[:, :, 1] & 0x0F) << 4)).reshape(-1, 128)
        if five:
            blk[:, 48:176] = qs
            blk[:, 16:48] = (((c >> 4) & 1) << _HBIT.reshape(1, 4, 2, 1)).sum(dim=(1, 2))
        else:
            blk[:, 16:144] = qs
    else:  # Q6_K
        c = c.reshape(-1, 2, 4, 32)
        low = c & 0x0F
        blk[:, 0:128] = torch.stack([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)],
                                    dim=2).reshape(-1, 128)
        blk[:, 128:192] = (((c >> 4) & 3) << _SHIFT2).sum(dim=2).reshape(-1, 64)
    return blk.to(torch.uint8).reshape(data.shape)
