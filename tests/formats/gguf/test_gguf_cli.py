"""``lowbit quantize --format gguf``: one file, the types it chose in the summary, and one error
line for what GGUF does not take."""

from __future__ import annotations

import json

import pytest

from helpers.cli import assert_one_error, leftovers, run
from helpers.gguf_folders import save_gguf_folder, skip_without_converter
from helpers.models import tiny_llama

skip_without_converter()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_gguf_folder(tiny_llama(vocab_size=300), tmp_path_factory.mktemp("llama"))


def test_model_free_gguf_file_and_its_summary(folder, tmp_path, capsys):
    out = tmp_path / "m.gguf"
    code, stdout, err = run(capsys, "quantize", folder, "--format", "gguf", "--scheme", "Q4_K_M", "--model-free",
                            "-o", out, "--json")
    assert code == 0, err
    s = json.loads(stdout)
    assert out.is_file() and s["size_bytes"] == out.stat().st_size and s["format"] == "gguf"
    assert s["gguf"]["importance"] is False and s["scheme"] == "Q4_K_M"
    # hidden 64: llama-quantize's Q4_K falls back to Q5_0, attn_v's Q6_K to Q8_0 (blk.1), the tied output Q8_0
    assert s["gguf"]["types"]["blk.0.attn_q.weight"] == "Q5_0" and s["gguf"]["types"]["blk.1.attn_v.weight"] == "Q8_0"
    assert s["gguf"]["types"]["token_embd.weight"] == "Q8_0"
    code, stdout, err = run(capsys, "quantize", folder, "--format", "gguf", "--scheme", "Q4_K_M", "--model-free",
                            "-o", out)
    assert_one_error(code, err, "--overwrite")


def test_gguf_refuses_what_it_does_not_take(folder, tmp_path, capsys):
    out = tmp_path / "x.gguf"
    for args, names in ((["--scheme", "q4_kk"], ("--scheme q4_kk", "Q4_K_M")),
                        (["--scheme", "Q4_K_M", "--kv-cache", "fp8"], ("--kv-cache",)),
                        (["--scheme", "Q4_K_M", "--rotation", "hadamard"], ("--rotation",)),
                        (["--recipe", "r.yaml"], ("--recipe",)),
                        (["--scheme", "Q4_K_M", "--model-free", "--calib-samples", "4"], ("--model-free",)),
                        (["--scheme", "Q4_K_M", "--model-free", "--weight-rounding", "gptq"], ("--model-free",)),
                        (["--scheme", "Q4_K_M", "--weight-rounding", "best"], ("--weight-rounding",)),
                        (["--scheme", "Q4_K_M", "--importance-search", "best"], ("--importance-search", "llama-cpp, direct")),
                        (["--scheme", "Q4_K_M", "--model-free", "--importance-search", "direct"], ("--model-free",))):
        code, _, err = run(capsys, "quantize", folder, "--format", "gguf", *args, "-o", out)
        assert_one_error(code, err, *names)
        assert leftovers(out) == []


def test_importance_search_is_a_gguf_option(folder, tmp_path, capsys):
    code, _, err = run(capsys, "quantize", folder, "--scheme", "w4a16", "--importance-search", "direct",
                       "-o", tmp_path / "q")
    assert_one_error(code, err, "--importance-search", "--format gguf")
