"""GGML affine grids as reconstruction offsets (``lowbit.algorithms.reconstruct_grid``): the start
is the given codes exactly (GPTQ's, one or several steps from the float weight), the values are
llama.cpp's, the straight-through forward equals them, a step moves a code by at most one grid
step toward or away, and all-zero blocks stay as they are."""

from __future__ import annotations

import pytest
import torch

from lowbit.algorithms.reconstruct_grid import GridOffsets
from lowbit.numerics.ggml import GgmlType, decode, encode
from lowbit.numerics.ggml_codes import AFFINE, codes_of, grid_of, with_codes

KINDS = list(AFFINE)


def _rows(kind: GgmlType, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(4, 512, generator=g)
    W[1, :256] = 0.0  # an all-zero block (zero step)
    W[2, 7] = 40.0    # an outlier: its block's other weights sit near the middle codes
    return W, encode(W, kind, "w")


def _moved(kind: GgmlType, data: torch.Tensor, seed: int) -> torch.Tensor:
    """The codes with some moved by one to three steps (as GPTQ moves them), within the grid."""
    grid = grid_of(data, kind)
    c = codes_of(data, kind)
    g = torch.Generator().manual_seed(seed)
    d = torch.randint(-3, 4, c.shape, generator=g) * (torch.rand(c.shape, generator=g) < 0.3)
    return (c + d).clamp(grid.cmin, grid.cmax).to(torch.int32)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.value)
def test_start_is_the_given_codes_and_values_are_llama_cpps(kind):
    W, data = _rows(kind)
    given = _moved(kind, data, 1)
    off = GridOffsets(W, grid_of(data, kind), given)
    assert torch.equal(off.codes(), given)
    exact = decode(with_codes(data, kind, given), kind).reshape(W.shape)
    assert torch.equal(off.value(), exact)
    assert torch.equal(off.weight().detach(), exact)
    assert off.store(None) == (0, 0)


@pytest.mark.parametrize("kind", [GgmlType.Q2_K, GgmlType.Q3_K, GgmlType.Q4_K, GgmlType.Q5_0, GgmlType.Q8_0],
                         ids=lambda k: k.value)
@torch.enable_grad()
def test_a_step_moves_codes_by_one_and_the_gradient_points_at_the_float_weight(kind):
    W, data = _rows(kind)
    grid = grid_of(data, kind)
    given = _moved(kind, data, 2)
    off = GridOffsets(W, grid, given)
    # the loss |w_q - W|^2: its signed step moves codes toward W, never by more than one step
    for lr in (0.3, 0.3):
        loss = (off.weight() - W).pow(2).sum()
        (g,) = torch.autograd.grad(loss, off.params())
        with torch.no_grad():
            off.V.sub_(g.sign() * lr).clamp_(-0.5, 0.5)
    c = off.codes()
    assert (c - given).abs().max() <= 1
    err_given = (decode(with_codes(data, kind, given), kind).reshape(W.shape) - W).pow(2).sum()
    assert (off.value() - W).pow(2).sum() < err_given
    zero = grid.step.repeat_interleave(grid.group, dim=1) == 0
    assert bool(zero.any())
    assert torch.equal(c[zero], given[zero]), "a zero-step block's codes changed"
    assert off.store(None)[0] == int((c != given).sum()) > 0
    assert torch.equal(grid_of(with_codes(data, kind, c), kind).step, grid.step)  # the scales are kept


def test_codes_outside_the_grid_never_come_out():
    kind = GgmlType.Q2_K
    W, data = _rows(kind)
    off = GridOffsets(W * 3, grid_of(data, kind), codes_of(data, kind))  # weights far beyond the grid
    with torch.no_grad():
        off.V.fill_(0.5)
    c = off.codes()
    assert int(c.min()) >= 0 and int(c.max()) <= 3
    with_codes(data, kind, c)  # accepted


@torch.enable_grad()
def test_the_fused_step_is_autograds_signed_step():
    """``step`` (no autograd) moves V exactly as the signed gradient of ``weight()`` would."""
    kind = GgmlType.Q3_K  # steps of both signs
    W, data = _rows(kind)
    a = GridOffsets(W, grid_of(data, kind), _moved(kind, data, 4))
    b = GridOffsets(W, grid_of(data, kind), _moved(kind, data, 4))
    target = W + 0.1 * torch.randn(W.shape, generator=torch.Generator().manual_seed(9))
    for _ in range(3):
        w = a.value().requires_grad_(True)
        (gw,) = torch.autograd.grad((w - target).pow(2).sum(), [w])
        assert a.step(gw, 0.2)
        (gv,) = torch.autograd.grad((b.weight() - target).pow(2).sum(), b.params())
        with torch.no_grad():
            b.V.sub_(gv.sign() * 0.2).clamp_(-0.5, 0.5)
        assert torch.equal(a.V, b.V)
    assert a.store(None)[0] > 0
