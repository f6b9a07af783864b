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

The loop runs on one intra-op thread (lowbit.threads.one_thread: the writer's and the GGUF GPTQ
pool's setting; torch's ``addr_`` rounds the scalar tail of each run it iterates, which its
threads' chunks move). The column loop inside a block runs in C where the kernel setting allows
(lowbit.kernels.ggml.grid_block: the same operations in the same order, bit-identical); the
block updates stay torch matrix products.
"""

from __future__ import annotations

from typing import Callable

import torch

from lowbit.algorithms.gptq import GPTQOptions, prepare_part
from lowbit.errors import QuantizationError
from lowbit.kernels.ggml import grid_block
from lowbit.numerics.ggml_codes import GgmlGrid
from lowbit.threads import one_thread


def gptq_on_grid(W: torch.Tensor, H: torch.Tensor, grid: GgmlGrid, options: GPTQOptions = GPTQOptions(),
                 name: str = "weight") -> torch.Tensor:
    """The codes [out, in] (int32) GPTQ picks for W [out, in] on ``grid`` (its rows are W's rows),
    given H [in, in] (upper triangle read; dead inputs, H[i, i] == 0, take W's column as zero).
    act_order is not applied: a group's columns share one grid, visited in order."""
    rows, cols = W.shape
    if grid.step.shape != (rows, cols // grid.group) or cols % grid.group:
        raise QuantizationError(f"{name!r}: a {grid.kind.value} grid of {list(grid.step.shape)} groups does not fit "
                                f"the weight {list(W.shape)}")
    with one_thread():
        return _solve(W, H, grid, options, name)


def _solve(W: torch.Tensor, H: torch.Tensor, grid: GgmlGrid, options: GPTQOptions, name: str) -> torch.Tensor:
    rows, cols = W.shape
    step = grid.step.t().repeat_interleave(grid.group, dim=0).contiguous()     # [in, out]
    offset = grid.offset.t().repeat_interleave(grid.group, dim=0).contiguous()
    zero_step = step == 0
    div = torch.where(zero_step, torch.ones_like(step), step)
    lo, hi = float(grid.cmin), float(grid.cmax)
    codes = torch.empty(cols, rows, dtype=torch.float32)
    fill = float(max(grid.cmin, 0))
    fits = W.device == step.device == codes.device and step.dtype == torch.float32  # -Ub is float32 (prepare_part)
    loop = (grid_block(W.device) if fits else None) or block_loop

    def block(W1, E1, u, i1):
        sl = slice(i1, i1 + W1.shape[0])
        loop(W1, E1, codes[sl], step[sl], offset[sl], div[sl], zero_step[sl], u, i1, grid.zero, lo, hi, fill)

    solve_in_blocks(W, H, options, name, block)
    return codes.t().to(torch.int32).contiguous()


def solve_in_blocks(W: torch.Tensor, H: torch.Tensor, options: GPTQOptions, name: str,
                    block: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], None]) -> None:
    """GPTQ's outer loop on a fixed grid (this module's and ``lowbit.algorithms.gptq_table``'s):
    W [out, in] prepared with H (``prepare_part``: dead inputs zeroed, -Ub ``u``), transposed into
    a copy whose rows are W's columns (for one row W.t() is already contiguous, and ``.contiguous()``
    would hand back the caller's weight); per block of ``options.block_size`` columns,
    ``block(W1, E1, u, i1)`` rounds the block's rows ``W1`` [n, out] in order (updating the later
    ones in place) and writes their errors ``E1``, which then update the columns after the block."""
    W, u, _ = prepare_part(W.detach().to(torch.float32), H, GPTQOptions(damping=options.damping), name)
    Wt = W.t().clone(memory_format=torch.contiguous_format)           # [in, out]: a column is a row
    cols = Wt.shape[0]
    bs = max(1, int(options.block_size))
    for i1 in range(0, cols, bs):
        i2 = min(i1 + bs, cols)
        W1 = Wt[i1:i2]
        E1 = torch.empty_like(W1)
        block(W1, E1, u, i1)
        if i2 < cols:
            Wt[i2:].addmm_(u[i1:i2, i2:].t(), E1)


def block_loop(W1: torch.Tensor, E1: torch.Tensor, C1: torch.Tensor, step: torch.Tensor, offset: torch.Tensor,
               div: torch.Tensor, zero_step: torch.Tensor, u: torch.Tensor, j0: int, zero: int, lo: float, hi: float,
               fill: float) -> None:
    """The column loop inside one block of n columns (the reference; lowbit.kernels.ggml.grid_block:
    the same in C): the block's rows [n, R] of the working weights ``W1`` (updated in place), the
    errors ``E1`` and the codes ``C1`` (written), of the grid (``div``: the step, 1 where it is zero)
    and -Ub ``u`` [in, in], the block's from row and column ``j0``."""
    n = W1.shape[0]
    for i in range(n):
        j = j0 + i
        w = W1[i]
        c = torch.round((w + offset[i]) / div[i]).add_(zero).clamp_(lo, hi).masked_fill_(zero_step[i], fill)
        C1[i] = c
        q = step[i] * (c - zero) - offset[i]
        torch.sub(w, q, out=E1[i])
        if i + 1 < n:
            W1[i + 1:].addr_(u[j, j + 1:j0 + n], E1[i])
