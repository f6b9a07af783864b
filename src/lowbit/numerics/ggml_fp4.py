"""GGML's FP4 block types: MXFP4 and NVFP4, encoded as ggml's reference and decoded exactly.

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
to the smaller magnitude. NVFP4 (``quantize_row_nvfp4_ref``): per 16 weights the scale
``fp32_to_ue4m3(amax / 6)`` (ggml's conversion rounds half up, not to even) and the same code
choice against it.

These encoders are the definition; ``lowbit.kernels.ggml.encode`` runs a C implementation of them
(ggml_fp4_native.c) where the kernel setting allows, with the same bytes.
"""

from __future__ import annotations

import torch

from lowbit.numerics.ggml import GEOMETRY, GgmlType, bytes_in_blocks, weights_in_rows

MXFP4_BLOCK, MXFP4_BYTES = GEOMETRY[GgmlType.MXFP4]
NVFP4_BLOCK, NVFP4_BYTES = GEOMETRY[GgmlType.NVFP4]
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


#: groups compared against the 16 table values at once (memory: CHUNK * group * 16 floats)
CHUNK = 1 << 15


def _nearest_codes(b: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """uint8 codes [G, n] of groups ``b`` [G, n] under halved scales ``d`` [G]: each weight's first
    code of least ``|d * DOUBLED_E2M1[c] - x|``, in chunks of ``CHUNK`` groups (the comparison
    is 16 times the input: a 262k-token embedding at once would need tens of GB)."""
    table = torch.tensor(DOUBLED_E2M1, dtype=torch.float32)
    q = torch.empty(b.shape, dtype=torch.uint8)
    for s in range(0, b.shape[0], CHUNK):
        err = (d[s:s + CHUNK, None, None] * table - b[s:s + CHUNK, :, None]).abs()
        q[s:s + CHUNK] = err.argmin(dim=-1).to(torch.uint8)     # the first least error
    return q


def encode_mxfp4(x: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """ggml's reference MXFP4 encoding of ``x`` [..., K] (K a multiple of 32) -> uint8 [..., K / 32 * 17]."""
    lead = x.shape[:-1]
    b = weights_in_rows(x, MXFP4_BLOCK, name, "MXFP4 block")
    amax = b.abs().amax(dim=1)
    # C's log2f, correctly rounded: the float64 log2 rounded to float32 (torch's float32 log2 may not be)
    log2 = torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)).double()).float()
    exp = torch.floor(log2) - 2 + 127
    e = torch.where(amax > 0, exp.clamp(0, 254), torch.zeros_like(exp)).to(torch.uint8)
    q = _nearest_codes(b, _half_scale(e))
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


def fp32_to_ue4m3(x: torch.Tensor) -> torch.Tensor:
    """ggml's float32 -> UE4M3 code (``ggml_fp32_to_ue4m3``), not RNE: x <= 0 (or NaN) -> 0, x
    capped at 448; normal codes round half up on the fourth mantissa bit (0x7E at the top);
    subnormal ones are trunc(x * 512 + 0.5), 0 below 1, at most 7."""
    x = torch.where(x > 0, x, torch.zeros_like(x)).clamp(max=448.0).to(torch.float32)
    bits = x.view(torch.int32).to(torch.int64)
    exp = ((bits >> 23) & 0xFF) - 127 + 7
    man = ((bits >> 20) & 0x7) + ((bits >> 19) & 1)
    carry = man > 7
    exp = torch.where(carry, exp + 1, exp)
    man = torch.where(carry, torch.zeros_like(man), man)
    normal = torch.where(exp >= 15, torch.full_like(exp, 0x7E), (exp << 3) | man)
    sub = torch.trunc(x * 512.0 + 0.5).to(torch.int64).clamp(max=7)
    sub = torch.where(sub < 1, torch.zeros_like(sub), sub)
    base_exp = ((bits >> 23) & 0xFF) - 127 + 7
    code = torch.where(base_exp <= 0, sub, normal)
    return torch.where(x > 0, code, torch.zeros_like(code)).to(torch.uint8)


