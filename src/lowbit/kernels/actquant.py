"""Triton kernels for activation quantization, bit-exact with lowbit.quant.quantize.

- ``quantize_blocks``: microscaled formats (NVFP4 with its global scale, NVFP4-E5M3, MXFP4,
  MXFP8): element codes, block scales (values and codes) and/or the QDQ values, one program
  per BLOCK_N blocks of BS consecutive elements along the last dimension.
- ``quantize_rows``: per-token (dynamic) or per-tensor (static) INT8 / FP8 E4M3 codes and
  scales, one program per row.

The float32 order of operations is the one fixed in lowbit.quant.qdq; every rounding is
done on integer bits (lowbit.kernels.ieee_bits), divisions with tl.math.div_rn.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.errors import QuantizationError
from lowbit.kernels.ieee_bits import (bits_f32, decode_mag, encode_mag, f32_bits, floor_log2, ldexp_exact,
                                 round_half_even_int, store_f32_as)
from lowbit.kernels.formats import f32_bits as host_bits, minifloat_params
from lowbit.kernels.support import supports_block_spec, supports_row_spec
from lowbit.numerics import FormatName, get_format
from lowbit.schemes import Granularity, QuantSpec

SCALE_UE = 0         # block scale rounded to UE4M3/UE5M3, no global scale (NVFP4-E5M3)
SCALE_UE_GLOBAL = 1  # block scale rounded to UE4M3 after multiplying by the global scale (NVFP4)
SCALE_E8M0 = 2       # power-of-two block scale (OCP MX)


@triton.jit
def _block_quant_kernel(
    x_ptr, codes_ptr, scale_ptr, scode_ptr, qdq_ptr, gs_ptr, flag_ptr, n_blocks,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, SCALE_KIND: tl.constexpr,
    WRITE_CODES: tl.constexpr, WRITE_QDQ: tl.constexpr, OUT_BF16: tl.constexpr, CHECK: tl.constexpr,
    E_MAN: tl.constexpr, E_BIAS: tl.constexpr, E_EMIN: tl.constexpr, E_MAXCODE: tl.constexpr,
    E_MAXBITS: tl.constexpr, E_SIGN: tl.constexpr, E_MAXF: tl.constexpr, E_EMAX: tl.constexpr,
    S_MAN: tl.constexpr, S_BIAS: tl.constexpr, S_EMIN: tl.constexpr, S_MAXCODE: tl.constexpr,
    S_MAXBITS: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BS)
    rmask = rows < n_blocks
    offs = rows[:, None] * BS + cols[None, :]
    mask = rmask[:, None]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    xb = f32_bits(x)
    neg = xb < 0  # the sign bit, -0.0 included
    ab = xb & 0x7FFFFFFF
    a = bits_f32(ab)
    if CHECK:
        nbad = tl.sum(tl.sum(((ab >= 0x7F800000) & mask).to(tl.int32), axis=1), axis=0)
        tl.atomic_max(flag_ptr, nbad)
    amax_bits = tl.max(ab, axis=1)  # integer max: exact, subnormals included
    amax = bits_f32(amax_bits)

    if SCALE_KIND == 2:
        # s = 2^clamp(floor(log2 amax) - emax_elem, -127, 127); 2^-127 for an all-zero block
        e = tl.where(amax_bits > 0, floor_log2(amax) - E_EMAX, -127)
        e = tl.minimum(tl.maximum(e, -127), 127)
        scode = e + 127
        sbits = tl.where(e >= -126, scode << 23, 0x00400000)
        mag = ldexp_exact(a, -e[:, None])  # |x| / s, exact
        ecode = encode_mag(mag, E_MAN, E_BIAS, E_EMIN, E_MAXCODE, E_MAXBITS)
        code = ecode | (neg.to(tl.int32) << E_SIGN)
    else:
        raw = tl.math.div_rn(amax, tl.full(amax.shape, E_MAXF, tl.float32))
        if SCALE_KIND == 1:
            g = tl.load(gs_ptr)
            raw = raw * g
        scode = encode_mag(raw, S_MAN, S_BIAS, S_EMIN, S_MAXCODE, S_MAXBITS)
        s = decode_mag(scode, S_MAN, S_BIAS, S_EMIN)
        sbits = f32_bits(s)
        if SCALE_KIND == 1:
            eff = tl.math.div_rn(s, tl.broadcast_to(g, s.shape))
        else:
            eff = s
        nonzero = f32_bits(eff) > 0
        eff_safe = tl.where(nonzero, eff, 1.0)
        q = tl.math.div_rn(a, tl.broadcast_to(eff_safe[:, None], a.shape))
        ecode = encode_mag(q, E_MAN, E_BIAS, E_EMIN, E_MAXCODE, E_MAXBITS)
        code = ecode | (neg.to(tl.int32) << E_SIGN)
        code = tl.where(nonzero[:, None], code, 0)
        ecode = tl.where(nonzero[:, None], ecode, 0)

    if WRITE_CODES:
        tl.store(codes_ptr + offs, code.to(tl.uint8), mask=mask)
        tl.store(scale_ptr + rows, bits_f32(sbits), mask=rmask)
        tl.store(scode_ptr + rows, scode.to(tl.uint8), mask=rmask)
    if WRITE_QDQ:
        val = decode_mag(ecode, E_MAN, E_BIAS, E_EMIN)
        if SCALE_KIND == 2:
            val = ldexp_exact(val, tl.broadcast_to(e[:, None], ecode.shape))
        else:
            val = val * eff[:, None]
        vb = f32_bits(val) | (neg.to(tl.int32) << 31)
        if SCALE_KIND != 2:
            vb = tl.where(nonzero[:, None], vb, 0)  # zero scale: zero codes, +0.0 values
        store_f32_as(qdq_ptr + offs, vb, mask, OUT_BF16)


def _block_kind(spec: QuantSpec) -> int:
    if spec.scale_format is FormatName.E8M0:
        return SCALE_E8M0
    if spec.scale_format in (FormatName.UE4M3, FormatName.UE5M3):
        return SCALE_UE_GLOBAL if spec.global_scale else SCALE_UE
    raise QuantizationError(f"no block-quantization kernel for {spec.describe()}")


LAUNCH_OPTIONS = {"enable_fp_fusion": False}  # no FMA contraction (the kernels have no a*b+c anyway)


def block_quant_constexprs(spec: QuantSpec, *, codes: bool = True, qdq_dtype: torch.dtype | None = None,
                           block_n: int = 128, check: bool = True) -> dict:
    """The constexpr arguments of _block_quant_kernel for ``spec``."""
    kind = _block_kind(spec)
    e = minifloat_params(spec.format)
    s = e if kind == SCALE_E8M0 else minifloat_params(spec.scale_format)
    return dict(
        BS=spec.group_size, BLOCK_N=block_n, SCALE_KIND=kind, WRITE_CODES=codes, WRITE_QDQ=qdq_dtype is not None,
        OUT_BF16=qdq_dtype == torch.bfloat16, CHECK=check,
        E_MAN=e.man, E_BIAS=e.bias, E_EMIN=e.emin, E_MAXCODE=e.maxcode, E_MAXBITS=e.maxbits,
        E_SIGN=e.sign_shift, E_MAXF=e.max_finite, E_EMAX=e.emax_floor,
        S_MAN=s.man, S_BIAS=s.bias, S_EMIN=s.emin, S_MAXCODE=s.maxcode, S_MAXBITS=s.maxbits,
    )


def quantize_blocks(x: torch.Tensor, spec: QuantSpec, global_scale: torch.Tensor | None = None, *,
                    codes: bool = True, qdq_dtype: torch.dtype | None = None, check_finite: bool = True,
                    name: str = "input", block_n: int = 128):
    """Quantize ``x`` [..., K] under a microscaled ``spec`` (dynamic block scales).

    Returns a dict with, as asked: ``codes`` (uint8, x's shape), ``scale`` (float32 block
    scale values [..., K/BS], as QuantizedTensor.scale), ``scale_codes`` (uint8), ``qdq``
    (the dequantized values in ``qdq_dtype``, equal to lowbit.quant.fake_quantize cast to it).
    NaN/Inf in ``x`` raise QuantizationError when ``check_finite`` (one device sync).
    """
    if not supports_block_spec(spec):
        raise QuantizationError(f"tensor {name!r}: no block-quantization kernel for {spec.describe()}")
    bs = spec.group_size
    K = x.shape[-1]
    if K % bs:
        raise QuantizationError(f"tensor {name!r} with shape {tuple(x.shape)}: last dimension {K} is not a "
                                f"multiple of the block size {bs} required by {spec.describe()}")
    if _block_kind(spec) == SCALE_UE_GLOBAL:
        if global_scale is None:
            raise QuantizationError(f"tensor {name!r}: {spec.describe()} needs a global scale")
        gs = global_scale.to(device=x.device, dtype=torch.float32).reshape(1).contiguous()
    else:
        gs = None
    xc = x.contiguous()
    nb = xc.numel() // bs
    dev = x.device
    # outputs not asked for are never touched by the kernel: x stands in for their pointers
    out_codes = torch.empty(x.shape, dtype=torch.uint8, device=dev) if codes else xc
    scale = torch.empty(*x.shape[:-1], K // bs, dtype=torch.float32, device=dev) if codes else xc
    scodes = torch.empty(scale.shape, dtype=torch.uint8, device=dev) if codes else xc
    if qdq_dtype not in (None, torch.float32, torch.bfloat16):
        raise QuantizationError(f"tensor {name!r}: QDQ output dtype must be float32 or bfloat16, not {qdq_dtype}")
    qdq = torch.empty(x.shape, dtype=qdq_dtype, device=dev) if qdq_dtype is not None else xc
    qdq_arg = qdq.view(torch.int16) if qdq_dtype == torch.bfloat16 else qdq
    flag = torch.zeros(1, dtype=torch.int32, device=dev) if check_finite else xc
    if nb:
        grid = (triton.cdiv(nb, block_n),)
        _block_quant_kernel[grid](xc, out_codes, scale, scodes, qdq_arg, xc if gs is None else gs, flag, nb,
                                  **block_quant_constexprs(spec, codes=codes, qdq_dtype=qdq_dtype, block_n=block_n,
                                                           check=check_finite),
                                  **LAUNCH_OPTIONS)
    if check_finite and int(flag.item()):
        raise QuantizationError(f"tensor {name!r} (shape {tuple(x.shape)}) has {int(flag.item())}+ NaN/Inf values")
    out = {}
    if codes:
        out.update(codes=out_codes, scale=scale, scale_codes=scodes)
    if qdq_dtype is not None:
        out["qdq"] = qdq
    return out


@triton.jit
def _row_quant_kernel(
    x_ptr, codes_ptr, scale_ptr, static_ptr, flag_ptr, M, K,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DYNAMIC: tl.constexpr, IS_INT: tl.constexpr, CHECK: tl.constexpr,
    ELEM_MAXF: tl.constexpr, INT_LIMIT_BITS: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr,
    E_MAN: tl.constexpr, E_BIAS: tl.constexpr, E_EMIN: tl.constexpr, E_MAXCODE: tl.constexpr,
    E_MAXBITS: tl.constexpr, E_SIGN: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    cols = tl.arange(0, BLOCK_K)
    base = x_ptr + rows[:, None] * K
    if DYNAMIC:
        amax_bits = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            m = rmask[:, None] & ((k0 + cols) < K)[None, :]
            xb = f32_bits(tl.load(base + (k0 + cols)[None, :], mask=m, other=0.0).to(tl.float32)) & 0x7FFFFFFF
            amax_bits = tl.maximum(amax_bits, xb)
        amax = bits_f32(tl.max(amax_bits, axis=1))  # integer max: exact
        scale = tl.math.div_rn(amax, tl.full(amax.shape, ELEM_MAXF, tl.float32))
        tl.store(scale_ptr + rows, scale, mask=rmask)
    else:
        scale = tl.broadcast_to(tl.load(static_ptr), [BLOCK_M])
    nonzero = f32_bits(scale) > 0
    safe = tl.where(nonzero, scale, 1.0)
    nbad = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        m = rmask[:, None] & ((k0 + cols) < K)[None, :]
        xb = f32_bits(tl.load(base + (k0 + cols)[None, :], mask=m, other=0.0).to(tl.float32))
        neg = xb < 0
        ab = xb & 0x7FFFFFFF
        nbad += ((ab >= 0x7F800000) & m).to(tl.int32)
        q = tl.math.div_rn(bits_f32(ab), tl.broadcast_to(safe[:, None], ab.shape))
        if IS_INT:
            n = round_half_even_int(q, INT_LIMIT_BITS)
            v = tl.where(neg, -n, n)
            v = tl.minimum(tl.maximum(v, QMIN), QMAX)
            code = v & 0xFF
        else:
            code = encode_mag(q, E_MAN, E_BIAS, E_EMIN, E_MAXCODE, E_MAXBITS) | (neg.to(tl.int32) << E_SIGN)
        code = tl.where(nonzero[:, None], code, 0)
        tl.store(codes_ptr + rows[:, None] * K + (k0 + cols)[None, :], code.to(tl.uint8), mask=m)
    if CHECK:
        tl.atomic_max(flag_ptr, tl.sum(tl.sum(nbad, axis=1), axis=0))


def row_quant_constexprs(spec: QuantSpec, block_m: int = 2, block_k: int = 2048, check: bool = True) -> dict:
    """The constexpr arguments of _row_quant_kernel for ``spec``."""
    e = minifloat_params(FormatName.E4M3)
    return dict(
        BLOCK_M=block_m, BLOCK_K=block_k, CHECK=check, DYNAMIC=spec.granularity is Granularity.TOKEN, IS_INT=spec.format is FormatName.INT8,
        ELEM_MAXF=float(get_format(spec.format).max_finite), INT_LIMIT_BITS=host_bits(256.0), QMIN=-128, QMAX=127,
        E_MAN=e.man, E_BIAS=e.bias, E_EMIN=e.emin, E_MAXCODE=e.maxcode, E_MAXBITS=e.maxbits, E_SIGN=e.sign_shift,
    )


def quantize_rows(x: torch.Tensor, spec: QuantSpec, scale: torch.Tensor | None = None, *,
                  check_finite: bool = True, name: str = "input", block_m: int = 2, block_k: int = 2048):
    """INT8 / FP8-E4M3 codes of ``x`` [..., K]: per token (dynamic, scales computed here) or per
    tensor (static ``scale``). Returns (codes uint8 x.shape, scale float32: [..., 1] or [1])."""
    if not supports_row_spec(spec):
        raise QuantizationError(f"tensor {name!r}: no row-quantization kernel for {spec.describe()}")
    dynamic = spec.granularity is Granularity.TOKEN
    if not dynamic and scale is None:
        raise QuantizationError(f"tensor {name!r}: {spec.describe()} needs its static scale")
    xc = x.contiguous()
    K = x.shape[-1]
    rows = xc.numel() // max(K, 1)
    dev = x.device
    codes = torch.empty(x.shape, dtype=torch.uint8, device=dev)
    if dynamic:
        out_scale = torch.empty(*x.shape[:-1], 1, dtype=torch.float32, device=dev)
        static = out_scale
    else:
        static = scale.to(device=dev, dtype=torch.float32).reshape(1).contiguous()
        out_scale = static
    flag = torch.zeros(1, dtype=torch.int32, device=dev) if check_finite else codes
    if rows and K:
        bk = min(block_k, triton.next_power_of_2(K))
        _row_quant_kernel[(triton.cdiv(rows, block_m),)](xc, codes, out_scale, static, flag, rows, K,
                                                         **row_quant_constexprs(spec, block_m, bk, check_finite),
                                                         **LAUNCH_OPTIONS)
    if check_finite and int(flag.item()):
        raise QuantizationError(f"tensor {name!r} (shape {tuple(x.shape)}) has NaN/Inf values")
    return codes, out_scale
