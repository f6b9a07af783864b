"""Triton kernels for weight dequantization from the packed layouts, bit-exact with
lowbit.quant.dequantize (then cast to the output dtype).

- ``dequantize_microscaled``: E2M1 codes nibble-packed (element 2i in the low nibble) or E4M3
  codes one per byte, with block scales as uint8 codes of UE4M3 / UE5M3 / E8M0 and, for NVFP4,
  the float32 global scale (the divisor).
- ``dequantize_int``: INT8 codes (one per byte) or INT4 values packed eight to an int32 word
  (lowbit.quant.pack_int32 layout), float32 scales per channel or per group (a ragged last
  group included), optional int8 zero points.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.errors import QuantizationError
from lowbit.kernels.ieee_bits import decode_mag, f32_bits, ldexp_exact, store_f32_as
from lowbit.kernels.formats import minifloat_params
from lowbit.kernels.support import supports_int_weight, supports_microscaled_weight
from lowbit.numerics import FormatName
from lowbit.kernels.bitpack import pack_int32, pack_nibbles
from lowbit.schemes import Granularity, QuantSpec

SCALE_UE = 0
SCALE_UE_GLOBAL = 1
SCALE_E8M0 = 2


@triton.jit
def _mx_dequant_kernel(
    w_ptr, scode_ptr, gs_ptr, out_ptr, n_blocks,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, PACKED: tl.constexpr, SCALE_KIND: tl.constexpr, OUT_BF16: tl.constexpr,
    E_MAN: tl.constexpr, E_BIAS: tl.constexpr, E_EMIN: tl.constexpr, E_SIGN: tl.constexpr,
    S_MAN: tl.constexpr, S_BIAS: tl.constexpr, S_EMIN: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BS)
    rmask = rows < n_blocks
    mask = rmask[:, None]
    if PACKED:
        byte = tl.load(w_ptr + rows[:, None] * (BS // 2) + (cols // 2)[None, :], mask=mask, other=0).to(tl.int32)
        code = (byte >> ((cols & 1) * 4)[None, :]) & 0xF
    else:
        code = tl.load(w_ptr + rows[:, None] * BS + cols[None, :], mask=mask, other=0).to(tl.int32)
    neg = (code >> E_SIGN) & 1
    mag = code & ((1 << E_SIGN) - 1)
    val = decode_mag(mag, E_MAN, E_BIAS, E_EMIN)
    sc = tl.load(scode_ptr + rows, mask=rmask, other=0).to(tl.int32)
    if SCALE_KIND == 2:
        val = ldexp_exact(val, tl.broadcast_to((sc - 127)[:, None], code.shape))
    else:
        s = decode_mag(sc, S_MAN, S_BIAS, S_EMIN)
        if SCALE_KIND == 1:
            g = tl.load(gs_ptr)
            eff = tl.math.div_rn(s, tl.broadcast_to(g, s.shape))
        else:
            eff = s
        val = val * eff[:, None]
    vb = f32_bits(val) | (neg << 31)
    store_f32_as(out_ptr + rows[:, None] * BS + cols[None, :], vb, mask, OUT_BF16)


def _out_arg(out: torch.Tensor) -> torch.Tensor:
    """The kernel's view of an output: float32 as is, bfloat16 as int16 bits."""
    if out.dtype == torch.bfloat16:
        return out.view(torch.int16)
    if out.dtype != torch.float32:
        raise QuantizationError(f"dequantization output dtype must be float32 or bfloat16, not {out.dtype}")
    return out


def _kind(spec: QuantSpec) -> int:
    if spec.scale_format is FormatName.E8M0:
        return SCALE_E8M0
    return SCALE_UE_GLOBAL if spec.global_scale else SCALE_UE


def pack_microscaled(codes: torch.Tensor, scale: torch.Tensor, spec: QuantSpec, name: str = "weight"):
    """(element bytes, scale codes): nibble-packed E2M1 or one-byte E4M3, and uint8 block-scale
    codes, from a QuantizedTensor's unpacked codes and scale values (the on-disk layout)."""
    from lowbit.numerics import get_format

    data = pack_nibbles(codes, name) if spec.format is FormatName.E2M1 else codes.contiguous()
    return data, get_format(spec.scale_format).encode(scale).contiguous()


LAUNCH_OPTIONS = {"enable_fp_fusion": False}


def mx_dequant_constexprs(spec: QuantSpec, dtype: torch.dtype = torch.bfloat16, block_n: int = 128) -> dict:
    kind = _kind(spec)
    e = minifloat_params(spec.format)
    s = e if kind == SCALE_E8M0 else minifloat_params(spec.scale_format)
    return dict(BS=spec.group_size, BLOCK_N=block_n, PACKED=spec.format is FormatName.E2M1, SCALE_KIND=kind,
                OUT_BF16=dtype == torch.bfloat16, E_MAN=e.man, E_BIAS=e.bias, E_EMIN=e.emin, E_SIGN=e.sign_shift,
                S_MAN=s.man, S_BIAS=s.bias, S_EMIN=s.emin)


