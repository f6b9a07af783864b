"""Dequantization of FP8 block-scaled source weights (DeepSeek/Qwen ``quant_method: fp8``).

``w = fp8_value * weight_scale_inv[block]`` in float32, then cast to the model's dtype: a
[ceil(out/bo), ceil(in/bi)] scale per bo x bi block (the last blocks may be partial), or one
scale for the whole tensor. Rows are processed in bands so memory stays near the output size.
"""

from __future__ import annotations

import torch

BAND_ELEMS = 1 << 22


def dequantize_fp8_block(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None,
                         dtype: torch.dtype) -> torch.Tensor:
    """FP8 ``w`` [out, in] times its block scales, as ``dtype``."""
    out_f, in_f = w.shape
    s = scale_inv.to(torch.float32)
    if s.numel() == 1:
        return (w.to(torch.float32) * s.reshape(())).to(dtype)
    assert block is not None
    bo, bi = block
    res = torch.empty(out_f, in_f, dtype=dtype)
    rows = max(bo, (BAND_ELEMS // max(in_f, 1)) // bo * bo)
    for r0 in range(0, out_f, rows):
        r1 = min(out_f, r0 + rows)
        band = s[r0 // bo: -(-r1 // bo)]
        full = band.repeat_interleave(bo, 0)[: r1 - r0]  # r0 is a multiple of bo
        full = full.repeat_interleave(bi, 1)[:, :in_f]
        res[r0:r1] = (w[r0:r1].to(torch.float32) * full).to(dtype)
    return res
