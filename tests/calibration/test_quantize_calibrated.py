"""lowbit.quantize with calibration on the tiny seeded Llama: every preset within a stated bound
of the float logits, RTN unchanged where calibration has nothing to do, options and errors."""

import copy

import pytest
import torch

import lowbit
from lowbit.errors import QuantizationError
from lowbit.modules import QuantLinear
from lowbit.schemes import PRESETS

# Relative logit error ||q - f|| / ||f|| on the tiny random Llama with outlier channels, with
# calibration (8 x 32 random tokens) and SmoothQuant alpha 0.5. Measured:
# w8a8-int8 0.023, w8a8-int8-dynamic 0.011, w8a8-fp8 0.048, w8a8-fp8-dynamic 0.044, nvfp4 0.161,
# nvfp4a16 0.137, nvfp4-e5m3 0.165, mxfp4 0.259, mxfp8 0.078, w4a16 0.186, w8a16 0.0086;
# (other token ids) w4a16-asym 0.132, w4a8-int8 0.131, w4a8-fp8 0.127, mxfp6-e2m3 0.044,
# mxfp6-e3m2 0.085, mxfp6-mxfp8 0.066, mxfp4-mxfp8 0.208.
# Bounds: ~1.5x those. (Random weights quantize worse than trained ones; this checks that every
# scheme runs end to end and stays close, the SmolLM2 bench measures perplexity.)
BOUNDS = {"w8a8-int8": 0.035, "w8a8-int8-dynamic": 0.017, "w8a8-fp8": 0.072, "w8a8-fp8-dynamic": 0.066,
          "nvfp4": 0.24, "nvfp4a16": 0.2, "nvfp4-e5m3": 0.25, "mxfp4": 0.39, "mxfp8": 0.12, "w4a16": 0.28,
          "w8a16": 0.013, "w4a16-asym": 0.26, "w4a8-int8": 0.26, "w4a8-fp8": 0.26, "mxfp6-e2m3": 0.09,
          "mxfp6-e3m2": 0.17, "mxfp6-mxfp8": 0.13, "mxfp4-mxfp8": 0.39, "fp8-block": 0.14}


def _calib():
    return torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(3))


def _rel(q, ref, ids):
    with torch.no_grad():
        out = q(ids).logits
    return float((out - ref).norm() / ref.norm())


def test_bounds_cover_every_preset():
    assert set(BOUNDS) == set(PRESETS)


@pytest.mark.parametrize("scheme", sorted(PRESETS))
def test_calibrated_logits_close(llama, token_ids, scheme):
    with torch.no_grad():
        ref = llama(token_ids).logits
    q = lowbit.quantize(copy.deepcopy(llama), scheme, _calib(), smoothquant=0.5, num_samples=8, seq_len=32)
    assert sum(isinstance(m, QuantLinear) for m in q.modules()) == 14
    assert 0 < _rel(q, ref, token_ids) < BOUNDS[scheme]


@pytest.mark.parametrize("scheme,options", [("w8a8-int8-dynamic", {}), ("w8a16", {}), ("w4a16-asym", {}),
                                            ("w4a16", {"weight_rounding": "rtn"}),
                                            ("nvfp4a16", {"weight_rounding": "rtn"}), ("mxfp4", {"weight_rounding": "rtn"})])
def test_calibration_without_gptq_or_smoothing_is_rtn_bit_for_bit(llama, scheme, options):
    """Calibration data alone leaves the schemes whose default is RTN (8-bit and asymmetric weights,
    dynamic inputs) equal to plain RTN, and so it does for 4-bit ones with RTN asked for."""
    rtn = lowbit.quantize(copy.deepcopy(llama), scheme)
    cal = lowbit.quantize(copy.deepcopy(llama), scheme, _calib(), **options)
    a, b = rtn.state_dict(), cal.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_static_schemes_get_scales_only_where_needed(llama):
    q = lowbit.quantize(copy.deepcopy(llama), "w8a8-fp8", _calib(), num_samples=8, seq_len=32)
    lin = q.model.layers[1].mlp.down_proj
    assert lin.input_scale is not None and lin.input_global_scale is None
    q = lowbit.quantize(copy.deepcopy(llama), "nvfp4", _calib(), num_samples=8, seq_len=32)
    lin = q.model.layers[1].mlp.down_proj
    assert lin.input_scale is None and lin.input_global_scale is not None


