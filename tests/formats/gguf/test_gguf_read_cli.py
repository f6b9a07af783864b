"""``lowbit eval FILE.gguf`` reads the file's GGML blocks (the same perplexity as its float
expansion), ``--numerics llama-cpp-cpu`` computes as llama.cpp's CPU backend, and ``lowbit
inspect FILE.gguf`` lists the type of every tensor."""

from __future__ import annotations

import json

import pytest

from helpers.cli import assert_one_error, run
from helpers.gguf_folders import save_gguf_folder, skip_without_converter
from helpers.models import tiny_llama

skip_without_converter()

EVAL = ("--limit", "64", "--window", "32", "--lastword", "0", "--spread", "0", "--json", "--no-progress")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    from lowbit.gguf_quantize import quantize_gguf

    folder = save_gguf_folder(tiny_llama(vocab_size=300), tmp_path_factory.mktemp("llama"))
    out = folder.parent / "m.gguf"
    quantize_gguf(folder, out, "Q4_K_M", progress=False)   # tied: the output is token_embd (Q8_0)
    return folder, out


def test_eval_keeps_the_codes_and_equals_the_float_expansion(gguf_file, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the float expansion is cached there
    _, out = gguf_file
    code, stdout, err = run(capsys, "eval", out, *EVAL)
    assert code == 0, err
    codes = json.loads(stdout)["model"]
    # hidden 64: Q4_K falls back to Q5_0, blk.1's attn_v and ffn_down (Q6_K) to Q8_0, and the
    # output layer is the tied token embedding, Q8_0: 15 linears
    assert codes["gguf_types"] == {"Q5_0": 12, "Q8_0": 3}
    code, stdout, err = run(capsys, "eval", out, "--gguf-weights", "float", *EVAL)
    assert code == 0, err
    floats = json.loads(stdout)["model"]
    assert "gguf_types" not in floats and codes["perplexity"] == floats["perplexity"]
    code, stdout, err = run(capsys, "eval", out, "--numerics", "llama-cpp-cpu", *EVAL)
    assert code == 0, err
    llama = json.loads(stdout)["model"]
    assert llama["numerics"] == "llama-cpp-cpu" and llama["perplexity"] != codes["perplexity"]
    assert abs(llama["perplexity"] / codes["perplexity"] - 1) < 0.05


def test_llama_cpp_numerics_need_a_gguf_file_read_with_codes(gguf_file, capsys):
    folder, out = gguf_file
    code, _, err = run(capsys, "eval", folder, "--numerics", "llama-cpp-cpu", *EVAL)
    assert_one_error(code, err, "llama-cpp-cpu")
    code, _, err = run(capsys, "eval", out, "--numerics", "llama-cpp-cpu", "--gguf-weights", "float", *EVAL)
    assert_one_error(code, err, "--gguf-weights codes")


def test_inspect_lists_the_ggml_type_of_every_tensor(gguf_file, capsys):
    _, out = gguf_file
    code, stdout, err = run(capsys, "inspect", out, "--json")
    assert code == 0, err
    r = json.loads(stdout)
    assert r["format"] == "gguf" and r["tensors"]["blk.0.attn_q.weight"] == "Q5_0"
    assert r["tensors"]["blk.0.attn_norm.weight"] == "F32" and r["types"]["Q8_0"] == 3
    assert r["tensors"]["token_embd.weight"] == "Q8_0" and "output.weight" not in r["tensors"]


def test_a_gguf_file_without_the_suffix_is_read_as_gguf(gguf_file, tmp_path):
    import lowbit

    _, out = gguf_file
    bare = tmp_path / "model-q4km"  # the magic bytes decide (lowbit.formats.gguf.is_gguf_file), not the name
    bare.write_bytes(out.read_bytes())
    model, tok = lowbit.load_model(bare)
    assert model.lowbit_format == "gguf" and model.lowbit_gguf_types == lowbit.load(out).lowbit_gguf_types
    assert tok.vocab_size == 300
