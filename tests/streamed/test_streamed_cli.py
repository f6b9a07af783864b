"""``lowbit quantize`` streams calibrated runs by default: the same tensors as --in-memory, a
summary that says so, and its options' errors."""

from __future__ import annotations

import json

from helpers.cli import assert_one_error, run, tiny  # noqa: F401  (tiny: fixture)
from helpers.folders import assert_same_tensors, folder_tensors


def test_cli_streams_by_default_and_equals_in_memory(capsys, tiny, tmp_path):
    common = ["quantize", tiny, "--scheme", "nvfp4", "--calib-samples", 3, "--calib-seq-len", 16, "--json"]
    code, out, err = run(capsys, *common, "-o", tmp_path / "s", "--reconstruct-iters", 3)
    assert code == 0, err
    s = json.loads(out)
    assert s["streamed"] is True and s["ranks"] == 1 and s["peak_rss"] > 0
    assert s["quantized"]["linears"] > 0 and len(s["layer_seconds"]) == 2
    code, out, err = run(capsys, *common, "-o", tmp_path / "m", "--reconstruct-iters", 3, "--in-memory")
    assert code == 0, err
    assert "streamed" not in json.loads(out)
    assert_same_tensors(folder_tensors(tmp_path / "s"), folder_tensors(tmp_path / "m"))


def test_cli_option_errors(capsys, tiny, tmp_path):
    code, _, err = run(capsys, "quantize", tiny, "--scheme", "nvfp4", "-o", tmp_path / "a", "--reconstruct-iters", -1)
    assert_one_error(code, err, "--reconstruct-iters")
    code, _, err = run(capsys, "quantize", tiny, "--scheme", "w8a16", "-o", tmp_path / "b", "--device", "cpu")
    assert_one_error(code, err, "--model-free")
    code, _, err = run(capsys, "quantize", tiny, "--scheme", "w8a16", "-o", tmp_path / "c", "--model-free",
                       "--reconstruct-iters", 2)
    assert_one_error(code, err, "--model-free")
    assert not any(tmp_path.iterdir())
