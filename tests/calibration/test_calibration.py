"""Calibration data, observers, attention-sink exclusion and layer-by-layer capture."""

import copy
from pathlib import Path

import pytest
import torch

import lowbit
from lowbit.calibration import (
    BUILTIN, CalibrationConfig, CalibrationError, MaxObserver, MSEObserver, PercentileObserver,
    builtin_text_path, calibration_tokens, input_scales_from_amax, qdq_activation,
)
from lowbit.calibration.observers import make_observer
from lowbit.quant import static_scale_from_amax
from lowbit.schemes import get_scheme

SHARED_TEXT = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "text"


class CharTokenizer:
    """A stand-in tokenizer: one id per byte."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": list(text.encode("utf-8"))}


# ---------------------------------------------------------------------------- data
def test_tokens_passthrough_and_truncation():
    ids = torch.arange(60).reshape(6, 10)
    assert torch.equal(calibration_tokens(ids, num_samples=8, seq_len=99), ids)
    assert torch.equal(calibration_tokens(ids, num_samples=4), ids[:4])
    assert calibration_tokens(torch.arange(7), num_samples=4).shape == (1, 7)
    with pytest.raises(CalibrationError, match="integer"):
        calibration_tokens(torch.randn(2, 3))


def test_tokens_from_strings_and_file(tmp_path):
    tok = CharTokenizer()
    t = calibration_tokens(["abcdefgh", "", "ijklmnop"], tok, num_samples=10, seq_len=4)
    assert t.shape == (4, 4)  # "abcdefgh\nijklmnop" = 17 bytes -> 4 windows
    assert bytes(t.reshape(-1).tolist()) == b"abcdefgh\nijklmno"
    f = tmp_path / "c.txt"
    f.write_text("abcdefgh\n\nijklmnop\n", encoding="utf-8")
    assert torch.equal(calibration_tokens(f, tok, num_samples=10, seq_len=4), t)
    assert torch.equal(calibration_tokens(str(f), tok, num_samples=10, seq_len=4), t)
    # more windows than asked: evenly spaced, first and last kept
    t2 = calibration_tokens(f, tok, num_samples=2, seq_len=4)
    assert torch.equal(t2, t[[0, 3]])


def test_tokens_errors(tmp_path):
    with pytest.raises(CalibrationError, match="tokenizer"):
        calibration_tokens(["some text"])
    with pytest.raises(CalibrationError, match="fewer than one window") as e:
        calibration_tokens(["abc"], CharTokenizer(), seq_len=10)
    assert "of seq_len=10" in str(e.value) and "of --calib-seq-len 10:" in e.value.cli_message()  # each spelling
    with pytest.raises(CalibrationError, match="does not exist"):
        calibration_tokens(tmp_path / "missing.txt", CharTokenizer())
    with pytest.raises(CalibrationError, match="list of strings"):
        calibration_tokens(3.0)
    with pytest.raises(CalibrationError, match="observer"):
        CalibrationConfig(observer="minmax")


def test_builtin_text_is_emma_not_persuasion():
    paras = builtin_text_path().read_text(encoding="utf-8").splitlines()
    assert len(paras) > 500 and sum(map(len, paras)) > 150_000
    t = calibration_tokens(BUILTIN, CharTokenizer(), num_samples=3, seq_len=64)
    assert t.shape == (3, 64)
    if not (SHARED_TEXT / "persuasion.txt").is_file():
        pytest.skip("shared text not available")
    emma = set((SHARED_TEXT / "emma.txt").read_text(encoding="utf-8").splitlines())
    persuasion = set((SHARED_TEXT / "persuasion.txt").read_text(encoding="utf-8").splitlines())
    long_paras = [p for p in paras if len(p) > 80]
    assert all(p in emma for p in long_paras)
    assert not any(p in persuasion for p in long_paras)


# ---------------------------------------------------------------------------- observers
def test_max_observer_per_tensor_channel_and_rescale():
    o_t, o_c = MaxObserver(), MaxObserver(per_channel=True)
    a = torch.tensor([[1.0, -5.0, 2.0], [0.5, 1.0, -3.0]])
    b = torch.tensor([[[-4.0, 0.0, 1.0]]])
    for o in (o_t, o_c):
        o.observe(a)
        o.observe(b)
    assert torch.equal(o_c.amax(), torch.tensor([4.0, 5.0, 3.0]))
    assert torch.equal(o_t.amax(), torch.tensor([5.0]))
    s = torch.tensor([2.0, 10.0, 1.0])
    o_t.rescale(s)
    assert torch.equal(o_t.amax(), torch.tensor([3.0]))  # max(4/2, 5/10, 3/1)


def test_percentile_observer():
    x = torch.arange(1, 10001, dtype=torch.float32).reshape(-1, 1)  # |x| = 1..10000
    o = PercentileObserver(99.0)
    o.observe(x)
    assert o.amax().item() == 9900.0
    oc = PercentileObserver(50.0, per_channel=True)
    oc.observe(torch.cat([x, 2 * x], 1))
    assert torch.equal(oc.amax(), torch.tensor([5000.0, 10000.0]))
    o100 = PercentileObserver(100.0)
    o100.observe(x)
    assert o100.amax().item() == 10000.0


@pytest.mark.parametrize("per_channel", [False, True])
def test_mse_observer_clips_heavy_tails(per_channel):
    spec = get_scheme("w8a8-int8").input_activations
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40000, 8, generator=g)
    x[0, 0] = 40.0  # one outlier element: clipping it costs less than a 10x coarser grid
    o = MSEObserver(spec, per_channel=per_channel, max_rows=40000)
    o.observe(x)
    clip = o.amax()
    full = x.abs().amax(0) if per_channel else x.abs().amax().reshape(1)
    assert bool((clip[:1] < 0.9 * full[:1]).all())
    assert bool((clip <= full).all())
    assert bool((clip >= 0.5 * full - 1e-6).all())

    def err(c):
        a = c.amax().reshape(1)
        return float((qdq_activation(x, spec, a) - x).pow(2).sum())

    if not per_channel:
        assert err(clip) < err(full)
    # uniform data keeps (almost) the full range
    u = MSEObserver(spec)
    u.observe(torch.linspace(-1, 1, 4001).reshape(-1, 1))
    assert u.amax().item() >= 0.95


def test_make_observer_kinds():
    spec = get_scheme("w8a8-fp8").input_activations
    assert isinstance(make_observer("max", spec), MaxObserver)
    assert isinstance(make_observer("percentile", spec), PercentileObserver)
    assert isinstance(make_observer("mse", spec), MSEObserver)
    x = torch.randn(100, 4)
    for kind in ("max", "percentile", "mse"):
        o = make_observer(kind, spec)
        o.observe(x)
        assert 0 < o.amax().item() <= x.abs().max().item()


def test_input_scales_from_amax():
    a = torch.tensor([254.0])
    int8 = input_scales_from_amax(get_scheme("w8a8-int8").input_activations, a)
    assert set(int8) == {"input_scale"} and int8["input_scale"].item() == 2.0
    fp8 = input_scales_from_amax(get_scheme("w8a8-fp8").input_activations, torch.tensor([448.0]))
    assert fp8["input_scale"].item() == 1.0
    nv = input_scales_from_amax(get_scheme("nvfp4").input_activations, torch.tensor([6.0]))
    assert set(nv) == {"input_global_scale"} and nv["input_global_scale"].item() == 448.0
    assert input_scales_from_amax(get_scheme("w8a8-int8-dynamic").input_activations, a) == {}


# ---------------------------------------------------------------------------- sinks, layer by layer
def _with_sink(model, factor=50.0):
    """Make position 0 of layer 0's MLP input an attention-sink-like outlier."""
    def hook(_m, _args, out):
        out = out.clone()
        out[:, 0, :] *= factor
        return out
    model.model.layers[0].post_attention_layernorm.register_forward_hook(hook)
    return model


