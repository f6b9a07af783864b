"""GGML's FP4 block types: MXFP4 (encode, decode) and NVFP4 (decode).

Pure functions on tensors; bytes as GGML's ``block_mxfp4`` / ``block_nvfp4`` (``ggml-common.h``):

| type | weights | bytes | layout |
|---|---|---|---|
| MXFP4 | 32 | 17 | e (E8M0 scale), 16 bytes: element j low nibble, j + 16 high |
| NVFP4 | 64 | 36 | four UE4M3 scales (one per 16), then 8 bytes per 16: element j low nibble, j + 8 high |

A nibble is an E2M1 code (sign bit 3). GGML writes the E2M1 values doubled
(0, 1, 2, 3, 4, 6, 8, 12) and halves the scale, so the values are OCP's: MXFP4 code q in a block
of scale e is ``E2M1(q) * 2^(e - 127)``; NVFP4's is ``E2M1(q) * UE4M3(s)`` (the code 0x7F reads
as 0), with no per-tensor scale.

MXFP4 encoding is ggml's reference (``quantize_row_mxfp4_ref``), which is not OCP's
round-to-nearest-even: ``e = floor(log2f(amax)) - 2 + 127`` (log2f correctly rounded to float32; 0 for a zero block,
and for amax below 2^-125, where the reference's conversion is undefined) and each weight takes
the *first* code, in the order 0, 1, ..., 7, 8 (-0), ..., 15, of least absolute error: a tie goes
to the smaller magnitude. NVFP4 encoding is not here yet.
"""

from __future__ import annotations

import torch

from lowbit.numerics.ggml import GgmlType, bytes_in_blocks, weights_in_rows

MXFP4_BLOCK, MXFP4_BYTES = 32, 17
NVFP4_BLOCK, NVFP4_BYTES = 64, 36
#: E2M1 values of codes 0..15, doubled, as GGML's table holds them
DOUBLED_E2M1 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _half_scale(e: torch.Tensor) -> torch.Tensor:
    """E8M0 code -> 2^(e - 128) in float32 (half the block scale: the table is doubled), exact,
    subnormal results included."""
    e = e.to(torch.int64)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int64) << e, (e - 1) << 23)
    return bits.to(torch.int32).view(torch.float32)


def _values(q: torch.Tensor) -> torch.Tensor:
    return torch.tensor(DOUBLED_E2M1, dtype=torch.float32)[q.to(torch.int64)]


def encode_mxfp4(x: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """ggml's reference MXFP4 encoding of ``x`` [..., K] (K a multiple of 32) -> uint8 [..., K / 32 * 17]."""
    lead = x.shape[:-1]
    b = weights_in_rows(x, MXFP4_BLOCK, name, "MXFP4 block")
    amax = b.abs().amax(dim=1)
    # C's log2f, correctly rounded: the float64 log2 rounded to float32 (torch's float32 log2 may not be)
    log2 = torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)).double()).float()
    exp = torch.floor(log2) - 2 + 127
    e = torch.where(amax > 0, exp.clamp(0, 254), torch.zeros_like(exp)).to(torch.uint8)
    d = _half_scale(e)
    table = torch.tensor(DOUBLED_E2M1, dtype=torch.float32)
    err = (d[:, None, None] * table - b[:, :, None]).abs()
    q = err.argmin(dim=-1).to(torch.uint8)                      # the first least error
    packed = q[:, :16] | (q[:, 16:] << 4)
    return torch.cat([e[:, None], packed], dim=1).reshape(*lead, -1)


def decode_mxfp4(data: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n * 17] MXFP4 blocks -> float32 [..., n * 32], as ggml dequantizes."""
    blk = bytes_in_blocks(data, GgmlType.MXFP4)
    qs = blk[:, 1:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=1)
    return (_half_scale(blk[:, 0])[:, None] * _values(q)).reshape(*data.shape[:-1], -1)


def _ue4m3_half(s: torch.Tensor) -> torch.Tensor:
    """UE4M3 code -> half its value in float32 (exact); the code 0x7F (NaN in E4M3) reads as 0."""
    s = s.to(torch.int32)
    exp, man = (s >> 3) & 0x0F, s & 0x07
    # value = 2^(exp - 7) * (1 + man/8), or man * 2^-9 when exp is 0: as bits of a float32, halved
    normal = ((exp + 127 - 7 - 1) << 23) | (man << 20)
    sub = man.to(torch.float32) * 2.0 ** -10
    val = torch.where(exp == 0, sub, normal.view(torch.float32))
    return torch.where((s == 0) | (s == 0x7F), torch.zeros_like(val), val)


def decode_nvfp4(data: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n * 36] NVFP4 blocks -> float32 [..., n * 64], as ggml dequantizes."""
    blk = bytes_in_blocks(data, GgmlType.NVFP4)
    d = _ue4m3_half(blk[:, :4])[:, :, None]                      # [N, 4, 1]
    qs = blk[:, 4:].reshape(-1, 4, 8)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2)                   # [N, 4, 16]
    return (d * _values(q)).reshape(*data.shape[:-1], -1)
