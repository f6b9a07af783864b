"""lowbit.quant.fast_qdq (the torch implementation of fake_quantize) equals the reference fake_quantize /
MiniFloat.qdq / scales_from_amax bit for bit."""

import pytest
import torch

from lowbit.errors import QuantizationError
from lowbit.numerics import E2M1, E4M3, E5M2, IntFormat, get_format
from lowbit.kernels import Implementation, using
from lowbit.quant import fake_quantize as _fake_quantize, global_scale_from_amax, int_values, scales_from_amax
from lowbit.quant.fast_qdq import block_amax, block_route, round_minifloat_, row_route
from lowbit.schemes import PRESETS, Dynamic, Granularity
from helpers.patterns import finite_half_patterns, ties, wide_random

def fake_quantize(x, spec, **kw):
    """The reference."""
    with using(Implementation.REFERENCE):
        return _fake_quantize(x, spec, **kw)


def fast_fake_quantize(x, spec, **kw):
    """The torch implementation, through the entry point."""
    with using(Implementation.TORCH):
        return _fake_quantize(x, spec, **kw)


def block_scales(a, spec, gs):
    """The block scales the fast paths use (the native scale encoder where available)."""
    return scales_from_amax(a, spec, gs)


def reference_scales(a, spec, gs):
    with using(Implementation.REFERENCE):
        return scales_from_amax(a, spec, gs)


def int_row_values(x, spec, scale):
    with using(Implementation.TORCH):
        return int_values(x, spec, scale)


ACT_SPECS = {n: s.input_activations for n, s in PRESETS.items() if s.input_activations is not None}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _assert_same(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert got.dtype == ref.dtype and got.shape == ref.shape
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(got), nan)
    diff = (_bits(got) != _bits(ref)) & ~nan
    assert not bool(diff.any()), f"{int(diff.sum())} differ, e.g. got {got[diff][:4]} want {ref[diff][:4]}"


# ---------------------------------------------------------------------------- element rounding
@pytest.mark.parametrize("fmt", [E2M1, E4M3, E5M2], ids=lambda f: f.name)
def test_round_minifloat_equals_qdq(fmt):
    x = torch.cat([finite_half_patterns(), ties(fmt), wide_random(100_000, 1),
                   torch.tensor([0.0, -0.0, 1e-45, -1e-45, 2.0**-126, 3.4028235e38, -3.4028235e38,
                                 fmt.min_subnormal / 2, -fmt.min_subnormal / 2, fmt.min_normal])])
    got = round_minifloat_(x.clone(), fmt, x)
    _assert_same(got, fmt.qdq(x))


# ---------------------------------------------------------------------------- block scales
def _amaxes() -> torch.Tensor:
    pows = torch.ldexp(torch.ones(280), torch.arange(-149, 131).float())
    edges = torch.cat([pows, torch.nextafter(pows, torch.tensor(0.0)), torch.nextafter(pows, torch.tensor(1e39))])
    x = torch.cat([finite_half_patterns().abs(), edges, wide_random(50_000, 3).abs(),
                   torch.tensor([0.0, 1e-45, 3.4028235e38, 6.0, 448.0, 6.0 * 448.0])])
    return x[torch.isfinite(x)]


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4-e5m3", "mxfp4", "mxfp8"])
def test_block_scales_equal_reference(name):
    spec = ACT_SPECS[name]
    a = _amaxes()
    globals_ = [None]
    if spec.global_scale:
        globals_ = [global_scale_from_amax(torch.tensor(t), spec) for t in (1e-30, 1e-6, 0.37, 1.0, 5e3, 3e38)]
    for gs in globals_:
        _assert_same(block_scales(a.clone(), spec, gs), reference_scales(a, spec, gs))