def test_include_lm_head_and_ignore(llama, token_ids):
    q = lowbit.quantize(copy.deepcopy(llama), "w8a8-int8", _calib(), num_samples=8, seq_len=32,
                        include_lm_head=True, ignore=[r"model\.layers\.1\.mlp\..*"])
    assert isinstance(q.lm_head, QuantLinear) and q.lm_head.input_scale is not None
    assert not isinstance(q.model.layers[1].mlp.down_proj, QuantLinear)
    assert isinstance(q.model.layers[1].self_attn.o_proj, QuantLinear)
    assert q(token_ids).logits.shape == (2, 24, 256)


def test_errors(llama):
    with pytest.raises(QuantizationError, match="needs calibration"):
        lowbit.quantize(llama, "w8a8-fp8")
    with pytest.raises(QuantizationError, match="smoothquant needs calibration"):
        lowbit.quantize(llama, "w8a8-int8-dynamic", smoothquant=0.5)
    with pytest.raises(QuantizationError, match="smoothquant must be"):
        lowbit.quantize(llama, "w8a8-int8", _calib(), smoothquant="yes")
    with pytest.raises(QuantizationError, match="smoothquant must be"):
        lowbit.quantize(llama, "w8a8-int8", _calib(), smoothquant=True)
    with pytest.raises(QuantizationError, match="unknown calibration option"):
        lowbit.quantize(llama, "w8a8-int8", _calib(), num_sample=3)
    with pytest.raises(lowbit.calibration.CalibrationError, match="tokenizer"):
        lowbit.quantize(llama, "w8a8-int8", ["some text"])


def test_text_calibration_with_tokenizer(llama, token_ids):
    class ByteTok:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": list(text.encode("utf-8"))}

    q = lowbit.quantize(copy.deepcopy(llama), "w8a8-int8", "builtin", tokenizer=ByteTok(), num_samples=4,
                        seq_len=32, smoothquant=0.5)
    rep = q.lowbit_calibration
    assert rep.num_samples == 4 and rep.seq_len == 32 and rep.sink_positions == 0
    assert torch.isfinite(q(token_ids).logits).all()


def _input_amax(model, ids, name):
    """max |input| of linear ``name`` in a forward of ``model`` on ``ids``."""
    seen = []
    h = model.get_submodule(name).register_forward_pre_hook(lambda _m, a: seen.append(a[0].abs().amax()))
    with torch.no_grad():
        model(ids)
    h.remove()
    return float(torch.stack(seen).amax())


@pytest.mark.parametrize("layer_inputs", ["quantized", "float"])
def test_layer_inputs_float_observes_the_float_model(llama, layer_inputs):
    ids = _calib()
    name = "model.layers.1.self_attn.o_proj"
    want_float = _input_amax(llama, ids, name)
    q = lowbit.quantize(copy.deepcopy(llama), "w8a8-int8", ids, num_samples=8, seq_len=32, batch_size=8,
                        layer_inputs=layer_inputs)
    rep = q.lowbit_calibration
    assert rep.layer_inputs == layer_inputs
    got = rep.groups[name].amax_all
    if layer_inputs == "float":
        # the float model's activations: the same amax as a plain float forward (same batch)
        assert got == pytest.approx(want_float, rel=1e-6)
    else:
        # layer 1 sees layer 0's quantized outputs: a (slightly) different amax
        assert got != pytest.approx(want_float, rel=1e-6) and got == pytest.approx(want_float, rel=0.1)
    assert _rel(q, llama(ids).logits.detach(), ids) < BOUNDS["w8a8-int8"] * 3


def test_layer_inputs_is_checked_and_defaults_by_rounding():
    from lowbit.calibration import CalibrationConfig, CalibrationError

    with pytest.raises(CalibrationError, match="layer_inputs"):
        CalibrationConfig(layer_inputs="fp16")
    assert CalibrationConfig(layer_inputs="float").layer_inputs.value == "float"
    cfg = CalibrationConfig()
    # RTN weights: float inputs (one pass per layer); GPTQ: the sequential quantized inputs
    assert cfg.inputs_for(PRESETS["w8a8-int8"]).value == "float"
    assert cfg.inputs_for(PRESETS["nvfp4"]).value == "quantized"
    assert CalibrationConfig(weight_rounding="rtn").inputs_for(PRESETS["nvfp4"]).value == "float"
    assert CalibrationConfig(layer_inputs="quantized").inputs_for(PRESETS["w8a8-int8"]).value == "quantized"

