"""GPTQ on a fixed GGML grid (lowbit.algorithms.gptq_grid): a pure function of its arguments."""

from __future__ import annotations

import pytest
import torch

from lowbit.algorithms.gptq_grid import gptq_on_grid
from lowbit.numerics.ggml import GgmlType, encode
from lowbit.numerics.ggml_codes import grid_of


def _hessian(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(300, n, generator=g) * (1 + 5 * torch.rand(n, generator=g))
    return (x.T @ x).double()


@pytest.mark.parametrize("rows", [1, 3])
def test_the_weight_and_hessian_are_left_alone_and_calls_repeat(rows):
    """One row: W.t() is already contiguous, and the working copy must still be a copy."""
    g = torch.Generator().manual_seed(rows)
    W, H = torch.randn(rows, 64, generator=g) * 0.05, _hessian(64, rows)
    W0, H0 = W.clone(), H.clone()
    grid = grid_of(encode(W, GgmlType.Q5_0), GgmlType.Q5_0)
    first = gptq_on_grid(W, H, grid)
    assert torch.equal(W, W0) and torch.equal(H, H0)
    assert torch.equal(gptq_on_grid(W, H, grid), first)
