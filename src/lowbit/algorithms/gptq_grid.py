"""GPTQ's error-compensating rounding onto a fixed affine grid (GGML's types): pure function.

The grid (``lowbit.numerics.ggml_codes.GgmlGrid``: per group of input columns a step and an
offset, integer codes in [cmin, cmax]) is chosen first, by the type's own scale search (llama.cpp's
reference or importance-weighted one), and stays fixed; only the codes change. Columns (input
features) of W [out, in] are visited in order; column j takes the nearest code of its current
value, c = clamp(round((w + offset) / step) + zero), and its error is spread over the columns not
yet visited through the upper Cholesky factor U of the damped inverse Hessian H^-1 (H = sum x^T x
over calibration inputs), as ``lowbit.algorithms.gptq`` does for lowbit's own formats:
w_k -= (w_j - q_j) U[j, k] / U[j, j], inside a block of ``block_size`` columns at once, the
later columns lazily per block. A zero step (a sub-block whose stored scale is 0) gives every
code the value -offset: code ``max(cmin, 0)`` (llama.cpp's encoders keep their search's code there;
the value is the same).
"""

from __future__ import annotations

import torch

from lowbit.algorithms.gptq import GPTQOptions, prepare_part
from lowbit.errors import QuantizationError
from lowbit.numerics.ggml_codes import GgmlGrid


def gptq_on_grid(W: torch.Tensor, H: torch.Tensor, grid: GgmlGrid, options: GPTQOptions = GPTQOptions(),
                 name: str = "weight") -> torch.Tensor:
    """The codes [out, in] (int32) GPTQ picks for W [out, in] on ``grid`` (its rows are W's rows),
    given H [in, in] (upper triangle read; dead inputs, H[i, i] == 0, take W's column as zero).
    act_order is not applied: a group's columns share one grid, visited in order."""
    rows, cols = W.shape
    if grid.step.shape != (rows, cols // grid.group) or cols % grid.group:
        raise QuantizationError(f"{name!r}: a {grid.kind.value} grid of {list(grid.step.shape)} groups does not fit "
                                f"the weight {list(W.shape)}")
    W, u, _ = prepare_part(W.detach().to(torch.float32), H, GPTQOptions(damping=options.damping), name)
    Wt = W.t().clone(memory_format=torch.contiguous_format)           # [in, out]: a column is a row (a copy:
    # for one row, W.t() is already contiguous and .contiguous() would hand back the caller's weight)
    step = grid.step.t().repeat_interleave(grid.group, dim=0).contiguous()     # [in, out]
    offset = grid.offset.t().repeat_interleave(grid.group, dim=0).contiguous()
    zero_step = step == 0
    div = torch.where(zero_step, torch.ones_like(step), step)
    lo, hi = float(grid.cmin), float(grid.cmax)
    codes = torch.empty(cols, rows, dtype=torch.float32)
    fill = float(max(grid.cmin, 0))
    bs = max(1, int(options.block_size))
    for i1 in range(0, cols, bs):
        i2 = min(i1 + bs, cols)
        W1 = Wt[i1:i2]
        E1 = torch.empty_like(W1)
        for i in range(i2 - i1):
            j = i1 + i
            w = W1[i]
            c = torch.round((w + offset[j]) / div[j]).add_(grid.zero).clamp_(lo, hi).masked_fill_(zero_step[j], fill)
            codes[j] = c
            q = step[j] * (c - grid.zero) - offset[j]
            torch.sub(w, q, out=E1[i])
            if i + 1 < i2 - i1:
                W1[i + 1:].addr_(u[j, j + 1:i2], E1[i])
        if i2 < cols:
            Wt[i2:].addmm_(u[i1:i2, i2:].t(), E1)
    return codes.t().to(torch.int32).contiguous()
