"""The native rounded weight and offset step of block reconstruction (reconstruct_native.c)
against the torch and reference expressions, bit for bit, on adversarial values: ties of the
element grid, binade edges, the largest finite value and beyond, signed zeros, negative,
subnormal and zero scales, offsets at their bounds; and a whole reconstruction that gives the
same codes under each implementation."""

from __future__ import annotations

import copy

import pytest
import torch

import lowbit
from helpers.models import tiny_llama
from lowbit.algorithms.reconstruct_offsets import _grid, _RoundedWeight
from lowbit.kernels import Implementation, available, using
from lowbit.kernels import offsets as native
from lowbit.numerics import FormatName, get_format

pytestmark = pytest.mark.skipif(not available(Implementation.NATIVE), reason="no C compiler: no native library")

FORMATS = [get_format(FormatName.E2M1), get_format(FormatName.INT4), get_format(FormatName.INT8), get_format(FormatName.E4M3),
           get_format(FormatName.E3M2), get_format(FormatName.E5M2)]


def _case(fmt, n: int = 20000, seed: int = 0):
    """(V, v, step, e, zero) with every adversarial kind mixed in."""
    g = torch.Generator().manual_seed(seed)
    grid = _grid(fmt)
    top = float(grid.abs().max())
    mids = (grid[1:] + grid[:-1]) / 2                       # ties of round-to-nearest-even
    edges = grid[grid != 0]
    special = torch.cat([mids, -mids, edges, torch.nextafter(edges, torch.zeros_like(edges)),
                         torch.tensor([top, -top, top * 1.5, -top * 4, 0.0, -0.0, 1e-30, -1e-30])])
    v = (torch.rand(n, generator=g) * 2 - 1) * top * 1.1
    v[: special.numel()] = special
    V = torch.rand(n, generator=g) - 0.5
    V[: special.numel()] = 0.0                              # x = v exactly: the ties stay ties
    V[-50:] = torch.tensor([0.5, -0.5, -0.0, 0.0, 0.25] * 10)
    idx = torch.searchsorted(grid, v.clamp(grid[0], grid[-1])).clamp(1, grid.numel() - 1)
    step = grid[idx] - grid[idx - 1]
    step[::97] = 1.0
    e = torch.rand(n, generator=g) * 0.1 + 1e-3
    e[::7] = -e[::7]                                        # full-range INT scales keep their sign
    e[::11] = 1e-40                                         # subnormal
    e[::13] = 3e38                                          # products that overflow
    zero = torch.rand(n, generator=g) < 0.05
    e[zero] = 0.0
    return V.contiguous(), v.contiguous(), step.contiguous(), e.contiguous(), zero.contiguous()


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_rounded_weight_is_the_torch_and_reference_value(fmt):
    V, v, step, e, zero = _case(fmt)
    with using(Implementation.NATIVE):
        got = native.rounded_weight(V, v, step, e, zero, fmt)
    assert got is not None
    with using(Implementation.TORCH):
        want = _RoundedWeight.apply(V, v, step, e, zero, fmt)
    x = v + V * step
    r = fmt.decode(fmt.encode(x))
    ref = torch.where(~zero, (x + (r - x)) * e, 0.0)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("fmt", FORMATS[:2], ids=lambda f: f.name)
@pytest.mark.parametrize("lr", [0.02, 0.013, 1e-9, 0.7])
def test_offset_step_is_the_torch_update(fmt, lr):
    V, v, step, e, zero = _case(fmt, seed=1)
    g = torch.randn(V.shape, generator=torch.Generator().manual_seed(2)) * 1e-3
    g[::5] = 0.0
    g[1::5] = -0.0
    g[2::17] = 1e-42
    V[::19] = -0.0
    want = V.clone()
    Vt = V.clone().requires_grad_(True)
    with torch.enable_grad(), using(Implementation.TORCH):
        w = _RoundedWeight.apply(Vt, v, step, e, zero, fmt)
        (d,) = torch.autograd.grad(w, Vt, grad_outputs=g)
    want.sub_(d.sign_().mul_(lr)).clamp_(-0.5, 0.5)
    got = V.clone()
    with using(Implementation.NATIVE):
        assert native.offset_step(got, g, e, step, zero, lr)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("scheme", ["nvfp4", "w4a16"])
def test_reconstruction_gives_the_same_codes_under_every_implementation(scheme):
    tokens = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(4))
    ref = tiny_llama(hidden_size=128, intermediate_size=256)
    out = {}
    for impl in (Implementation.NATIVE, Implementation.TORCH):
        with using(impl):
            q = lowbit.quantize(copy.deepcopy(ref), scheme, calibration=tokens, weight_rounding="gptq",
                                reconstruct_iters=6)
        out[impl] = (dict(q.named_buffers()), q.lowbit_calibration.reconstruct)
    (a, ra), (b, rb) = out[Implementation.NATIVE], out[Implementation.TORCH]
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n
    assert all(ra[k]["changed"] > 0 and ra[k] == rb[k] for k in ra), (ra, rb)



@pytest.mark.parametrize("exponent", [0, 20, 126])
def test_offset_step_rounds_a_one_atom_sum_as_the_plan_does(exponent):
    """With an exponent the update first rounds the gradient as the one-atom gradient sum does
    (``_rounded_float32``: ties to even, -0 to +0, values below the rounding unit to 0)."""
    from lowbit.algorithms.reconstruct_steps import _rounded_float32

    fmt = FORMATS[0]
    V, v, step, e, zero = _case(fmt, seed=7)
    g = torch.randn(V.shape, generator=torch.Generator().manual_seed(8)) * 2.0 ** (-exponent + 3)
    unit = 2.0 ** -exponent
    g[:40] = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -0.0, 0.49, -0.49] * 5) * unit  # ties and near-zero
    want = V.clone()
    with using(Implementation.TORCH):
        d = _rounded_float32(g, exponent).masked_fill(zero, 0.0).mul_(e).mul_(step)
    want.sub_(d.sign_().mul_(0.02)).clamp_(-0.5, 0.5)
    got = V.clone()
    with using(Implementation.NATIVE):
        assert native.offset_step(got, g, e, step, zero, 0.02, exponent)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    plain = V.clone()
    with using(Implementation.NATIVE):
        native.offset_step(plain, g, e, step, zero, 0.02)
    assert not torch.equal(plain, got)  # the rounding decided some signs
