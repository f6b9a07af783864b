"""Every kernel implementation equals the reference bit for bit, for every number format and every
scheme, on adversarial values: each operation of lowbit.kernels.interface is run through its entry
point under ``using(implementation)`` and compared with the same call under ``using(REFERENCE)``
(and, for the element operations, with the format's own method)."""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels import Implementation, available, codes, rounding, using
from lowbit.numerics import FormatName, IntFormat, get_format
from lowbit.quant import fake_quantize, int_values, quantize
from lowbit.schemes import PRESETS, Dynamic, Granularity

IMPLEMENTATIONS = [Implementation.REFERENCE, Implementation.TORCH, Implementation.NATIVE, Implementation.TRITON]
FORMATS = [get_format(n) for n in FormatName if n is not FormatName.FP32]
WEIGHT_SPECS = {n: s.weights for n, s in PRESETS.items()}
ACT_SPECS = {n: s.input_activations for n, s in PRESETS.items() if s.input_activations is not None}
LOW_BITS = [0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF]  # exact, just above, below half, half, above half, top


@pytest.fixture(params=IMPLEMENTATIONS, ids=str)
def impl(request):
    if not available(request.param):
        pytest.skip(f"{request.param} cannot run here")
    return request.param


def every_key_value() -> torch.Tensor:
    """Every float32 whose upper 16 bits take all 65536 values, with LOW_BITS below: all ties,
    binade edges, subnormals, max finite, +-0, +-Inf, NaNs."""
    hi = torch.arange(1 << 16, dtype=torch.int64) << 16
    bits = (hi[:, None] + torch.tensor(LOW_BITS)[None, :]).reshape(-1)
    return (bits & 0xFFFFFFFF).to(torch.int32).view(torch.float32)


def encodable(fmt, x: torch.Tensor) -> torch.Tensor:
    if getattr(fmt, "nan_code", None) is None:
        x = x[~torch.isnan(x)]
    if not getattr(fmt, "signed", isinstance(fmt, IntFormat)):  # E8M0: unsigned
        x = x[~(x < 0)]
    return x


def same_bits(a: torch.Tensor, b: torch.Tensor, zero_sign: bool = True) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype != torch.float32:
        return bool(torch.equal(a, b))
    nan = torch.isnan(b)
    if not torch.equal(torch.isnan(a), nan):
        return False
    if not zero_sign:
        a, b = a + 0.0, b + 0.0
    return bool(torch.equal(a.view(torch.int32)[~nan], b.view(torch.int32)[~nan]))


def _errors(fn):
    try:
        return fn()
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"


# ---------------------------------------------------------------------------- element kernels
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_encode_decode_qdq(impl, fmt):
    x = encodable(fmt, every_key_value())
    c = torch.arange(256, dtype=torch.uint8).repeat(2).reshape(2, 256)
    with using(impl):
        got = codes.encode(fmt, x), codes.decode(fmt, c), codes.qdq(fmt, x)
    assert torch.equal(got[0], fmt.encode(x))
    assert same_bits(got[1], fmt.decode(c))
    assert same_bits(got[2], fmt.qdq(x))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_refusals_are_the_reference_errors(impl, fmt):
    for bad in (torch.tensor([1.0, float("nan")]), torch.tensor([1.0, -2.0])):
        with using(impl):
            got = _errors(lambda: codes.encode(fmt, bad))
        want = _errors(lambda: fmt.encode(bad))
        assert (got if isinstance(got, str) else got.tolist()) == (want if isinstance(want, str) else want.tolist())


@pytest.mark.parametrize("fmt", [f for f in FORMATS if rounding.supports(f)], ids=lambda f: f.name)
def test_nearest_rounding(impl, fmt):
    x = every_key_value()
    x = encodable(fmt, x[torch.isfinite(x)]).contiguous()  # an unsigned format takes values >= 0
    with using(impl):
        y = rounding.round_nearest_(x.clone(), fmt)
        col, f = rounding.column_rounder(fmt, x.numel())
        col.copy_(x)
        z = f()
    want = fmt.qdq(x)
    assert same_bits(y, want, zero_sign=False) and same_bits(z, want, zero_sign=False)