def test_block_amax_equals_abs_amax_and_propagates_nan_inf():
    x = torch.cat([finite_half_patterns(), torch.zeros(64)])
    x = x[: x.numel() // 32 * 32].reshape(-1, 2, 16)
    _assert_same(block_amax(x), x.abs().amax(-1))
    for bad in (float("nan"), float("inf"), float("-inf")):
        for pos in (0, 7, 15):
            y = torch.ones(3, 2, 16)
            y[1, 1, pos] = bad
            a = block_amax(y)
            assert not bool(torch.isfinite(a[1, 1])) and bool(torch.isfinite(a[1, 0])) and bool(torch.isfinite(a[0]).all())


# ---------------------------------------------------------------------------- whole activation QDQ
def _kwargs(spec, x, static_divisor: float = 100.0) -> dict:
    kw = {}
    if spec.global_scale:
        kw["global_scale"] = global_scale_from_amax(x.abs().amax(), spec)
    if spec.dynamic is Dynamic.STATIC and spec.granularity is Granularity.TENSOR:
        kw["scale"] = x.abs().amax().reshape(1) / static_divisor
    return kw


def _adversarial_activation(spec, seed: int) -> torch.Tensor:
    """[rows, 128]: half-precision patterns in blocks, ties placed on exact block scales,
    binade edges, subnormals of the element format, zeros, -0.0, all-zero blocks and
    blocks whose scale underflows."""
    fmt = get_format(spec.format)
    pats = finite_half_patterns()
    g = torch.Generator().manual_seed(seed)
    pats = pats[torch.randperm(pats.numel(), generator=g)]
    pats = pats[: pats.numel() // 128 * 128].reshape(-1, 128)
    # ties: each 32-block holds max_finite (fixing a power-of-two-friendly scale) and ties/neighbours
    if isinstance(fmt, IntFormat):
        t = torch.arange(-280, 281) / 2
        t = torch.cat([t, torch.nextafter(t, torch.tensor(0.0)), torch.nextafter(t, torch.tensor(1e3))])
    else:
        t = ties(fmt)
    t = t[t.abs() <= fmt.max_finite]
    reps = -(-t.numel() // 31)
    t = torch.cat([t, torch.zeros(reps * 31 - t.numel())]).reshape(reps, 31)
    tie_blocks = torch.cat([torch.full((reps, 1), fmt.max_finite), t], 1)
    k = torch.arange(reps).float() % 40 - 20
    tie_blocks = tie_blocks * torch.ldexp(torch.ones(reps, 1), k[:, None])
    tie_blocks = tie_blocks[: tie_blocks.shape[0] // 4 * 4].reshape(-1, 128)
    special = torch.randn(6, 128, generator=g)
    special[0, :32] = 0.0                                  # all-zero block
    special[1, :16] = -0.0                                 # -0.0 block
    special[1, 16:32] = torch.tensor([-0.0, 0.0] * 8)
    special[2, :16] = 1e-30                                # a block scale that underflows
    special[2, 16:32] = -1e-38
    special[3] = torch.ldexp(torch.ones(128), torch.arange(128).float() - 64)   # binade edges
    special[4] = torch.nextafter(special[3], torch.tensor(0.0))
    special[5] = fmt.max_finite * torch.logspace(-12, 0, 128)
    return torch.cat([pats, tie_blocks, special, torch.zeros(1, 128)])


@pytest.mark.parametrize("name", list(ACT_SPECS))
def test_fast_fake_quantize_equals_reference(name):
    spec = ACT_SPECS[name]
    assert block_route(spec, 128, None) or row_route(spec, None if spec.dynamic is not Dynamic.STATIC else torch.ones(1))
    x = _adversarial_activation(spec, seed=5)
    big = x.clamp(-1e20, 1e20) * 2.0**60
    static = spec.dynamic is Dynamic.STATIC and spec.granularity is Granularity.TENSOR
    for variant in (x, x * 2.0**-100, big, x[-64:].reshape(-1, 4, 128)):
        for div in ((100.0, 1.0, 1e-6) if static else (100.0,)):
            kw = _kwargs(spec, variant, div)
            _assert_same(fast_fake_quantize(variant, spec, **kw), fake_quantize(variant, spec, **kw))


@pytest.mark.parametrize("name", list(ACT_SPECS))
def test_fast_fake_quantize_layouts_and_dtypes(name):
    spec = ACT_SPECS[name]
    g = torch.Generator().manual_seed(9)
    base = torch.randn(6, 256, generator=g) * torch.logspace(-4, 3, 256)
    for x in (base, base.t().contiguous().t(), base[:, :128], base[0], base.to(torch.bfloat16), base[None]):
        kw = _kwargs(spec, x.float())
        _assert_same(fast_fake_quantize(x, spec, **kw), fake_quantize(x, spec, **kw))


@pytest.mark.parametrize("name", list(ACT_SPECS))
def test_zero_scales_give_positive_zeros(name):
    spec = ACT_SPECS[name]
    x = -torch.rand(4, 64) * 1e-3
    x[0] = -0.0
    kw = _kwargs(spec, x)
    if "scale" in kw:
        kw["scale"] = torch.zeros(1)
    if spec.global_scale:                          # a global scale that makes every block scale round to 0
        kw["global_scale"] = torch.tensor([1e-30])
    _assert_same(fast_fake_quantize(x, spec, **kw), fake_quantize(x, spec, **kw))


@pytest.mark.parametrize("name", list(ACT_SPECS))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_is_the_reference_error(name, bad):
    spec = ACT_SPECS[name]
    x = torch.randn(3, 64)
    kw = _kwargs(spec, x)
    x[1, 37] = bad
    with pytest.raises(QuantizationError) as ref:
        fake_quantize(x, spec, name="layer.input", **kw)
    with pytest.raises(QuantizationError) as got:
        fast_fake_quantize(x, spec, name="layer.input", **kw)
    assert str(got.value) == str(ref.value)


def test_ragged_block_is_the_reference_error():
    spec = ACT_SPECS["mxfp8"]
    x = torch.randn(2, 40)
    with pytest.raises(QuantizationError) as ref:
        fake_quantize(x, spec, name="t")
    with pytest.raises(QuantizationError) as got:
        fast_fake_quantize(x, spec, name="t")
    assert str(got.value) == str(ref.value)


@pytest.mark.parametrize("name", ["w8a8-int8", "w8a8-int8-dynamic"])
def test_int_row_values_times_scale_is_reference(name):
    spec = ACT_SPECS[name]
    x = _adversarial_activation(spec, seed=11)
    kw = _kwargs(spec, x)
    vals, scale = int_row_values(x, spec, kw.get("scale"))
    assert bool((vals == vals.round()).all()) and float(vals.abs().max()) <= 128
    _assert_same((vals * scale).add_(0.0), fake_quantize(x, spec, **kw))
