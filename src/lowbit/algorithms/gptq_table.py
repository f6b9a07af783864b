"""GPTQ's error-compensating rounding onto a fixed table of values per group (GGML's FP4 types):
pure function.

MXFP4 and NVFP4 store, per group of ``group`` consecutive weights of a row, one scale d (E8M0 or
UE4M3, chosen by the type's encoder and kept), and per weight a 4-bit code c whose value is
``d * table[c]`` (``lowbit.numerics.ggml_fp4``: the E2M1 values, doubled, with d halved). The codes
are not affine in c, so ``lowbit.algorithms.gptq_grid`` does not apply; here column j of W [out,
in] takes, row by row, the code of least ``|d * table[c] - w|`` (the first on a tie, the encoders'
rule: with no Hessian update this is the encoder's own choice), and its error is spread over the
columns not yet visited through the upper Cholesky factor of the damped inverse Hessian, in
blocks of ``block_size`` columns, as ``gptq_grid`` does.
"""

from __future__ import annotations

import torch

from lowbit.algorithms.gptq import GPTQOptions, prepare_part
from lowbit.errors import QuantizationError


def gptq_on_table(W: torch.Tensor, H: torch.Tensor, scale: torch.Tensor, group: int, table: torch.Tensor,
                  options: GPTQOptions = GPTQOptions(), name: str = "weight") -> torch.Tensor:
    """The codes [out, in] (int64, indices into ``table``) GPTQ picks for W [out, in] given H [in,
    in] (upper triangle read; dead inputs, H[i, i] == 0, take W's column as zero), the fixed scales
    ``scale`` float32 [out, in / group] and the value table float32 [T] (module docstring)."""
    rows, cols = W.shape
    if cols % group or scale.shape != (rows, cols // group):
        raise QuantizationError(f"{name!r}: scales {list(scale.shape)} in groups of {group} do not fit the weight "
                                f"{list(W.shape)}")
    W, u, _ = prepare_part(W.detach().to(torch.float32), H, GPTQOptions(damping=options.damping), name)
    Wt = W.t().clone(memory_format=torch.contiguous_format)                  # [in, out], a copy: a column is a row
    d = scale.to(torch.float32).t().repeat_interleave(group, dim=0).contiguous()   # [in, out]
    table = table.to(torch.float32)
    codes = torch.empty(cols, rows, dtype=torch.int64)
    bs = max(1, int(options.block_size))
    for i1 in range(0, cols, bs):
        i2 = min(i1 + bs, cols)
        W1 = Wt[i1:i2]
        E1 = torch.empty_like(W1)
        for i in range(i2 - i1):
            j = i1 + i
            w = W1[i]
            grid = d[j][:, None] * table                                     # [out, T]
            c = (grid - w[:, None]).abs().argmin(dim=1)                      # the first least error
            codes[j] = c
            torch.sub(w, grid.gather(1, c[:, None]).squeeze(1), out=E1[i])
            if i + 1 < i2 - i1:
                W1[i + 1:].addr_(u[j, j + 1:i2], E1[i])
        if i2 < cols:
            Wt[i2:].addmm_(u[i1:i2, i2:].t(), E1)
    return codes.t().contiguous()