def _calib():
    return torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(7))


def test_sink_positions_keep_position_zero_out_of_static_scales(llama):
    ids = _calib()
    q1 = lowbit.quantize(_with_sink(copy.deepcopy(llama)), "w8a8-int8", ids, num_samples=4, seq_len=32,
                         sink_positions=1)
    q0 = lowbit.quantize(_with_sink(copy.deepcopy(llama)), "w8a8-int8", ids, num_samples=4, seq_len=32,
                         sink_positions=0)
    key = "model.layers.0.mlp.gate_proj"
    r1, r0 = q1.lowbit_calibration.groups[key], q0.lowbit_calibration.groups[key]
    assert r1.amax_all == pytest.approx(r0.amax_all)
    assert r0.amax_used == r0.amax_all              # position 0 sets the scale
    assert r1.amax_used < r1.amax_all / 10          # ...or is left out of it
    gate = q1.model.layers[0].mlp.gate_proj
    spec = gate.scheme.input_activations
    assert torch.equal(gate.input_scale, static_scale_from_amax(torch.tensor([r1.amax_used]), spec))
    # layers without a sink are unaffected by the choice
    k = "model.layers.0.self_attn.q_proj"
    assert q1.lowbit_calibration.groups[k].amax_used == pytest.approx(q0.lowbit_calibration.groups[k].amax_used)


