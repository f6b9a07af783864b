"""The float-rounding spread of a perplexity figure: perturbed embeddings, reported where activations
are quantized, one default for lowbit eval and lowbit compare."""

from __future__ import annotations

import copy
import inspect
import json

import pytest
import torch

import lowbit
from helpers.cli import run
from helpers.eval_fixtures import byte_tokenizer, save_tiny_folder
from lowbit.eval import perplexity
from lowbit.eval.spread import (DEFAULT_SPREAD_SEEDS, has_quantized_activations, perplexity_spread,
                                perturbed_embeddings, spread_summary)
from lowbit.report.compare import CompareOptions

TEXT = " ".join(f"the {w} of the day was long and quiet." for w in ("garden", "letter", "evening", "sister") * 8)


def test_perturbation_is_scoped_seeded_and_at_the_given_scale(llama, token_ids):
    with torch.no_grad():
        plain = llama(token_ids).logits
        with perturbed_embeddings(llama, 1e-3, seed=0):
            a = llama(token_ids).logits
        with perturbed_embeddings(llama, 1e-3, seed=0):
            b = llama(token_ids).logits
        with perturbed_embeddings(llama, 1e-3, seed=1):
            c = llama(token_ids).logits
        after = llama(token_ids).logits
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, plain)
    assert torch.equal(after, plain)
    assert 0 < float((a - plain).norm() / plain.norm()) < 1e-2


def test_spread_only_where_activations_are_quantized(llama):
    tok = byte_tokenizer()
    assert not has_quantized_activations(llama)
    assert not has_quantized_activations(lowbit.quantize(copy.deepcopy(llama), "w4a16"))
    q = lowbit.quantize(copy.deepcopy(llama), "w8a8-int8-dynamic")
    assert has_quantized_activations(q)
    vals = perplexity_spread(q, tok, seeds=3, text=TEXT, window=32, progress=False)
    plain = perplexity(q, tok, text=TEXT, window=32, progress=False).perplexity
    s = spread_summary(plain, vals)
    assert len(vals) == 3 and s["seeds"] == 3 and s["min"] <= plain <= s["max"] and s["sd"] >= 0
    assert s["sd_pct"] == pytest.approx(100 * s["sd"] / plain)


def test_eval_and_compare_report_the_spread(capsys, tmp_path):
    src = save_tiny_folder(tmp_path / "m")
    text = tmp_path / "t.txt"
    text.write_text("\n".join([TEXT] * 4))
    code, _, _ = run(capsys, "quantize", src, "--scheme", "w8a8-int8-dynamic", "-o", tmp_path / "q")
    assert code == 0
    base = ["--text", text, "--limit", 60, "--window", 32, "--lastword", 0, "--json", "--no-progress"]
    code, out, _ = run(capsys, "eval", tmp_path / "q", "--baseline", src, *base)
    rep = json.loads(out)
    assert code == 0 and rep["model"]["ppl_spread"]["seeds"] == DEFAULT_SPREAD_SEEDS
    assert "ppl_spread" not in rep["baseline"] and "ppl_change_sd_pct" in rep
    code, out, _ = run(capsys, "eval", tmp_path / "q", *base, "--spread", 0)
    assert "ppl_spread" not in json.loads(out)["model"]
    code, out, _ = run(capsys, "compare", src, "--schemes", "w8a8-int8-dynamic,w8a16", *base, "-o", tmp_path / "r")
    rows = {r["scheme"]: r for r in json.loads(out)["schemes"]}
    assert rows["w8a8-int8-dynamic"]["ppl_spread"]["seeds"] == DEFAULT_SPREAD_SEEDS
    assert "ppl_spread" not in rows["w8a16"]


def test_one_spread_default_for_eval_and_compare():
    from lowbit.cli import compare_cmd, eval_cmd

    assert CompareOptions().spread == DEFAULT_SPREAD_SEEDS
    for fn in (compare_cmd.compare_cmd, eval_cmd.eval_cmd):
        assert f"default {DEFAULT_SPREAD_SEEDS}," in inspect.signature(fn).parameters["spread"].default.help
