"""Fused Triton matmul with microscaled weights: y = x @ dequant(W)^T, W read packed.

For small batches (decode, M up to a few dozen rows) a linear layer is bound by reading the
weight: reading nibble-packed E2M1 codes and one-byte block-scale codes (0.56 byte per
weight) instead of a dequantized bf16 copy (2 bytes, plus writing it first) is the gain. The
weight tile is decoded in registers with lowbit.kernels.ieee_bits (exact), multiplied as bfloat16
(every E2M1 x UE4M3/UE5M3 and E2M1/E4M3 x 2^e product is exact in bfloat16) with float32
accumulation; NVFP4's global scale is applied to the accumulator (one IEEE division per output).
The result equals the reference within float32 accumulation-order rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lowbit.errors import QuantizationError
from lowbit.kernels.ieee_bits import decode_mag, ldexp_exact
from lowbit.kernels.dequant import LAUNCH_OPTIONS, SCALE_E8M0, SCALE_UE_GLOBAL, _kind
from lowbit.kernels.formats import minifloat_params
from lowbit.kernels.support import supports_microscaled_weight
from lowbit.numerics import FormatName
from lowbit.schemes import QuantSpec


@triton.jit
def _mx_matmul_kernel(
    x_ptr, w_ptr, scode_ptr, gs_ptr, bias_ptr, y_ptr, M, N, K,
    BS: tl.constexpr, PACKED: tl.constexpr, SCALE_KIND: tl.constexpr, HAS_BIAS: tl.constexpr,
    E_MAN: tl.constexpr, E_BIAS: tl.constexpr, E_EMIN: tl.constexpr, E_SIGN: tl.constexpr,
    S_MAN: tl.constexpr, S_BIAS: tl.constexpr, S_EMIN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_BF16: tl.constexpr,
):
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pn * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    mmask = rm < M
    nmask = rn < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K is a multiple of BLOCK_K (checked by the wrapper)
        ks = k0 + rk
        xt = tl.load(x_ptr + rm[:, None].to(tl.int64) * K + ks[None, :], mask=mmask[:, None], other=0.0)
        if PACKED:
            byte = tl.load(w_ptr + rn[:, None] * (K // 2) + (ks // 2)[None, :], mask=nmask[:, None], other=0)
            code = (byte.to(tl.int32) >> ((ks & 1) * 4)[None, :]) & 0xF
        else:
            code = tl.load(w_ptr + rn[:, None] * K + ks[None, :], mask=nmask[:, None], other=0).to(tl.int32)
        sc = tl.load(scode_ptr + rn[:, None] * (K // BS) + (ks // BS)[None, :], mask=nmask[:, None],
                     other=0).to(tl.int32)
        val = decode_mag(code & ((1 << E_SIGN) - 1), E_MAN, E_BIAS, E_EMIN)
        if SCALE_KIND == 2:
            val = ldexp_exact(val, sc - 127)
        else:
            val = val * decode_mag(sc, S_MAN, S_BIAS, S_EMIN)  # exact: <= 7 significant bits
        w = tl.where(((code >> E_SIGN) & 1) == 1, -val, val)
        if DOT_BF16:  # the GPU: bf16 tensor cores, products exact
            acc += tl.dot(xt.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
        else:  # Triton's CPU interpreter (its bf16 dot is broken): the same products in float32
            acc += tl.dot(xt.to(tl.float32), tl.trans(w), input_precision="ieee")
    if SCALE_KIND == 1:
        acc = tl.math.div_rn(acc, tl.broadcast_to(tl.load(gs_ptr), acc.shape))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc, mask=mmask[:, None] & nmask[None, :])


def mx_matmul_constexprs(spec: QuantSpec, has_bias: bool, block_m: int, block_n: int, block_k: int,
                         dot_bf16: bool = True) -> dict:
    kind = _kind(spec)
    e = minifloat_params(spec.format)
    s = e if kind == SCALE_E8M0 else minifloat_params(spec.scale_format)
    return dict(BS=spec.group_size, PACKED=spec.format is FormatName.E2M1, SCALE_KIND=kind, HAS_BIAS=has_bias,
                E_MAN=e.man, E_BIAS=e.bias, E_EMIN=e.emin, E_SIGN=e.sign_shift, S_MAN=s.man, S_BIAS=s.bias,
                S_EMIN=s.emin, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_BF16=dot_bf16)


@dataclass(frozen=True)
class MatmulTiles:
    """The tile of output rows (m), output columns (n) and reduction (k) one program computes;
    k falls back to the block size when it does not divide K."""

    m: int = 16
    n: int = 128
    k: int = 128


def mx_matmul(x: torch.Tensor, data: torch.Tensor, scale_codes: torch.Tensor, spec: QuantSpec,
              global_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None, *,
              out_features: int, tiles: MatmulTiles = MatmulTiles(),
              out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W^T + bias, W the packed microscaled weight [N, K] (as
    lowbit.kernels.dequant.pack_microscaled makes it). x is used as bfloat16."""
    block_m, block_n, block_k = tiles.m, tiles.n, tiles.k
    if not supports_microscaled_weight(spec):
        raise QuantizationError(f"no fused matmul for {spec.describe()}")
    K = x.shape[-1]
    N = out_features
    bk = block_k if K % block_k == 0 and block_k % spec.group_size == 0 else spec.group_size
    if K % bk:
        raise QuantizationError(f"fused matmul: K={K} is not a multiple of the block size {bk}")
    x2 = x.reshape(-1, K).to(torch.bfloat16).contiguous()
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=torch.float32, device=x.device)
    if _kind(spec) == SCALE_UE_GLOBAL:
        if global_scale is None:
            raise QuantizationError(f"{spec.describe()} needs its global scale")
        gs = global_scale.to(device=x.device, dtype=torch.float32).reshape(1).contiguous()
    else:
        gs = x2  # never read: a stand-in pointer
    b = bias.to(torch.float32).contiguous() if bias is not None else gs
    if M and N:
        grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
        _mx_matmul_kernel[grid](x2, data, scale_codes, gs, b, y, M, N, K,
                                **mx_matmul_constexprs(spec, bias is not None, block_m, block_n, bk, x.is_cuda),
                                **LAUNCH_OPTIONS)
    return y.reshape(*x.shape[:-1], N).to(out_dtype)
