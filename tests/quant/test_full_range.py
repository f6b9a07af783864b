"""The full-range INT rule (observer 'full-range'): the signed extreme lands exactly on qmin."""

import pytest
import torch

from lowbit.calibration import CalibrationConfig
from lowbit.calibration.data import CalibrationError
from lowbit.errors import SchemeError
from lowbit.numerics import FormatName as F
from lowbit.quant import dequantize, fake_quantize, quantize
from lowbit.schemes import PRESETS, Granularity as G, WeightObserver, QuantSpec

SPEC = QuantSpec(F.INT4, G.GROUP, 4, observer=WeightObserver.FULL_RANGE)


def _bits(t):
    return t.contiguous().view(torch.int32)


def test_extreme_maps_to_qmin_and_scale_takes_its_sign():
    x = torch.tensor([[1.0, -0.5, 0.25, 8.0,    # positive extreme: scale -1.0, 8.0 -> code -8
                       -8.0, 1.0, 2.0, 3.0,     # negative extreme: scale +1.0
                       4.0, -4.0, 1.0, 0.0,     # tie +4 / -4: the negative one, scale +0.5
                       0.0, 0.0, 0.0, 0.0,      # all zero: scale +0.0, codes 0
                       2.0, 0.0]])              # ragged last group (2 of 4)
    qt = quantize(x, SPEC)
    assert qt.scale.tolist() == [[-1.0, 1.0, 0.5, 0.0, -0.25]]
    assert not bool(torch.signbit(qt.scale[0, 3]))
    want = [-1, 0, 0, -8, -8, 1, 2, 3, 7, -8, 2, 0, 0, 0, 0, 0, -8, 0]
    assert qt.codes.tolist() == [[c & 0xF for c in want]]   # INT4 codes: 4-bit two's complement
    # +4 against a scale of 0.5 saturates at 7: the one clipped value of the tied group
    assert dequantize(qt)[0, 8].item() == 3.5


def test_step_is_amax_over_8_and_error_not_worse_than_max_on_random_weights():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 576, generator=g)
    full = QuantSpec(F.INT4, G.GROUP, 128, observer=WeightObserver.FULL_RANGE)
    mx = QuantSpec(F.INT4, G.GROUP, 128)
    qt = quantize(w, full)
    amax = torch.nn.functional.pad(w, (0, 64)).reshape(64, 5, 128).abs().amax(-1)
    assert torch.equal(qt.scale.abs(), amax / 8)
    err_full = (dequantize(qt) - w).pow(2).sum()
    err_max = (dequantize(quantize(w, mx)) - w).pow(2).sum()
    assert err_full < 0.85 * err_max   # finer step (amax/8 vs amax/7), extremes exact


def test_fake_quantize_bit_identical_with_negative_scales():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 300, generator=g) * torch.logspace(-4, 3, 300)
    x[0, :128] = 0.0
    for spec in (SPEC, PRESETS["w4a16"].weights,
                 QuantSpec(F.INT8, G.CHANNEL, observer=WeightObserver.FULL_RANGE)):
        assert torch.equal(_bits(fake_quantize(x, spec)), _bits(dequantize(quantize(x, spec))))


@pytest.mark.parametrize("kw", [dict(format=F.E4M3, granularity=G.CHANNEL),
                                dict(format=F.INT4, granularity=G.GROUP, group_size=32, symmetric=False),
                                dict(format=F.E2M1, granularity=G.GROUP, group_size=16, scale_format=F.UE5M3)])
def test_full_range_only_for_symmetric_fp32_scaled_int(kw):
    with pytest.raises(SchemeError, match="full-range"):
        QuantSpec(observer="full-range", **kw)


def test_full_range_is_not_an_activation_observer():
    with pytest.raises(CalibrationError, match="full-range"):
        CalibrationConfig(observer="full-range")
    spec = PRESETS["w4a16"].weights
    assert QuantSpec.from_dict(spec.to_dict()) == spec and spec.to_dict()["observer"] == "full-range"
