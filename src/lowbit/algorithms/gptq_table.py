"""GPTQ's error-compensating rounding onto a fixed table of values per group (GGML's FP4 types):
pure function.

MXFP4 and NVFP4 store, per group of ``group`` consecutive weights of a row, one scale d (E8M0 or
UE4M3, chosen by the type's encoder and kept), and per weight a 4-bit code c whose value is
``d * table[c]`` (``lowbit.numerics.ggml_fp4``: the E2M1 values, doubled, with d halved). The codes
are not affine in c, so ``lowbit.algorithms.gptq_grid`` does not apply; here column j of W [out,
in] takes, row by row, the code of least ``|d * table[c] - w|`` (the first on a tie, the encoders'
rule: with no Hessian update this is the encoder's own choice), and its error is spread over the
columns not yet visited through the upper Cholesky factor of the damped inverse Hessian, in
blocks of ``block_size`` columns, by ``gptq_grid``'s outer loop (``solve_in_blocks``).
"""

from __future__ import annotations

import torch

from lowbit.algorithms.gptq import GPTQOptions
from lowbit.algorithms.gptq_grid import solve_in_blocks
from lowbit.errors import QuantizationError
from lowbit.threads import one_thread


def gptq_on_table(W: torch.Tensor, H: torch.Tensor, scale: torch.Tensor, group: int, table: torch.Tensor,
                  options: GPTQOptions = GPTQOptions(), name: str = "weight") -> torch.Tensor:
    """The codes [out, in] (int64, indices into ``table``) GPTQ picks for W [out, in] given H [in,
    in] (upper triangle read; dead inputs, H[i, i] == 0, take W's column as zero), the fixed scales
    ``scale`` float32 [out, in / group] and the value table float32 [T] (module docstring)."""
    rows, cols = W.shape
    if cols % group or scale.shape != (rows, cols // group):
        raise QuantizationError(f"{name!r}: scales {list(scale.shape)} in groups of {group} do not fit the weight "
                                f"{list(W.shape)}")
    d = scale.to(torch.float32).t().repeat_interleave(group, dim=0).contiguous()   # [in, out]
    table = table.to(torch.float32)
    codes = torch.empty(cols, rows, dtype=torch.int64)

    def block(W1, E1, u, i1):
        n = W1.shape[0]
        for i in range(n):
            j = i1 + i
            w = W1[i]
            grid = d[j][:, None] * table                                     # [out, T]
            c = (grid - w[:, None]).abs().argmin(dim=1)                      # the first least error
            codes[j] = c
            torch.sub(w, grid.gather(1, c[:, None]).squeeze(1), out=E1[i])
            if i + 1 < n:
                W1[i + 1:].addr_(u[j, j + 1:i1 + n], E1[i])

    with one_thread():  # torch's addr_ rounds its chunks' tails apart: the bits would follow the thread count
        solve_in_blocks(W, H, options, name, block)
    return codes.t().contiguous()
