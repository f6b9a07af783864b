"""Block-output reconstruction re-rounds weights so that a quantized layer's output moves toward
the float layer's, keeping every scale; the result stays exact in the three file formats."""

from __future__ import annotations

import copy

import pytest
import torch

import lowbit
from helpers.folders import assert_same_tensors
from helpers.models import tiny_llama

TOKENS = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(0))


def _layer_mse(model, ref, tokens) -> float:
    """Mean squared error of the last hidden state against the float model's."""
    with torch.no_grad():
        a = model(input_ids=tokens, output_hidden_states=True).hidden_states[-1]
        b = ref(input_ids=tokens, output_hidden_states=True).hidden_states[-1]
    return float(((a - b) ** 2).mean())


@pytest.mark.parametrize("scheme,kw", [
    ("nvfp4", {}),                                   # W4A4: activations quantized in the loop, after GPTQ
    ("w4a16", {"weight_rounding": "gptq"}),          # weight-only INT4, after GPTQ
    ("mxfp4", {"weight_rounding": "rtn"}),           # from RTN codes
    ("w8a8-int8", {}),                               # static INT8 with SmoothQuant
])
def test_reconstruction_lowers_each_layers_output_error(scheme, kw):
    ref = tiny_llama(hidden_size=128, intermediate_size=256)
    base = lowbit.quantize(copy.deepcopy(ref), scheme, calibration=TOKENS, **kw)
    rec = lowbit.quantize(copy.deepcopy(ref), scheme, calibration=TOKENS, reconstruct_iters=30, **kw)
    report = rec.lowbit_calibration.reconstruct
    assert sorted(report) == ["model.layers.0", "model.layers.1"]
    for name, r in report.items():
        assert r["mse_end"] <= r["mse_start"], (name, r)
        assert r["changed"] > 0
    assert any(r["mse_end"] < 0.9 * r["mse_start"] for r in report.values()), report
    # the whole model's output moves toward float too (on the calibration tokens)
    assert _layer_mse(rec, ref, TOKENS) < _layer_mse(base, ref, TOKENS)
    # only codes changed: every weight scale is the one the quantizer chose (input scales of later
    # layers follow their inputs, which the re-rounded layers before them changed)
    for (n, a), (_, b) in zip(base.named_buffers(), rec.named_buffers()):
        if n.endswith(("weight_scale", "weight_global_scale")):
            assert torch.equal(a, b), n


@pytest.mark.parametrize("fmt", ["lowbit", "compressed-tensors", "fake"])
def test_reconstructed_codes_round_trip_exactly(tmp_path, fmt):
    ref = tiny_llama(hidden_size=128, intermediate_size=256)
    q = lowbit.quantize(copy.deepcopy(ref), "nvfp4", calibration=TOKENS, reconstruct_iters=20)
    lowbit.save(q, tmp_path / "q", format=fmt)
    back = lowbit.load(tmp_path / "q")
    with torch.no_grad():
        a = q(input_ids=TOKENS[:2]).logits
        b = back(input_ids=TOKENS[:2]).logits
    assert torch.equal(a, b)
    if fmt != "fake":
        qa = {n: m.weight_codes for n, m in q.named_modules() if hasattr(m, "weight_codes")}
        qb = {n: m.weight_codes for n, m in back.named_modules() if hasattr(m, "weight_codes")}
        assert_same_tensors(qa, qb)


def test_reconstruction_is_deterministic_and_refuses_zero_points():
    from lowbit.errors import LowbitError

    ref = tiny_llama(hidden_size=128, intermediate_size=256)
    a = lowbit.quantize(copy.deepcopy(ref), "nvfp4", calibration=TOKENS, reconstruct_iters=10)
    b = lowbit.quantize(copy.deepcopy(ref), "nvfp4", calibration=TOKENS, reconstruct_iters=10)
    for (n, x), (_, y) in zip(a.named_buffers(), b.named_buffers()):
        assert torch.equal(x, y), n
    with pytest.raises(LowbitError, match="symmetric"):
        lowbit.quantize(copy.deepcopy(ref), "w4a16-asym", calibration=TOKENS, reconstruct_iters=5)
