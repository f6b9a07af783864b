"""W8A8 matmuls on the GPU with exact integer / fp8 products: torch._int_mm (INT8, int32
accumulation) and torch._scaled_mm (FP8 E4M3, float32 accumulation), the scales applied
after the product in float32: y = (acc * x_scale) * w_scale (+ bias)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _pad_rows(a: torch.Tensor, multiple: int, minimum: int = 0) -> tuple[torch.Tensor, int]:
    M = a.shape[0]
    target = max(-(-M // multiple) * multiple, minimum)
    if target != M:
        a = F.pad(a, (0, 0, 0, target - M))
    return a, M


def int8_matmul(x_codes: torch.Tensor, w_codes_t: torch.Tensor) -> torch.Tensor:
    """int32 [M, N] = int8 x [M, K] @ int8 w^T, exact. ``x_codes``/``w_codes_t`` are uint8
    two's-complement codes, ``w_codes_t`` the [K, N] transpose view of a contiguous [N, K]."""
    a, M = _pad_rows(x_codes.view(torch.int8), 8, minimum=32 if x_codes.is_cuda else 0)
    acc = torch._int_mm(a, w_codes_t.view(torch.int8))
    return acc[:M]


def fp8_matmul(x_codes: torch.Tensor, w_codes_t: torch.Tensor) -> torch.Tensor:
    """float32 [M, N] = E4M3 x [M, K] @ E4M3 w^T (products exact, float32 accumulation)."""
    a, M = _pad_rows(x_codes.view(torch.float8_e4m3fn), 16)
    one = torch.ones((), dtype=torch.float32, device=a.device)
    acc = torch._scaled_mm(a, w_codes_t.view(torch.float8_e4m3fn), scale_a=one, scale_b=one,
                           out_dtype=torch.float32, use_fast_accum=False)
    return acc[:M]


def apply_scales(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """(acc * x_scale) * w_scale (+ bias), float32. x_scale [M, 1] or [1]; w_scale [N, 1] or [1]."""
    y = acc.to(torch.float32) * x_scale.to(torch.float32).reshape(-1, 1)
    y = y * w_scale.to(torch.float32).reshape(1, -1)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y
