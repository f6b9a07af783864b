"""weight-cache: dequantize once, results identical to the reference backend, the automatic CPU choice."""

import pytest
import torch
import torch.nn as nn

from lowbit.backends import REGISTRY, use_backend
from lowbit.backends.reference import ReferenceBackend
from lowbit.backends.weight_cache import WeightCacheBackend
from lowbit.errors import LowbitError
from lowbit.modules import QuantLinear
from lowbit.schemes import get_scheme


def _module(scheme: str, in_f: int = 64, out_f: int = 24) -> QuantLinear:
    torch.manual_seed(0)
    lin = nn.Linear(in_f, out_f)
    s = get_scheme(scheme)
    kw = {}
    if s.input_activations is not None and s.input_activations.needs_calibration:
        from lowbit.calibration import input_scales_from_amax

        kw = input_scales_from_amax(s.input_activations, torch.tensor([3.0]))
    return QuantLinear.from_linear(lin, s, name="t", **kw)


@pytest.mark.parametrize("scheme", ["w4a16", "w8a16", "nvfp4a16", "w8a8-fp8", "w8a8-fp8-dynamic", "nvfp4",
                                    "mxfp4", "nvfp4-e5m3", "w4a8-int8", "w4a8-fp8", "w4a16-asym", "fp8-block",
                                    "mxfp6-mxfp8", "mxfp4-mxfp8"])
def test_identical_to_reference(scheme):
    in_f = 256 if scheme == "fp8-block" else 64  # whole activation groups of 128
    m = _module(scheme, in_f=in_f)
    x = torch.randn(3, 5, in_f)
    be = WeightCacheBackend()
    assert torch.equal(be.forward(m, x), ReferenceBackend().forward(m, x))
    w1 = be.weight(m)
    assert be.weight(m) is w1  # dequantized once
    assert torch.equal(be.forward(m, x), ReferenceBackend().forward(m, x))


def test_automatic_on_the_cpu_for_the_schemes_it_takes():
    m = _module("w4a16")
    assert REGISTRY.select(m).name == "weight-cache"
    assert REGISTRY.select(_module("w8a8-int8-dynamic")).name == "cpu-int8"
    assert REGISTRY.select(_module("w4a8-int8")).name == "weight-cache"
    assert use_backend(nn.Sequential(_module("w4a16")), "reference") == {"reference": 1}
    assert use_backend(nn.Sequential(m), "weight-cache") == {"weight-cache": 1}
    with pytest.raises(LowbitError, match="weight-cache"):
        use_backend(nn.Sequential(_module("w8a8-int8-dynamic")), "weight-cache")


def test_invalidated_by_load_state_dict_and_released():
    m = _module("w8a16")
    other = _module("w8a16")
    with torch.no_grad():
        other.weight_codes.copy_(torch.flip(other.weight_codes, [0]))
    be = WeightCacheBackend()
    x = torch.randn(4, 64)
    before = be.forward(m, x)
    m.load_state_dict(other.state_dict())
    after = be.forward(m, x)
    assert not torch.equal(before, after)
    assert torch.equal(after, ReferenceBackend().forward(m, x))
    be.release(m)
    assert m not in be.cache and len(be.cache) == 0


@pytest.mark.parametrize("scheme", ["w8a8-fp8", "w8a8-fp8-dynamic"])
def test_fp8_input_qdq_bit_identical(scheme):
    from lowbit.modules.inputs import qdq_input, quantize_input
    from lowbit.numerics import E4M3
    from lowbit.quant import dequantize

    m = _module(scheme)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 64, generator=g) * torch.logspace(-8, 3, 64)
    # every E4M3 value and the midpoints between neighbours (ties), at the static scale's grid
    vals = E4M3.decode(E4M3.finite_codes()).sort().values
    mids = (vals[1:] + vals[:-1]) / 2
    grid = torch.cat([vals, mids, torch.tensor([500.0, -1e6, 1e-12, -0.0])])
    s = m.input_scale if m.input_scale is not None else torch.tensor([1.0])
    x[:8] = (grid[: 8 * 64] if grid.numel() >= 512 else torch.nn.functional.pad(grid, (0, 512 - grid.numel())))[
        :512].reshape(8, 64) * s
    x[9] = 0.0
    fast, ref = qdq_input(m, x), dequantize(quantize_input(m, x))
    assert torch.equal(fast, ref)
    assert torch.equal(torch.signbit(fast), torch.signbit(ref))
