"""lowbit quantize, eval, compare and inspect on a tiny MoE model folder."""

from __future__ import annotations

import json

import pytest

from helpers.cli import run
from helpers.eval_fixtures import byte_tokenizer
from helpers.moe_models import tiny_moe

TEXT = "\n".join(f"the {w} of the long day was quiet, and the evening came over the garden and the house."
                 for w in ("end", "light", "story", "sound", "colour", "rest"))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe") / "qwen3_moe"
    tiny_moe("qwen3_moe").save_pretrained(d)
    byte_tokenizer().save_pretrained(d)
    (d.parent / "text.txt").write_text(TEXT)
    return d


def test_quantize_then_eval_the_moe_checkpoint(capsys, moe_dir, tmp_path):
    text = moe_dir.parent / "text.txt"
    code, out, _ = run(capsys, "quantize", moe_dir, "--scheme", "w8a8-int8", "--calib", text, "--calib-samples", 2,
                       "--calib-seq-len", 32, "--format", "compressed-tensors", "-o", tmp_path / "q")
    assert code == 0 and "in 16 experts of 2 MoE blocks" in out
    code, out, _ = run(capsys, "eval", tmp_path / "q", "--text", text, "--limit", 80, "--window", 32,
                       "--lastword", 0, "--baseline", moe_dir, "--json", "--no-progress")
    assert code == 0
    rep = json.loads(out)
    assert rep["model"]["tokens_scored"] == 80 and 0 < rep["model"]["perplexity"] < 1e4
    assert abs(rep["ppl_change_pct"]) < 20  # int8 experts: a few percent on a random model
    code, out, _ = run(capsys, "inspect", tmp_path / "q", "--strict")
    assert code == 0 and "16 of 16 experts quantized" in out


def test_compare_runs_on_moe_and_sizes_count_the_experts(capsys, moe_dir, tmp_path):
    text = moe_dir.parent / "text.txt"
    code, out, _ = run(capsys, "compare", moe_dir, "--schemes", "w8a16,nvfp4a16", "--text", text, "--limit", 60,
                       "--window", 32, "--lastword", 0, "--spread", 0, "-o", tmp_path / "rep", "--json",
                       "--no-progress")
    assert code == 0, out
    rep = json.loads(out)
    rows = {r["scheme"]: r for r in rep["schemes"]}
    assert all(r["status"] == "ok" for r in rows.values())
    fl = rep["float"]["size_bytes"]
    # experts are most of the weights: int8 roughly halves float32... per weight 1 byte of 4
    assert rows["w8a16"]["size_bytes"] < 0.45 * fl and rows["nvfp4a16"]["size_bytes"] < 0.25 * fl
    sqnr = rows["w8a16"]["layers"]  # per-layer SQNR against the float model, expert by expert
    assert len([n for n in sqnr if ".experts." in n]) == 2 * 8 * 3 and all(v > 20 for v in sqnr.values())