def encode_nvfp4(x: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """ggml's reference NVFP4 encoding (``quantize_row_nvfp4_ref``) of ``x`` [..., K] (K a multiple
    of 64) -> uint8 [..., K / 64 * 36]: per 16 weights the UE4M3 scale ``fp32_to_ue4m3(amax / 6)``
    and each weight's first code of least error against it (as MXFP4's)."""
    lead = x.shape[:-1]
    b = weights_in_rows(x, NVFP4_BLOCK, name, "NVFP4 block").reshape(-1, 16)   # [N * 4, 16]
    ue = fp32_to_ue4m3(b.abs().amax(dim=1) / 6.0)
    q = _nearest_codes(b, _ue4m3_half(ue))
    packed = (q[:, :8] | (q[:, 8:] << 4)).reshape(-1, 32)
    return torch.cat([ue.reshape(-1, 4), packed], dim=1).reshape(*lead, -1)


def decode_nvfp4(data: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n * 36] NVFP4 blocks -> float32 [..., n * 64], as ggml dequantizes."""
    blk = bytes_in_blocks(data, GgmlType.NVFP4)
    d = _ue4m3_half(blk[:, :4])[:, :, None]                      # [N, 4, 1]
    qs = blk[:, 4:].reshape(-1, 4, 8)
    q = torch.cat([qs & 0x0F, qs >> 4], dim=2)                   # [N, 4, 16]
    return (d * _values(q)).reshape(*data.shape[:-1], -1)


#: group of weights per stored scale
FP4_GROUP = {GgmlType.MXFP4: MXFP4_BLOCK, GgmlType.NVFP4: 16}


def fp4_scales(data: torch.Tensor, kind: GgmlType) -> torch.Tensor:
    """The halved scales (float32 [R, K / group], ``FP4_GROUP``) of encoded rows ``data`` uint8 [R,
    row bytes]: weight k of row r is ``scale[r, k // group] * DOUBLED_E2M1[code]``."""
    kind = GgmlType(kind)
    blk = bytes_in_blocks(data, kind)
    d = _half_scale(blk[:, 0]) if kind is GgmlType.MXFP4 else _ue4m3_half(blk[:, :4])
    return d.reshape(data.shape[0], -1)


def fp4_codes(data: torch.Tensor, kind: GgmlType) -> torch.Tensor:
    """The codes (int64 [R, K], 0..15) of encoded rows ``data`` uint8 [R, row bytes] of MXFP4 / NVFP4."""
    kind = GgmlType(kind)
    blk = bytes_in_blocks(data, kind)
    if kind is GgmlType.MXFP4:
        qs = blk[:, 1:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=1)
    else:
        qs = blk[:, 4:].reshape(-1, 4, 8)
        q = torch.cat([qs & 0x0F, qs >> 4], dim=2)
    return q.reshape(data.shape[0], -1).to(torch.int64)


def with_fp4_codes(data: torch.Tensor, kind: GgmlType, codes: torch.Tensor) -> torch.Tensor:
    """``data`` (uint8 [R, row bytes] of MXFP4 / NVFP4) with its codes replaced by ``codes`` [R, K]
    (0..15, else ValueError); the scale bytes are kept."""
    kind = GgmlType(kind)
    n, nb = GEOMETRY[kind]
    if codes.shape != (data.shape[0], data.shape[1] // nb * n):
        raise ValueError(f"{kind.value}: codes {list(codes.shape)} do not match rows {list(data.shape)}")
    if bool((codes < 0).any()) or bool((codes > 15).any()):
        raise ValueError(f"{kind.value}: codes must lie in [0, 15]")
    blk = bytes_in_blocks(data, kind).clone()
    c = codes.to(torch.uint8).reshape(-1, n)
    if kind is GgmlType.MXFP4:
        blk[:, 1:] = c[:, :16] | (c[:, 16:] << 4)
    else:
        c = c.reshape(-1, 4, 16)
        blk[:, 4:] = (c[:, :, :8] | (c[:, :, 8:] << 4)).reshape(-1, 32)
    return blk.reshape(data.shape)