def test_layer_by_layer_feeds_quantized_outputs(llama):
    """Layer 1's static scales come from layer 0's *quantized* outputs: re-observing the finished
    quantized model gives back exactly the amax the calibration used."""
    ids = _calib()
    q = lowbit.quantize(copy.deepcopy(llama), "w8a8-int8", ids, num_samples=4, seq_len=32, batch_size=2,
                        sink_positions=0, layer_inputs="quantized")  # RTN's default is "float"
    rep = q.lowbit_calibration.groups["model.layers.1.self_attn.q_proj"]
    seen = []
    h = q.model.layers[1].self_attn.q_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].abs().amax()))
    with torch.no_grad():
        for i in range(0, 4, 2):
            q(ids[i:i + 2])
    h.remove()
    assert max(float(s) for s in seen) == pytest.approx(rep.amax_used, rel=1e-6)
    f = copy.deepcopy(llama)
    seen.clear()
    f.model.layers[1].self_attn.q_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0].abs().amax()))
    with torch.no_grad():
        f(ids)
    assert max(float(s) for s in seen) != pytest.approx(rep.amax_used, rel=1e-6)


def test_shared_static_scales_for_fused_siblings(llama):
    ids = _calib()
    for scheme, attr in [("w8a8-int8", "input_scale"), ("w8a8-fp8", "input_scale"),
                         ("nvfp4", "input_global_scale")]:
        q = lowbit.quantize(copy.deepcopy(llama), scheme, ids, num_samples=4, seq_len=32)
        for layer in q.model.layers:
            a, m = layer.self_attn, layer.mlp
            qs = getattr(a.q_proj, attr)
            assert qs is not None
            assert torch.equal(qs, getattr(a.k_proj, attr)) and torch.equal(qs, getattr(a.v_proj, attr))
            assert torch.equal(getattr(m.gate_proj, attr), getattr(m.up_proj, attr))
            assert getattr(a.o_proj, attr) is not None and getattr(m.down_proj, attr) is not None
        if scheme == "nvfp4":
            g = q.lowbit_calibration.groups["model.layers.0.self_attn.q_proj"]
            assert q.model.layers[0].self_attn.q_proj.input_global_scale.item() == pytest.approx(448 * 6 / g.amax_used)


def test_observer_choice_changes_scales(llama):
    ids = _calib()
    out = {}
    for obs in ("max", "percentile", "mse"):
        q = lowbit.quantize(copy.deepcopy(llama), "w8a8-int8", ids, num_samples=4, seq_len=32, observer=obs,
                            percentile=99.0)
        out[obs] = q.model.layers[0].mlp.down_proj.input_scale.item()
    assert out["percentile"] < out["max"] and out["mse"] <= out["max"]


def test_observe_layer_sees_what_a_full_run_sees_and_stops_after_the_last(llama):
    """observe_layer hands every observed linear the inputs a full run of the layer gives it,
    once per batch, and skips what follows the last one (here: down_proj's own product)."""
    from lowbit.calibration.capture import capture_layer_inputs, observe_layer, observing, run_layer

    layer = llama.model.layers[0]
    inputs = capture_layer_inputs(llama, layer, _calib(), 2)
    names = ["self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"]
    mods = {n: layer.get_submodule(n) for n in names}
    full, early = [], []
    with observing(mods, lambda n, x: full.append((n, x.clone()))):
        run_layer(layer, inputs)
    ran = []
    h = layer.mlp.down_proj.register_forward_hook(lambda m, a, o: ran.append(1))  # after the product
    observe_layer(layer, inputs, mods, lambda n, x: early.append((n, x.clone())))
    h.remove()
    assert [n for n, _ in early] == [n for n, _ in full] == names * 2
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(early, full))
    assert ran == []
    only_q = []
    observe_layer(layer, inputs, {"q": mods["self_attn.q_proj"]}, lambda n, x: only_q.append(x))
    assert len(only_q) == 2 and torch.equal(only_q[1], full[4][1])
