"""``lowbit --version`` and ``lowbit env``: what a bug report needs, on any machine."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

import lowbit
from helpers.cli import run
from lowbit.cli import env_info

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"

AVX2_HOST = "processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu sse avx avx2 fma\n"
AVX512_HOST = "model name\t: Big CPU\nflags\t\t: avx2 avx512f avx512_vnni\n"


def test_version_is_the_package_version(capsys):
    code, out, _ = run(capsys, "--version")
    declared = tomllib.loads(PYPROJECT.read_text())["project"]["version"]
    assert code == 0 and out.strip() == f"lowbit {declared}" == f"lowbit {lowbit.__version__}"


def test_env_names_every_field_of_a_bug_report(capsys):
    code, out, _ = run(capsys, "env")
    assert code == 0
    labels = [ln.split(":", 1)[0] for ln in out.strip().splitlines()]
    assert labels == ["lowbit", "torch", "transformers", "compressed-tensors", "safetensors", "triton", "python",
                      "platform", "cpu", "cpu features", "native library", "triton kernels", "cuda"]
    assert re.search(r"^torch:\s+\d+\.\d+", out, re.M)


def test_env_json_matches_what_is_installed(capsys):
    import torch

    code, out, _ = run(capsys, "env", "--json")
    info = json.loads(out)
    assert code == 0 and info["lowbit"] == lowbit.__version__
    assert info["torch"] == torch.__version__
    assert info["cuda"].startswith("available" if torch.cuda.is_available() else "not available")


def test_cpu_model_and_features_come_from_cpuinfo(tmp_path):
    p = tmp_path / "cpuinfo"
    p.write_text(AVX2_HOST)
    info = env_info.collect(str(p))
    assert info["cpu"] == "Test CPU 9000"
    assert info["cpu features"] == "AVX2 yes, AVX-512 no, VNNI no, AVX-VNNI no"
    p.write_text(AVX512_HOST)
    assert env_info.collect(str(p))["cpu features"] == "AVX2 yes, AVX-512 yes, VNNI yes, AVX-VNNI no"


def test_no_cpuinfo_says_unknown(tmp_path):
    info = env_info.collect(str(tmp_path / "absent"))
    assert info["cpu features"].startswith("unknown")
    assert info["cpu"]  # platform's answer, never empty


def test_a_missing_package_reads_as_not_installed():
    assert env_info.package_version("no-such-distribution-lowbit") == "not installed"


def test_native_build_line_says_why_it_did_not_build(monkeypatch):
    from lowbit.kernels.native import build

    monkeypatch.setattr(build, "library", lambda options: None)
    monkeypatch.setattr(build, "unavailable_reason", lambda options: "RuntimeError: no C compiler found")
    assert env_info.native_build() == "not built: RuntimeError: no C compiler found"


@pytest.mark.compile
def test_native_build_line_names_the_built_library():
    from lowbit.kernels.native.build import DEFAULT, library

    lib = library(DEFAULT)
    line = env_info.native_build()
    assert line == (f"built ({lib._name})" if lib is not None else line) and (lib is not None or "not built: " in line)
