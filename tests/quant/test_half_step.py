"""The half-step INT rule (observer 'half-step'): scale = amax / (qmax + 1/2)."""

import pytest
import torch

from lowbit.calibration import CalibrationConfig
from lowbit.calibration.config import CalibrationError
from lowbit.errors import SchemeError
from lowbit.numerics import FormatName as F
from lowbit.quant import dequantize, fake_quantize, quantize
from lowbit.schemes import Granularity as G, WeightObserver, QuantSpec

INT8 = QuantSpec(F.INT8, G.CHANNEL, observer=WeightObserver.HALF_STEP)
INT4 = QuantSpec(F.INT4, G.GROUP, 4, observer=WeightObserver.HALF_STEP)


def _bits(t):
    return t.contiguous().view(torch.int32)


def test_extremes_land_on_qmin_and_clip_to_qmax():
    x = torch.tensor([[127.5, -127.5, 0.5, 1.5, 126.5, 0.0],   # scale exactly 1.0
                      [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    qt = quantize(x, INT8)
    assert qt.scale.flatten().tolist() == [1.0, 0.0]
    # +amax: 127.5 rounds to 128, clipped to 127; -amax: -127.5 rounds (half to even) to -128;
    # ties 0.5 -> 0, 1.5 -> 2, 126.5 -> 126
    assert qt.codes[0].tolist() == [c & 0xFF for c in [127, -128, 0, 2, 126, 0]] and qt.codes[1].tolist() == [0] * 6
    assert dequantize(qt)[0, 0].item() == 127.0


def test_int4_groups_and_ragged_tail():
    x = torch.tensor([[7.5, -1.0, 0.25, 3.0, -15.0, 1.0, 3.0, 5.0, 3.75, -0.25]])  # groups of 4, last ragged
    qt = quantize(x, INT4)
    assert qt.scale.tolist() == [[1.0, 2.0, 0.5]]
    want = [7, -1, 0, 3, -8, 0, 2, 2, 7, 0]   # 0.25 -> 0, 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> 0
    assert qt.codes.tolist() == [[c & 0xF for c in want]]


def test_step_is_amax_over_qmax_plus_half_and_error_below_max():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 576, generator=g)
    qt = quantize(w, INT8)
    amax = w.abs().amax(-1, keepdim=True)
    assert torch.equal(qt.scale, amax / torch.tensor([127.5]))
    err_half = (dequantize(qt) - w).pow(2).sum()
    err_max = (dequantize(quantize(w, QuantSpec(F.INT8, G.CHANNEL))) - w).pow(2).sum()
    assert err_half < 0.995 * err_max   # step 127/127.5 of max's: squared error ~0.8% lower


def test_fake_quantize_bit_identical():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 300, generator=g) * torch.logspace(-4, 3, 300)
    x[0] = 0.0
    for spec in (INT8, INT4):
        assert torch.equal(_bits(fake_quantize(x, spec)), _bits(dequantize(quantize(x, spec))))


@pytest.mark.parametrize("kw", [dict(format=F.E4M3, granularity=G.CHANNEL),
                                dict(format=F.INT4, granularity=G.GROUP, group_size=32, symmetric=False),
                                dict(format=F.INT8, granularity=G.TOKEN, dynamic="dynamic")])
def test_half_step_only_for_static_symmetric_fp32_scaled_int(kw):
    with pytest.raises(SchemeError, match="half-step"):
        QuantSpec(observer="half-step", **kw)


def test_half_step_is_a_weight_rule_and_round_trips():
    with pytest.raises(CalibrationError, match="half-step"):
        CalibrationConfig(observer="half-step")
    assert QuantSpec.from_dict(INT8.to_dict()) == INT8 and INT8.to_dict()["observer"] == "half-step"
