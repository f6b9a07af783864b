"""Triton epilogue of the W8A8 matmuls: y = (acc * x_scale) * w_scale (+ bias), cast to the
output dtype, in one pass over the accumulator. The same float32 operations in the same
order as lowbit.kernels.gemm.apply_scales followed by ``.to(dtype)``, so bit-identical to it
(no FMA contraction, bfloat16 rounding to nearest even)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.kernels.ieee_bits import f32_bits, store_f32_as


@triton.jit
def _scale_epilogue_kernel(
    acc_ptr, sx_ptr, sw_ptr, b_ptr, y_ptr, M, N,
    SX_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mm = rm < M
    nm = rn < N
    mask = mm[:, None] & nm[None, :]
    offs = rm[:, None] * N + rn[None, :]
    acc = tl.load(acc_ptr + offs, mask=mask, other=0).to(tl.float32)
    if SX_PER_ROW:
        sx = tl.load(sx_ptr + rm, mask=mm, other=0.0)
    else:
        sx = tl.broadcast_to(tl.load(sx_ptr), [BLOCK_M])
    sw = tl.load(sw_ptr + rn, mask=nm, other=0.0)
    y = acc * sx[:, None]
    y = y * sw[None, :]
    if HAS_BIAS:
        y = y + tl.load(b_ptr + rn, mask=nm, other=0.0).to(tl.float32)[None, :]
    store_f32_as(y_ptr + offs, f32_bits(y), mask, OUT_BF16)


def scale_epilogue(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                   dtype: torch.dtype, block_m: int = 32, block_n: int = 128) -> torch.Tensor:
    """acc [M, N] (int32 or float32) -> (acc * x_scale) * w_scale (+ bias) in ``dtype``
    (float32 or bfloat16). x_scale [M, 1] or [1]; w_scale [N, 1] or [N]."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"epilogue output dtype must be float32 or bfloat16, not {dtype}")
    M, N = acc.shape
    acc = acc.contiguous()
    sx = x_scale.to(torch.float32).reshape(-1).contiguous()
    sw = w_scale.to(torch.float32).reshape(-1).contiguous()
    b = bias.contiguous() if bias is not None else sw
    y = torch.empty(M, N, dtype=dtype, device=acc.device)
    if M and N:
        grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
        _scale_epilogue_kernel[grid](acc, sx, sw, b, y.view(torch.int16) if dtype == torch.bfloat16 else y, M, N,
                                     SX_PER_ROW=sx.numel() != 1 or M == 1, HAS_BIAS=bias is not None,
                                     OUT_BF16=dtype == torch.bfloat16, BLOCK_M=block_m, BLOCK_N=block_n,
                                     enable_fp_fusion=False)
    return y
