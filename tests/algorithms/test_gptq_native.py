"""GPTQ's column loop in C (lb_gptq_sub) against its torch loop: the same codes, bit for bit."""

from __future__ import annotations

import pytest
import torch

from lowbit.numerics import get_format
from lowbit.kernels import Implementation, native, using
from lowbit.kernels.native.build import library
from lowbit.algorithms import GPTQOptions, gptq_quantize_groups
from lowbit.algorithms.gptq_solve import solve_columns
from lowbit.schemes import PRESETS

needs_native = pytest.mark.skipif(library() is None, reason="no native library (no C compiler)")
SPECS = {name: PRESETS[name].weights for name in ("w8a8-int8-dynamic", "w4a16", "nvfp4", "w8a8-fp8", "mxfp4")}


def hessian(n: int, rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * (1 + 5 * torch.rand(n, generator=g))
    x = x @ (torch.eye(n) + torch.randn(n, n, generator=g) / n ** 0.5)
    return (x.T @ x).double()


def layer_like(n: int = 192, seed: int = 0):
    """Groups of one decoder layer, scaled down: q/k/v (3 weights), o, gate/up (a wide part),
    and a group of another width; one all-zero row, dead input columns in one Hessian."""
    g = torch.Generator().manual_seed(seed)
    w = lambda o, i: torch.randn(o, i, generator=g) * 0.05  # noqa: E731
    groups = [[w(n, n), w(n // 3, n), w(n // 3, n)], [w(n, n)], [w(1100, n), w(1100, n)], [w(64, 2 * n)]]
    groups[0][1][5] = 0.0
    hs = [hessian(n, 300, 1), hessian(n, 300, 2), hessian(n, 300, 3), hessian(2 * n, 200, 4)]
    dead = [7, n // 2 + 2]
    hs[1][dead] = 0.0
    hs[1][:, dead] = 0.0
    return groups, hs


def solve(groups, hs, spec, options, native: bool):
    with using(Implementation.NATIVE if native else Implementation.TORCH):
        return gptq_quantize_groups(groups, hs, spec, options=options)


@needs_native
@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("act_order,block", [(False, 128), (True, 128), (False, 37)])
def test_native_column_loop_equals_the_torch_loop(name, act_order, block):
    groups, hs = layer_like()
    opts = GPTQOptions(act_order=act_order, block_size=block)
    got, want = solve(groups, hs, SPECS[name], opts, True), solve(groups, hs, SPECS[name], opts, False)
    for ga, gb in zip(got, want):
        for a, b in zip(ga, gb):
            assert a.equal(b)
    # and it is GPTQ, not RTN: the codes moved
    from lowbit.quant import quantize

    assert not torch.equal(got[2][0].codes, quantize(groups[2][0], SPECS[name]).codes)


@needs_native
@pytest.mark.parametrize("name,want", [
    ("w8a8-int8-dynamic", [0, 2, 2, 0, -2, 126, 127, 127, "qmin", 0, 0, 4, 4, 127]),
    ("w8a8-fp8", [0.5, 1.5, 2.5, -0.5, -2.5, 128, 128, 288, -288, 0, 0, 3.75, 4.0, 448]),  # 4.25: tie -> 4
])
def test_native_rounding_of_ties_and_saturation(name, want):
    """One input column, -Ub = -1: the loop is plain rounding of w / 1 (ties to even, saturation
    at the format's ends), the same in C and in torch."""
    fmt = get_format(SPECS[name].format)
    vals = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 126.5, 127.5, 300.0, -300.0, 0.0, 1e-30, 3.75, 4.25, 449.0])
    w = vals.reshape(-1, 1)
    one = torch.ones(1, w.shape[0])
    with using(Implementation.NATIVE):
        a = solve_columns([(w, -torch.eye(1))], one, one, fmt, 128)[0].flatten()
    with using(Implementation.TORCH):
        b = solve_columns([(w, -torch.eye(1))], one, one, fmt, 128)[0].flatten()
    want = torch.tensor([float(fmt.qmin) if v == "qmin" else float(v) for v in want])
    assert torch.equal(a, b) and torch.equal(a, want), (a, b)
    assert native.rounding_args(fmt)[0] == (0 if name == "w8a8-int8-dynamic" else 1)


def test_without_the_library_the_torch_loop_runs():
    groups, hs = layer_like(n=48, seed=3)
    got = solve(groups, hs, SPECS["w8a8-int8-dynamic"], GPTQOptions(), False)
    with using(Implementation.REFERENCE):  # the reference rounding (fmt.qdq) in the torch loop
        want = gptq_quantize_groups(groups, hs, SPECS["w8a8-int8-dynamic"], options=GPTQOptions())
    assert all(a.equal(b) for ga, gb in zip(got, want) for a, b in zip(ga, gb))