def int_dequant_constexprs(spec: QuantSpec, dtype: torch.dtype = torch.bfloat16, has_zp: bool = False,
                           block_r: int = 4, block_c: int = 1024) -> dict:
    return dict(BITS=spec.bits, HAS_ZP=has_zp, BLOCK_R=block_r, BLOCK_C=block_c, OUT_BF16=dtype == torch.bfloat16)


def dequantize_microscaled(data: torch.Tensor, scale_codes: torch.Tensor, spec: QuantSpec,
                           global_scale: torch.Tensor | None = None, *, out_features: int, in_features: int,
                           dtype: torch.dtype = torch.bfloat16, block_n: int = 128) -> torch.Tensor:
    """Dequantize a packed microscaled weight [out, in] to ``dtype``."""
    if not supports_microscaled_weight(spec):
        raise QuantizationError(f"no dequantization kernel for {spec.describe()}")
    bs = spec.group_size
    if _kind(spec) == SCALE_UE_GLOBAL:
        if global_scale is None:
            raise QuantizationError(f"{spec.describe()} needs its global scale")
        gs = global_scale.to(device=data.device, dtype=torch.float32).reshape(1).contiguous()
    else:
        gs = scale_codes  # never read: a stand-in pointer
    out = torch.empty(out_features, in_features, dtype=dtype, device=data.device)
    nb = out.numel() // bs
    if nb:
        _mx_dequant_kernel[(triton.cdiv(nb, block_n),)](data, scale_codes, gs, _out_arg(out), nb,
                                                        **mx_dequant_constexprs(spec, dtype, block_n), **LAUNCH_OPTIONS)
    return out


@triton.jit
def _int_dequant_kernel(
    w_ptr, scale_ptr, zp_ptr, out_ptr, N, K, n_groups, group_size, words_per_row,
    BITS: tl.constexpr, HAS_ZP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    pr = tl.program_id(0)
    pc = tl.program_id(1)
    rows = (pr * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = pc * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    if BITS == 8:
        c = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0).to(tl.int32)
        v = tl.where(c >= 128, c - 256, c)
    else:
        PER: tl.constexpr = 32 // BITS
        word = tl.load(w_ptr + rows[:, None] * words_per_row + (cols // PER)[None, :], mask=mask, other=0)
        u = (word >> ((cols % PER) * BITS)[None, :]) & ((1 << BITS) - 1)
        v = u - (1 << (BITS - 1))
    g = cols // group_size
    sidx = rows[:, None] * n_groups + g[None, :]
    scale = tl.load(scale_ptr + sidx, mask=mask, other=0.0)
    vf = v.to(tl.float32)
    if HAS_ZP:
        zp = tl.load(zp_ptr + sidx, mask=mask, other=0).to(tl.float32)
        vf = vf - zp
    store_f32_as(out_ptr + rows[:, None] * K + cols[None, :], f32_bits(vf * scale), mask, OUT_BF16)


def pack_int(codes: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The packed layout of INT weight codes: int8 bytes (INT8) or int32 words (INT4)."""
    from lowbit.numerics import get_format

    if spec.format is FormatName.INT8:
        return codes.contiguous()
    return pack_int32(get_format(spec.format).codes_to_int(codes), spec.bits)


def dequantize_int(data: torch.Tensor, scale: torch.Tensor, spec: QuantSpec, zero_point: torch.Tensor | None = None,
                   *, out_features: int, in_features: int, dtype: torch.dtype = torch.bfloat16,
                   block_r: int = 4, block_c: int = 1024) -> torch.Tensor:
    """Dequantize an INT8 (uint8 codes) or INT4 (int32 words) weight [out, in] to ``dtype``."""
    if not supports_int_weight(spec):
        raise QuantizationError(f"no dequantization kernel for {spec.describe()}")
    N, K = out_features, in_features
    if spec.granularity is Granularity.GROUP:
        gsz = spec.group_size
        n_groups = -(-K // gsz)
    else:
        gsz, n_groups = K, 1
    sc = scale.to(torch.float32)
    if spec.granularity is Granularity.TENSOR:
        sc = sc.reshape(1, 1).expand(N, 1)
    sc = sc.reshape(N, n_groups).contiguous()
    zp = zero_point.reshape(N, n_groups).contiguous() if zero_point is not None else sc
    out = torch.empty(N, K, dtype=dtype, device=data.device)
    wpr = data.shape[-1] if spec.bits != 8 else K
    if N and K:
        grid = (triton.cdiv(N, block_r), triton.cdiv(K, block_c))
        _int_dequant_kernel[grid](data, sc, zp, _out_arg(out), N, K, n_groups, gsz, wpr,
                                  **int_dequant_constexprs(spec, dtype, zero_point is not None, block_r, block_c),
                                  **LAUNCH_OPTIONS)
    return out
