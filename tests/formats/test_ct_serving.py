"""lowbit quantize says which engines serve a compressed-tensors output (lowbit.formats.ct_serving:
the vLLM-CPU facts of bench/serve/RESULTS-serve.md and bench/moe/RESULTS-moe.md, as data)."""

from __future__ import annotations

import json

import pytest

from helpers.cli import run
from lowbit.formats.ct_serving import VLLM_CPU, Serving, vllm_cpu_verdict
from lowbit.schemes import get_scheme


@pytest.mark.parametrize("scheme, moe, ragged, want, detail", [
    ("w8a8-int8", False, False, Serving.RUNS, "reference int8 matmul"),
    ("w8a8-int8", True, False, Serving.REFUSED, "dynamic only"),
    ("w8a8-int8-dynamic", False, False, Serving.RUNS, "saturate"),
    ("w8a8-int8-dynamic", True, False, Serving.RUNS, "saturate"),
    ("w8a8-fp8-dynamic", False, False, Serving.RUNS, "channel-wise"),
    ("w8a8-fp8-dynamic", True, False, Serving.REFUSED, "no FP8 MoE"),
    ("w8a8-fp8", False, False, Serving.REFUSED, "narrow()"),
    ("fp8-block", False, True, Serving.REFUSED, "multiple of 128"),
    ("fp8-block", False, False, Serving.REFUSED, "AMX"),
    ("w8a16", False, False, Serving.REFUSED, "uint8b128"),
    ("w4a16", False, False, Serving.RUNS, "WNA16"),
    ("w4a16-asym", False, False, Serving.RUNS, "zero points"),
    ("w4a8-int8", False, False, Serving.RUNS, "asymmetrically"),
    ("w4a8-fp8", False, False, Serving.REFUSED, "INT4 weights with FP8 inputs"),
    ("nvfp4", False, False, Serving.REFUSED, "NVFP4"),
    ("nvfp4a16", False, False, Serving.REFUSED, "FP4"),
    ("nvfp4-e5m3", False, False, Serving.REFUSED, "NVFP4"),
    ("mxfp4", False, False, Serving.REFUSED, "MX"),
    ("mxfp8", False, False, Serving.REFUSED, "MX"),
    ("mxfp4-mxfp8", False, False, Serving.REFUSED, "MX"),
    ("mxfp6-e2m3", False, False, Serving.REFUSED, "num_bits"),
    ("mxfp6-e3m2", False, False, Serving.REFUSED, "num_bits"),
    ("mxfp6-mxfp8", False, False, Serving.REFUSED, "num_bits"),
])
def test_vllm_cpu_verdicts(scheme, moe, ragged, want, detail):
    v = vllm_cpu_verdict(get_scheme(scheme), moe=moe, ragged_blocks=ragged)
    assert v.engine == VLLM_CPU and v.serving is want and detail in v.detail


def test_every_built_in_scheme_has_a_measured_vllm_cpu_verdict():
    """bench/serve/serve_schemes.py served every scheme on a tiny dense model: none is left unchecked."""
    from lowbit.schemes import PRESETS

    assert [n for n, s in PRESETS.items() if vllm_cpu_verdict(s).serving is Serving.UNCHECKED] == []


def test_quantize_prints_the_serving_verdicts(capsys, tmp_path):
    from helpers.eval_fixtures import save_tiny_folder

    src = save_tiny_folder(tmp_path / "m")
    code, out, err = run(capsys, "quantize", src, "--scheme", "w8a8-fp8-dynamic", "-o", tmp_path / "q",
                         "--format", "compressed-tensors", "--json")
    assert code == 0, err
    got = json.loads(out)["serving"]
    assert [(g["engine"], g["serving"]) for g in got] == [(VLLM_CPU, "runs"), ("vLLM (CUDA)", "not checked")]
    code, out, err = run(capsys, "quantize", src, "--scheme", "w8a8-fp8", "-o", tmp_path / "q2",
                         "--format", "compressed-tensors")
    assert code == 0, err
    assert f"serving, {VLLM_CPU}: refused (its torch FP8 kernel" in out.replace("\n", " ")
    code, out, err = run(capsys, "quantize", src, "--scheme", "w8a8-fp8", "-o", tmp_path / "q3", "--json")
    assert code == 0 and "serving" not in json.loads(out)  # the lowbit format: no engine reads it
