"""The full-range INT rule (observer 'full-range'): the signed extreme lands exactly on qmin."""

import pytest
import torch

from lowbit.calibration import CalibrationConfig
from lowbit.calibration.config import CalibrationError
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


# ---------------------------------------------------------------------------- full-range-mse
FRM = QuantSpec(F.INT4, G.GROUP, 128, observer=WeightObserver.FULL_RANGE_MSE)
FR = QuantSpec(F.INT4, G.GROUP, 128, observer=WeightObserver.FULL_RANGE)


def _group_errors(x, spec):
    from lowbit.quant import group_error
    from lowbit.quant.groups import group_view

    qt = quantize(x, spec)
    return qt, group_error(group_view(x, spec), spec, qt.scale, None, None)


def test_full_range_mse_scale_is_a_documented_ratio_of_the_full_range_one_with_its_sign():
    from lowbit.quant.mse_scales import RATIOS

    g = torch.Generator().manual_seed(2)
    w = torch.randn(32, 576, generator=g)
    w[3, :128] = 0.0                       # an all-zero group keeps its zero scale
    w[4, 128:256] = torch.arange(-8, 8).repeat(8).float() * 0.01   # on the full-range grid: exact, kept
    q0, e0 = _group_errors(w, FR)
    q1, e1 = _group_errors(w, FRM)
    assert bool((e1 <= e0).all()) and int((e1 < e0).sum()) > 0
    assert float(e1.sum()) < 0.97 * float(e0.sum())   # Gaussian groups of 128: about 5-8% less squared error
    assert q1.scale[3, 0].item() == 0.0 and float(e1[4, 1]) == 0.0 and q1.scale[4, 1] == q0.scale[4, 1]
    nz = q0.scale != 0
    assert torch.equal(torch.signbit(q1.scale[nz]), torch.signbit(q0.scale[nz]))   # the extreme's side stays on -8
    ratios = torch.tensor(RATIOS)
    # every scale is exactly the full-range one times a documented ratio (float32 product)
    cand = q0.scale[nz].unsqueeze(-1) * ratios
    assert bool((cand == q1.scale[nz].unsqueeze(-1)).any(-1).all())
    # a ratio below 1 clips the values next to the extreme at qmin (-8) too
    def at_qmin(qt):
        return int(((qt.codes.view(torch.uint8) & 0xF) == 8).sum())
    assert at_qmin(q1) > at_qmin(q0)


def test_full_range_mse_is_bit_identical_across_paths_and_serialized():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 300, generator=g) * torch.logspace(-4, 3, 300)
    x[0, :128] = 0.0
    assert torch.equal(_bits(fake_quantize(x, FRM)), _bits(dequantize(quantize(x, FRM))))
    assert QuantSpec.from_dict(FRM.to_dict()) == FRM and FRM.to_dict()["observer"] == "full-range-mse"
    for kw in (dict(format=F.E4M3, granularity=G.CHANNEL),
               dict(format=F.INT4, granularity=G.GROUP, group_size=32, symmetric=False)):
        with pytest.raises(SchemeError, match="full-range-mse"):
            QuantSpec(observer="full-range-mse", **kw)
    with pytest.raises(CalibrationError, match="full-range-mse"):
        CalibrationConfig(observer="full-range-mse")


def test_full_range_mse_in_compressed_tensors_args():
    from lowbit.formats.ct_args import args_to_spec, spec_to_args
    from lowbit.schemes import Scheme

    s = Scheme("x", FRM, None)
    args = spec_to_args(FRM, s, True)
    assert args["observer"] == "full-range-mse"
    assert args_to_spec(args, None, "w", True) == FRM
