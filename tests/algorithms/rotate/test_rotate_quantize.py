"""``rotation`` through lowbit.quantize: applied once to the float model, reported, and the rotated
quantized model round-trips through the lowbit and fake formats."""

from __future__ import annotations

import copy

import pytest
import torch

import lowbit
from helpers.models import tiny_llama
from lowbit.calibration import CalibrationConfig, CalibrationError
from lowbit.algorithms.rotate import DEFAULT_ROTATION, Rotation
from lowbit.errors import QuantizationError
from lowbit.report.quantized import quantized_summary

IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
CALIB = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(2))


def _logits(model) -> torch.Tensor:
    lowbit.use_backend(model, "reference")
    with torch.no_grad():
        return model(IDS).logits


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_default_is_none_and_the_option_is_typed():
    assert CalibrationConfig().rotation is Rotation.NONE is DEFAULT_ROTATION
    assert CalibrationConfig(rotation="hadamard").rotation is Rotation.HADAMARD
    with pytest.raises(CalibrationError, match="unknown rotation 'givens'; known: none, hadamard"):
        CalibrationConfig(rotation="givens")


def test_rotation_helps_int8_per_channel_weights_on_outlier_channels():
    # tiny_llama's norms scale channels 3, 17 (x12) and 5 (x8), which set every token's dynamic INT8
    # scale; rotated, they are spread over all 64 channels (measured: max logit error 0.0152 -> 0.0085)
    float_model = tiny_llama()
    ref = _logits(float_model)
    plain = _rel(_logits(lowbit.quantize(copy.deepcopy(float_model), "w8a8-int8-dynamic")), ref)
    rotated = _rel(_logits(lowbit.quantize(copy.deepcopy(float_model), "w8a8-int8-dynamic", rotation="hadamard")), ref)
    assert rotated < 0.7 * plain, (rotated, plain)


@pytest.mark.parametrize("scheme, kw", [
    ("w8a8-int8-dynamic", {}),                                           # no calibration data: RTN
    ("nvfp4", {"calibration": CALIB}),                                   # static scales + GPTQ (the default)
    ("w8a8-int8", {"calibration": CALIB}),                               # with SmoothQuant 0.8 (allowed)
])
def test_quantize_rotates_once_and_reports_it(scheme, kw):
    q = lowbit.quantize(tiny_llama(), scheme, rotation="hadamard", progress=False, **kw)
    assert q.lowbit_rotation.rotation == "hadamard" and q.lowbit_rotation.untied
    assert q.config.tie_word_embeddings is False
    assert all(torch.equal(m.weight, torch.ones_like(m.weight)) for n, m in q.named_modules()
               if n.endswith("layernorm") and scheme != "w8a8-int8")  # SmoothQuant rescales the folded norms
    line = quantized_summary(q)["rotation"]
    assert line.startswith("rotated (hadamard): residual stream R1 64, per-head R2 16, 2 layers") and "untied" in line
    if scheme == "w8a8-int8":
        assert q.lowbit_calibration.smoothquant == 0.8


def test_unrotated_summary_says_none():
    assert quantized_summary(lowbit.quantize(tiny_llama(), "w8a16"))["rotation"] is None


def test_bad_input_is_refused_before_any_weight_changes():
    model = tiny_llama()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(QuantizationError, match="needs calibration data"):
        lowbit.quantize(model, "nvfp4", rotation="hadamard")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(QuantizationError, match="rotation='hadamard' rotates weights"):
        lowbit.quantize(model, None, CALIB, kv_cache="fp8", rotation="hadamard")


@pytest.mark.parametrize("fmt", ["lowbit", "fake"])
def test_rotated_model_round_trips(tmp_path, fmt):
    q = lowbit.quantize(tiny_llama(), "nvfp4", calibration=CALIB, rotation="hadamard", progress=False)
    ref = _logits(q)
    lowbit.save(q, tmp_path / fmt, format=fmt)
    back = lowbit.load(tmp_path / fmt)
    assert back.config.tie_word_embeddings is False
    assert back.lm_head.weight.data_ptr() != back.model.embed_tokens.weight.data_ptr()
    assert torch.equal(_logits(back), ref)  # measured: identical


def test_streamed_runs_refuse_rotation(tmp_path):
    from helpers.eval_fixtures import save_tiny_folder

    src = save_tiny_folder(tmp_path / "m")
    with pytest.raises(QuantizationError, match="rotation='hadamard' .* streamed one layer at a time"):
        lowbit.quantize_checkpoint(src, tmp_path / "out", "nvfp4", calibration=CALIB, rotation="hadamard")
    assert not (tmp_path / "out").exists()
