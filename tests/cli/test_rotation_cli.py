"""``--rotation``: the same option and default in ``lowbit quantize``, ``lowbit compare`` and the
Python API; the whole model is loaded for it; model-free runs refuse it."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import lowbit
from helpers.cli import assert_one_error, run
from helpers.eval_fixtures import byte_tokenizer, save_tiny_folder
from lowbit.checkpoint import load
from lowbit.report.compare import CompareOptions, quantize_with_options

TEXT = "\n".join(f"the {w} was long and the day ended with a quiet {w} by the window of the house."
                 for w in ("garden", "letter", "carriage", "evening", "sister", "window", "morning", "street"))


def _same(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("scheme", ["w8a8-int8-dynamic", "w8a8-int8"])
def test_cli_rotates_as_the_python_api_does(capsys, tmp_path, scheme):
    src = save_tiny_folder(tmp_path / "m")
    (tmp_path / "calib.txt").write_text(TEXT)
    calib = ["--calib", tmp_path / "calib.txt", "--calib-samples", 4, "--calib-seq-len", 32] \
        if scheme == "w8a8-int8" else []
    code, out, err = run(capsys, "quantize", src, "--scheme", scheme, "--rotation", "hadamard", *calib,
                         "-o", tmp_path / "cli")
    assert code == 0, err[-2000:]
    line = "rotated (hadamard): residual stream R1 64, per-head R2 16, 2 layers; lm_head untied"
    assert line in " ".join(out.split())
    assert "streamed" not in out  # a rotation loads the whole model
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["tie_word_embeddings"] is False
    model, tok = lowbit.models.load_model(src)
    kw = dict(calibration=str(tmp_path / "calib.txt"), tokenizer=tok, num_samples=4, seq_len=32) if calib else {}
    api = lowbit.quantize(model, scheme, rotation="hadamard", **kw)
    assert _same(load(tmp_path / "cli", backend="reference"), api)


def test_compare_rotates_uncalibrated_schemes_too(llama):
    opts = CompareOptions(schemes=["w8a16"], calib_options={"rotation": "hadamard"})
    q, calibrated, _ = quantize_with_options(copy.deepcopy(llama), "w8a16", byte_tokenizer(), opts)
    assert not calibrated and q.lowbit_rotation.rotation == "hadamard"
    assert _same(q, lowbit.quantize(copy.deepcopy(llama), "w8a16", rotation="hadamard"))


@pytest.mark.parametrize("args, names", [
    (["--model-free", "--rotation", "hadamard"], ["--model-free cannot rotate", "--rotation"]),
    (["--rotation", "walsh"], ["--rotation must be one of none, hadamard, got 'walsh'"]),
    (["--rotation", "hadamard", "--device", "cpu"], ["--rotation", "--device"]),
])
def test_bad_rotation_options_are_one_line_errors(capsys, tmp_path, args, names):
    src = save_tiny_folder(tmp_path / "m")
    code, _, err = run(capsys, "quantize", src, "--scheme", "w8a16", *args, "-o", tmp_path / "out")
    assert_one_error(code, err, *names)
    assert not (tmp_path / "out").exists()


def test_compare_report_says_rotated_and_skips_the_float_input_sqnr(tmp_path):
    from lowbit.report import run_compare
    from helpers.models import tiny_llama

    text = tmp_path / "eval.txt"
    text.write_text(TEXT)
    opts = CompareOptions(schemes=["w8a16"], limit=60, window=32, lastword=0, text_file=str(text),
                          calib_options={"rotation": "hadamard"}, sqnr_tokens=16, spread=0, progress=False)
    row = run_compare(tiny_llama(), byte_tokenizer(), opts=opts)["schemes"][0]
    assert row["status"] == "ok", row.get("error")
    assert row["rotation"].startswith("rotated (hadamard)") and row["layers"] == {}
    assert "the rotation changed each layer's input" in row["sqnr_note"]


def test_compare_takes_the_same_rotation_values(capsys):
    code, _, err = run(capsys, "compare", "--schemes", "w8a16", "--rotation", "givens")
    assert_one_error(code, err, "--rotation must be one of none, hadamard, got 'givens'")
