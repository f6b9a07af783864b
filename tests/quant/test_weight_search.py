"""The ``mse`` weight observer (lowbit.quant.mse_scales): never worse than the max rule per group,
exact tensors keep their scales, every path stays bit-identical, and the field is scheme data."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from lowbit.errors import QuantizationError, SchemeError
from lowbit.formats import LAYOUTS, Format, get_layout, parse_quantization_config
from lowbit.formats.ct_args import args_to_spec, spec_to_args
from lowbit.numerics import FormatName as F
from lowbit.quant import dequantize, fake_quantize, group_error, quantize
from lowbit.quant.groups import group_view
from lowbit.schemes import Dynamic, Granularity as G, WeightObserver, QuantSpec, Scheme

MAX, MSE = WeightObserver.MAX, WeightObserver.MSE

# every kind of weight scale: fp32 INT (channel, group, ragged group, tensor, asymmetric),
# fp32 FP8, UE4M3 + global (NVFP4), UE5M3, E8M0 (MXFP4, MXFP8)
SPECS = {
    "int4-g128": QuantSpec(F.INT4, G.GROUP, 128),
    "int4-g32-asym": QuantSpec(F.INT4, G.GROUP, 32, symmetric=False),
    "int8-channel": QuantSpec(F.INT8, G.CHANNEL),
    "int3-tensor": QuantSpec(F.INT3, G.TENSOR),
    "e4m3-channel": QuantSpec(F.E4M3, G.CHANNEL),
    "nvfp4": QuantSpec(F.E2M1, G.GROUP, 16, scale_format=F.UE4M3, global_scale=True),
    "nvfp4-e5m3": QuantSpec(F.E2M1, G.GROUP, 16, scale_format=F.UE5M3),
    "mxfp4": QuantSpec(F.E2M1, G.GROUP, 32, scale_format=F.E8M0),
    "mxfp8": QuantSpec(F.E4M3, G.GROUP, 32, scale_format=F.E8M0),
}


def _obs(spec: QuantSpec, observer: WeightObserver) -> QuantSpec:
    return dataclasses.replace(spec, observer=observer)


def _adversarial(n_in: int = 320, seed: int = 0) -> torch.Tensor:
    """Rows of hard cases: all zero, one nonzero, ties on the INT4 / E2M1 grids, a heavy
    outlier, tiny (float32 subnormal) values, huge values, the Q4_1-like grid, random."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.zeros(n_in)]
    one = torch.zeros(n_in)
    one[5], one[200] = -3.25, 0.75
    rows.append(one)
    rows.append((torch.randint(-16, 16, (n_in,), generator=g) + 0.5) / 7)  # halfway between INT4 steps of 1/7
    rows.append(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -6.0] * (n_in // 8)))  # E2M1 ties, scale 1
    out = torch.randn(n_in, generator=g)
    out[::37] *= 25.0
    rows.append(out)
    rows.append(torch.randn(n_in, generator=g) * 1e-39)  # float32 subnormals
    rows.append(torch.randn(n_in, generator=g) * 1e30)
    rows.append(torch.randint(0, 16, (n_in,), generator=g) * 0.013 - 0.09)  # a Q4_1-like grid
    half_zero = torch.randn(n_in, generator=g)
    half_zero[:160] = 0.0
    rows.append(half_zero)
    rows.append(torch.randn(n_in, generator=g) * torch.rand(n_in, generator=g) ** 4)
    return torch.stack(rows)


def _inputs():
    g = torch.Generator().manual_seed(1)
    return [_adversarial(), torch.randn(24, 320, generator=g), torch.randn(3, 7, 96, generator=g) ** 3]


def _ragged_ok(spec: QuantSpec, x: torch.Tensor) -> torch.Tensor:
    """Microscaled specs need whole blocks: trim the last dim to a multiple of the block."""
    if spec.is_microscaled:
        return x[..., : x.shape[-1] // spec.group_size * spec.group_size]
    return x


def _errors(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    qt = quantize(x, spec)
    return group_error(group_view(x, spec), spec, qt.scale, qt.zero_point, qt.global_scale)


# ---------------------------------------------------------------------------- the search
@pytest.mark.parametrize("key", list(SPECS))
def test_search_never_increases_a_groups_error(key):
    spec = SPECS[key]
    improved = 0
    for x in _inputs():
        x = _ragged_ok(spec, x)
        e_max, e_mse = _errors(x, _obs(spec, MAX)), _errors(x, _obs(spec, MSE))
        assert e_max.shape == e_mse.shape
        assert bool((e_mse <= e_max).all()), key
        improved += int((e_mse < e_max).sum())
        # the same holds for the errors of the dequantized tensors themselves
        d_max = (dequantize(quantize(x, _obs(spec, MAX))) - x).double().pow(2).sum()
        d_mse = (dequantize(quantize(x, _obs(spec, MSE))) - x).double().pow(2).sum()
        assert float(d_mse) <= float(d_max) * (1 + 1e-12)
    assert improved > 0, f"{key}: the search never found a better scale"


@pytest.mark.parametrize("key", ["e4m3-channel", "nvfp4", "nvfp4-e5m3", "mxfp4", "mxfp8"])
def test_group_error_equals_the_reference_qdq_error(key):
    """Minifloat errors are computed with the in-place nearest rounding: bit for bit the
    squared error of the reference ``fmt.qdq`` (ties, saturation, subnormals, zero groups)."""
    from lowbit.numerics import get_format
    from lowbit.quant.scale_rules import effective_scale

    spec, fmt = SPECS[key], get_format(SPECS[key].format)
    for x in _inputs():
        x = _ragged_ok(spec, x)
        qt = quantize(x, spec)
        v = group_view(x, spec)
        eff = effective_scale(qt.scale, spec, qt.global_scale)
        div = torch.where(eff != 0, eff, torch.ones_like(eff)).unsqueeze(-1)
        ref = ((fmt.qdq(v / div) * eff.unsqueeze(-1) - v) ** 2).sum(-1, dtype=torch.float64)
        got = group_error(v, spec, qt.scale, qt.zero_point, qt.global_scale)
        assert torch.equal(got.reshape(ref.shape), ref), key


def test_ragged_last_group_is_searched_on_its_own_elements():
    spec = _obs(SPECS["int4-g128"], MSE)
    x = _adversarial()[:, :200]  # 128 + 72
    qt = quantize(x, spec)
    assert qt.scale.shape == (x.shape[0], 2)
    # the last group alone (padded to 128 with zeros) gets the same scale as quantized by itself
    tail = quantize(x[:, 128:], dataclasses.replace(spec, group_size=72))
    assert torch.equal(qt.scale[:, 1], tail.scale[:, 0])
    assert torch.equal(qt.codes[:, 128:], tail.codes)


@pytest.mark.parametrize("key", list(SPECS))
def test_exact_tensor_keeps_its_max_rule_scale(key):
    spec = SPECS[key]
    kept = 0
    for x in _inputs():
        x = fake_quantize(_ragged_ok(spec, x), spec)  # on the max rule's grid
        q_max, q_mse = quantize(x, _obs(spec, MAX)), quantize(x, _obs(spec, MSE))
        exact = _errors(x, _obs(spec, MAX)) == 0
        assert torch.equal(q_mse.scale[exact], q_max.scale[exact]), key
        kept += int(exact.sum())
    assert kept > 0


def test_int_grid_is_rtn_exactly():
    """Codes * scale with the extreme code +-7 in every group: the max rule is exact, so the
    search returns the max rule's scales and codes bit for bit."""
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(-7, 8, (16, 256), generator=g).float()
    codes[:, ::128] = 7.0
    scale = torch.rand(16, 2, generator=g) + 0.1
    x = (codes.reshape(16, 2, 128) * scale.unsqueeze(-1)).reshape(16, 256)
    q_max, q_mse = quantize(x, SPECS["int4-g128"]), quantize(x, _obs(SPECS["int4-g128"], MSE))
    assert torch.equal(q_mse.codes, q_max.codes) and torch.equal(q_mse.scale, q_max.scale)
    assert torch.equal(dequantize(q_mse), dequantize(q_max))


def test_int_scale_is_the_best_of_the_documented_grid():
    """A group whose values sit between the max rule's steps: the clipped scale 0.94 / 7 wins
    (error 0.01656 against 0.02393), the best of amax * r / 7 over RATIOS."""
    from lowbit.quant.mse_scales import RATIOS

    x = torch.tensor([[1.0, 0.21, -0.36, 0.5, 0.64, -0.07, 0.29, 0.43]])
    spec = QuantSpec(F.INT4, G.CHANNEL, observer=MSE)
    qt = quantize(x, spec)
    assert float(qt.scale) == float(torch.tensor(0.94) / 7)
    e_max = float(((fake_quantize(x, _obs(spec, MAX)) - x) ** 2).sum())
    e_mse = float(((fake_quantize(x, spec) - x) ** 2).sum())
    assert e_max == pytest.approx(0.023935, abs=1e-6) and e_mse == pytest.approx(0.016563, abs=1e-6)
    errs = []
    for r in RATIOS:
        sc = torch.tensor([r], dtype=torch.float32) / 7
        errs.append(float(((torch.clamp(torch.round(x / sc), -8, 7) * sc - x) ** 2).sum()))
    assert e_mse == pytest.approx(min(errs), rel=1e-6) and errs.index(min(errs)) == RATIOS.index(0.94)


def test_e8m0_one_binade_up_wins_for_a_saturating_block():
    """MXFP4: a block whose max 7.9 saturates at 6 under the floor rule (scale 1) is better
    with scale 2 (7.9 -> 4 * 2 = 8)."""
    x = torch.zeros(1, 32)
    x[0, 0] = 7.9
    assert float(quantize(x, SPECS["mxfp4"]).scale) == 1.0
    qt = quantize(x, _obs(SPECS["mxfp4"], MSE))
    assert float(qt.scale) == 2.0
    assert float(dequantize(qt)[0, 0]) == 8.0


@pytest.mark.parametrize("key", ["nvfp4", "nvfp4-e5m3", "mxfp4", "mxfp8", "int4-g128", "e4m3-channel"])
def test_candidates_are_the_documented_neighbours(key):
    """Block scales move only by the documented code steps (UE4M3/UE5M3: -3..+1; E8M0: 0, +1),
    fp32 scales only by the documented ratios; every non-zero step is used somewhere."""
    from lowbit.numerics import E8M0, get_format
    from lowbit.quant.mse_scales import CODE_STEPS, E8M0_STEPS, RATIOS

    spec = SPECS[key]
    g = torch.Generator().manual_seed(4)
    x = torch.randn(256, 256, generator=g) * torch.rand(256, 1, generator=g) * 3
    x = x * (1 + 4 * (torch.rand(256, 256, generator=g) > 0.98))  # some outliers
    s_max, s_mse = quantize(x, spec).scale, quantize(x, _obs(spec, MSE)).scale
    if spec.scale_format is F.FP32:
        ratio = torch.round(s_mse / s_max * 100) / 100
        used = {round(float(r), 2) for r in ratio.unique()}
        assert used <= set(RATIOS) and len(used) >= 3, used
        return
    fmt = E8M0 if spec.scale_format is F.E8M0 else get_format(spec.scale_format)
    steps = fmt.encode(s_mse).to(torch.int32) - fmt.encode(s_max).to(torch.int32)
    allowed = set(E8M0_STEPS if spec.scale_format is F.E8M0 else CODE_STEPS)
    used = {int(k) for k in steps.unique()}
    assert used <= allowed and used == allowed, used


def test_all_zero_tensor_and_nan():
    for key, spec in SPECS.items():
        z = torch.zeros(4, 64)
        q_max, q_mse = quantize(z, spec), quantize(z, _obs(spec, MSE))
        assert torch.equal(q_mse.codes, q_max.codes) and torch.equal(q_mse.scale, q_max.scale), key
        assert torch.equal(dequantize(q_mse), z)
        bad = torch.randn(4, 64)
        bad[1, 3] = float("nan")
        with pytest.raises(QuantizationError, match="'w'"):
            quantize(bad, _obs(spec, MSE), name="w")


def test_nvfp4_global_scale_stays_amax_based():
    x = _adversarial()[:, :320]
    spec = SPECS["nvfp4"]
    assert torch.equal(quantize(x, _obs(spec, MSE)).global_scale, quantize(x, spec).global_scale)


# ---------------------------------------------------------------------------- bit identity
@pytest.mark.parametrize("key", list(SPECS))
def test_quantize_fake_quantize_dequantize_bit_identical(key):
    spec = _obs(SPECS[key], MSE)
    for x in _inputs():
        x = _ragged_ok(spec, x)
        qt = quantize(x, spec)
        fq = fake_quantize(x, spec)
        assert torch.equal(fq.view(torch.int32), dequantize(qt).view(torch.int32)), key
        # given the searched scales back, quantize reproduces the same codes
        again = quantize(x, spec, scale=qt.scale, global_scale=qt.global_scale) if qt.zero_point is None else None
        if again is not None:
            assert torch.equal(again.codes, qt.codes)


def test_row_bands_give_the_same_scales():
    """The model-free path quantizes row bands: the search must not depend on them."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(96, 384, generator=g) * torch.rand(96, 1, generator=g)
    for key, spec in SPECS.items():
        if spec.granularity is G.TENSOR:
            continue
        spec = _obs(spec, MSE)
        x_ = _ragged_ok(spec, x)
        gs = quantize(x_, spec).global_scale
        whole = quantize(x_, spec, global_scale=gs)
        bands = [quantize(x_[r:r + 7], spec, global_scale=gs) for r in range(0, 96, 7)]
        assert torch.equal(torch.cat([b.codes for b in bands]), whole.codes), key
        assert torch.equal(torch.cat([b.scale for b in bands]), whole.scale), key


# ---------------------------------------------------------------------------- scheme data
def test_observer_field_serialized_and_strict():
    spec = QuantSpec(F.INT4, G.GROUP, 128, observer="mse")
    assert spec.observer is MSE and QuantSpec(F.INT4, G.GROUP, 128).observer is MAX
    d = spec.to_dict()
    assert d["observer"] == "mse"
    assert QuantSpec.from_dict(json.loads(json.dumps(d))) == spec
    assert QuantSpec.from_dict({**d, "observer": "max"}) == _obs(spec, MAX)
    for bad in ("minmax", "MSE", "percentile", None, 1):
        with pytest.raises(SchemeError, match="observer"):
            QuantSpec.from_dict({**d, "observer": bad})
    del d["observer"]
    with pytest.raises(SchemeError, match="observer"):
        QuantSpec.from_dict(d)
    assert spec.describe() == "int4, group 128, mse observer"


def test_observer_validation():
    with pytest.raises(SchemeError, match="static"):
        QuantSpec(F.INT8, G.TOKEN, dynamic=Dynamic.DYNAMIC, observer=MSE)
    with pytest.raises(SchemeError, match="static"):
        QuantSpec(F.E2M1, G.GROUP, 16, dynamic=Dynamic.LOCAL, scale_format=F.UE4M3, global_scale=True,
                  observer=MSE)
    with pytest.raises(SchemeError, match="calibration observer"):
        QuantSpec(F.INT8, G.CHANNEL, observer="percentile")
    with pytest.raises(SchemeError, match="CalibrationConfig.observer"):
        Scheme("x", QuantSpec(F.INT8, G.CHANNEL), QuantSpec(F.INT8, G.TENSOR, observer=MSE))
    Scheme("x", QuantSpec(F.INT8, G.CHANNEL, observer=MSE), QuantSpec(F.INT8, G.TENSOR))


def test_weight_and_activation_observers_are_two_types():
    from lowbit.calibration import ActivationObserver, CalibrationConfig, CalibrationError

    assert CalibrationConfig(observer="mse").observer is ActivationObserver.MSE
    assert CalibrationConfig().observer is ActivationObserver.MAX
    for rule in ("full-range", "half-step"):  # weight rules are no activation observer
        with pytest.raises(CalibrationError, match="unknown observer .* known: max, percentile, mse"):
            CalibrationConfig(observer=rule)
    assert {o.value for o in WeightObserver} == {"max", "mse", "full-range", "full-range-mse", "half-step"}
    # the searching observers and the rule each searches around (scaling, mse_scales.searching)
    assert {o.value: o.rule.value for o in WeightObserver if o.searches} == {"mse": "max", "full-range-mse": "full-range"}


@pytest.mark.parametrize("observer", [MAX, MSE])
def test_ct_args_map_the_weight_observer(observer):
    s = Scheme("x", _obs(SPECS["nvfp4"], observer), QuantSpec(F.E2M1, G.GROUP, 16, dynamic=Dynamic.LOCAL,
                                                             scale_format=F.UE4M3, global_scale=True))
    args = spec_to_args(s.weights, s, True)
    assert args["observer"] == {MAX: "minmax", MSE: "mse"}[observer]
    assert args_to_spec(args, None, "w", True) == s.weights
    acts = spec_to_args(s.input_activations, s, False)
    assert args_to_spec({**acts, "observer": "mse"}, None, "a", False).observer is MAX
    for name, want in (("static_minmax", MAX), ("memoryless_minmax", MAX), ("memoryless_mse", MSE), (None, MAX)):
        assert args_to_spec({**args, "observer": name}, None, "w", True).observer is want


@pytest.mark.parametrize("fmt", [layout.format for layout in LAYOUTS])
@pytest.mark.parametrize("key", ["int4-g128", "nvfp4", "mxfp4", "int8-channel"])
def test_layout_round_trip_of_an_mse_scheme(fmt, key):
    s = Scheme("custom-mse", _obs(SPECS[key], MSE), None)
    layout = get_layout(fmt)
    layout.check_scheme(s)
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 256, generator=g)
    w[3, 5] = 9.0
    qw = quantize(w, s.weights, name="w")
    assert not torch.equal(qw.scale, quantize(w, SPECS[key]).scale)  # the search changed something
    t = layout.linear_tensors("m.l", qw, s, bias=None, input_scale=None, input_global_scale=None,
                              dtype=torch.float32)
    qcfg = json.loads(json.dumps(layout.quantization_config(s, ignore=[], static_scales={})))
    fmt2, parsed = parse_quantization_config({"quantization_config": qcfg})
    scheme = parsed.scheme_for("m.l")
    assert fmt2 is fmt and scheme.weights == s.weights and scheme.weights.observer is MSE
    r = layout.read_linear("m.l", t, scheme, torch.float32, config=parsed)
    if fmt is Format.FAKE:
        assert torch.equal(r.weight, dequantize(qw, torch.float32))
    else:
        assert r.qweight.equal(qw)



# ---------------------------------------------------------------------------- model-free
@pytest.mark.parametrize("key", ["int4-g128", "nvfp4-e5m3", "mxfp4"])
def test_model_free_equals_in_memory_with_mse(tmp_path, key):
    import copy

    import lowbit
    from helpers.models import tiny_llama
    from helpers.folders import assert_same_tensors, folder_tensors

    model = tiny_llama()
    src = tmp_path / "src"
    model.save_pretrained(src, max_shard_size="100KB")
    scheme = Scheme(f"custom-{key}-mse", _obs(SPECS[key], MSE), None)
    out = lowbit.quantize_checkpoint(src, tmp_path / "mf", scheme=scheme, workers=0, progress=False)
    q = lowbit.quantize(copy.deepcopy(model), scheme)
    lowbit.save(q, tmp_path / "ref")
    assert_same_tensors(folder_tensors(out), folder_tensors(tmp_path / "ref"))
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["config_groups"]["group_0"]["scheme"]["weights"]["observer"] == "mse"
    # and the search did change the weights compared with the max rule
    q_max = lowbit.quantize(copy.deepcopy(model), Scheme("m", SPECS[key], None))
    name = "model.layers.0.mlp.down_proj"
    assert not torch.equal(q.get_submodule(name).weight_qtensor().scale,
                           q_max.get_submodule(name).weight_qtensor().scale)