# ---------------------------------------------------------------------------- quantize groups, QDQ
def adversarial(n_rows: int = 48, cols: int = 256, seed: int = 0) -> torch.Tensor:
    """Rows of wide-range random values, ties of small grids, +-0 and all-zero groups, float32
    subnormals and values near float32's largest."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_rows, cols, generator=g) * torch.logspace(-30, 30, cols)[torch.randperm(cols, generator=g)]
    x[0] = torch.arange(cols, dtype=torch.float32) * 0.25 - 16.0          # ties of E2M1 / INT grids
    x[1] = torch.linspace(-448.0, 448.0, cols)
    x[2, :64] = 0.0
    x[2, 64:128] = -0.0
    x[3] = 1e-40 * torch.randn(cols, generator=g)                          # float32 subnormals
    x[4] = 3e38 * torch.sign(torch.randn(cols, generator=g))
    return x


def _qt_fields(qt):
    return (qt.codes, qt.scale, qt.zero_point, qt.global_scale)


@pytest.mark.parametrize("name", list(WEIGHT_SPECS))
def test_quantize_groups(impl, name):
    spec = WEIGHT_SPECS[name]
    for dtype in (torch.float32, torch.bfloat16):
        x = adversarial().to(dtype)
        with using(impl):
            got = quantize(x, spec, name="w")
        with using(Implementation.REFERENCE):
            want = quantize(x, spec, name="w")
        assert got.equal(want), (name, dtype)
        assert all(a is None and b is None or same_bits(a, b) for a, b in zip(_qt_fields(got), _qt_fields(want)))


@pytest.mark.parametrize("name", list(ACT_SPECS))
def test_spec_qdq(impl, name):
    spec = ACT_SPECS[name]
    x = adversarial(cols=128, seed=1).clamp(-1e30, 1e30)
    kw = {}
    if spec.dynamic is Dynamic.STATIC and spec.granularity is Granularity.TENSOR:
        kw["scale"] = torch.tensor([0.37])
    if spec.global_scale:
        kw["global_scale"] = torch.tensor([1234.5])
    dev = "cuda" if impl is Implementation.TRITON else "cpu"  # the Triton kernels take CUDA tensors
    with using(impl):
        got = fake_quantize(x.to(dev), spec, name="a", **{k: v.to(dev) for k, v in kw.items()}).cpu()
    with using(Implementation.REFERENCE):
        want = fake_quantize(x, spec, name="a", **kw)
    assert same_bits(got, want), name


@pytest.mark.parametrize("name", ["w8a8-int8", "w8a8-int8-dynamic"])
def test_int_values(impl, name):
    spec = ACT_SPECS[name]
    x = adversarial(cols=128, seed=2).clamp(-1e30, 1e30)
    scale = torch.tensor([0.37]) if spec.dynamic is Dynamic.STATIC else None
    with using(impl):
        vals, eff = int_values(x, spec, scale, "a")
    with using(Implementation.REFERENCE):
        want = fake_quantize(x, spec, scale=scale, name="a")
    assert bool((vals == vals.round()).all()) and same_bits((vals * eff).add_(0.0), want), name


# ---------------------------------------------------------------------------- the setting
def test_using_nests_restores_and_refuses_what_cannot_run():
    from lowbit.kernels import KernelUnavailable, current, resolve

    before = current()
    with using(Implementation.REFERENCE):
        assert resolve() is Implementation.REFERENCE
        with using(Implementation.TORCH):
            assert resolve() is Implementation.TORCH
        assert resolve() is Implementation.REFERENCE
    assert current() == before
    if not available(Implementation.TRITON):
        with pytest.raises(KernelUnavailable, match="'triton' is unavailable"):
            with using(Implementation.TRITON):
                pass  # pragma: no cover
        assert current() == before
