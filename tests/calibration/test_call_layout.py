"""Where a layer's call holds its calibration windows, read from the data (lowbit.call_layout), and
Gemma 3n (hidden states [altup 4, batch, T, H]) calibrated with the defaults."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from lowbit.call_layout import Axis, CallLayout
from lowbit.errors import QuantizationError


def _call(n: int):
    """A call of n windows of 8 tokens: Gemma 3n-like stream, ALiBi rows, a shared RoPE table,
    a per-window mask, 1-D cache positions and an argument that cannot be cut."""
    h = torch.arange(4 * n * 8 * 6, dtype=torch.float32).reshape(4, n, 8, 6)
    alibi = torch.arange(n * 3 * 8, dtype=torch.float32).reshape(n * 3, 1, 8)
    return (h,), {"alibi": alibi, "rope": (torch.ones(1, 8, 4), torch.zeros(1, 8, 4)),
                  "mask": torch.zeros(n, 1, 8, 8), "cache_position": torch.arange(8),
                  "odd": torch.zeros(n, n), "use_cache": False}


def test_layout_is_read_by_comparing_one_and_two_windows():
    lay = CallLayout.compare(_call(1), _call(2), 2)
    assert lay.output == Axis(1, 1)  # the altup axis 0 (size 4 as the batch may be) is not the windows'
    assert lay.axes[("kwargs", "alibi")] == Axis(0, 3) and lay.axes[("kwargs", "mask")] == Axis(0, 1)
    assert ("kwargs", "rope", 0) not in lay.axes and ("kwargs", "cache_position") not in lay.axes
    assert lay.uncut == {("kwargs", "odd"): "[1, 1] for one window, [2, 2] for 2"}
    lay.uncut.clear()
    big = _call(4)
    assert lay.windows(big) == 4
    (h,), kw = lay.cut(big, 1, 3)
    assert torch.equal(h, big[0][0][:, 1:3]) and torch.equal(kw["alibi"], big[1]["alibi"][3:9])
    assert kw["rope"][0] is big[1]["rope"][0] and kw["cache_position"] is big[1]["cache_position"]
    assert kw["use_cache"] is False
    assert torch.equal(lay.cut_output(big[0][0], 2, 3), big[0][0][:, 2:3])
    mask = torch.tensor([[True] * 6 + [False] * 2] * 4)
    w = lay.token_mask(mask, torch.ones(4, 4, 8, 1))
    assert w.shape == (1, 4, 8, 1) and int(w.sum()) == 24


def test_an_argument_that_cannot_be_cut_is_named():
    lay = CallLayout.compare(_call(1), _call(2), 2)
    with pytest.raises(QuantizationError, match="call argument odd cannot be cut"):
        lay.cut(_call(4), 0, 1)


def _gemma3n():
    from helpers.families import tiny_model

    return tiny_model("gemma3n_text")


def test_gemma3n_windows_are_cut_along_the_batch_axis_of_its_stream():
    from lowbit.calibration.capture import find_decoder_layers, first_window, run_layer
    from lowbit.calibration.layer_calls import capture_calls
    from lowbit.targets import quantizable_linears

    model = _gemma3n()
    _, layers = find_decoder_layers(model, quantizable_linears(model))
    tokens = torch.randint(3, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    calls = capture_calls(model, layers, tokens, 4)  # 4 windows a batch, 4 AltUp streams: [4, 4, 16, 128]
    lay = calls.layout(0)
    assert tuple(calls.first[0][0][0].shape) == (4, 4, 16, 128) and lay.output == Axis(1, 1)
    assert tuple(first_window(calls.first, None, lay)[0][0].shape) == (4, 1, 16, 128)
    whole = run_layer(layers[0], calls.first)[0]
    parts = [run_layer(layers[0], [lay.cut(calls.first[0], i, i + 1)])[0] for i in range(4)]
    assert torch.allclose(torch.cat(parts, dim=1), whole, atol=1e-5)


def test_gemma3n_quantizes_by_default_with_its_altup_coefficients_in_float(tmp_path):
    import lowbit
    from lowbit.targets import COEFFICIENTS

    model = _gemma3n()
    ids = torch.randint(3, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = lowbit.quantize(copy.deepcopy(model), "nvfp4", calibration=ids, batch_size=2)  # GPTQ + reconstruction
    coefs = [f"model.layers.{i}.altup.{n}" for i in range(2) for n in ("correction_coefs", "prediction_coefs")]
    assert {f"{n}.weight": COEFFICIENTS for n in coefs} == q.lowbit_float_weights
    assert all(type(q.get_submodule(n)) is torch.nn.Linear for n in coefs)
    assert type(q.get_submodule("model.layers.1.altup.modality_router")).__name__ == "QuantLinear"
    assert q.lowbit_calibration.reconstruct["model.layers.1"]["changed"] > 0
    with torch.no_grad():
        got = q(input_ids=ids, use_cache=False).logits
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < 0.3, err
    back = lowbit.load(lowbit.save(q, tmp_path / "q"))
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids, use_cache=False).logits, got)


@pytest.mark.parametrize("model_type, tokens", [("bamba", 32), ("cpmant", 64)])
def test_loops_that_unpack_the_layer_output_are_captured(model_type, tokens):
    """Bamba's loop unpacks ``hidden_states, attn_weights = layer(...)``: a stand-in returning the
    tensor passed a batch of two windows as two rows (layer 1 got [32, 128]) and failed on one
    window, so the one- and two-window probes refused it; a 2-tuple is tried, and a form whose
    hidden states reach a later layer in another shape is rejected. (CPM-Ant prepends 32 prompt
    tokens.)"""
    from helpers.families import tiny_model
    from lowbit.calibration.capture import find_decoder_layers
    from lowbit.calibration.layer_calls import _per_layer, capture_calls
    from lowbit.targets import quantizable_linears

    model = tiny_model(model_type)
    _, layers = find_decoder_layers(model, quantizable_linears(model))
    ids = torch.randint(3, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    calls = capture_calls(model, layers, ids, 2)
    assert [tuple(c[0][0].shape) for c in calls.first] == [(2, tokens, 128)] * 2
    assert calls.layout(0).output == Axis(0, 1)
    for n in (1, 2):
        per_layer = _per_layer(model, layers, ids[:n], n, torch.device("cpu"))
        assert [tuple(c[0][0][0].shape) for c in per_layer] == [(n, tokens, 128)] * len(layers)


def test_bamba_quantizes_with_the_defaults():
    import lowbit
    from helpers.families import tiny_model

    model = tiny_model("bamba")
    ids = torch.randint(3, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = lowbit.quantize(copy.deepcopy(model), "w8a8-int8", calibration=ids, batch_size=2)
        with torch.no_grad():
            got = q(input_ids=ids, use_cache=False).logits
    assert sum(hasattr(m, "weight_codes") for m in q.modules()) == 10
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < 0.05, err  # 0.031 in the sweep
