"""The lowbit CLI: eval, compare and quantize on a tiny model folder; errors as one line."""

from __future__ import annotations

import json

import pytest
import torch

import lowbit
from helpers.cli import run
from helpers.eval_fixtures import byte_tokenizer, save_tiny_folder
from lowbit.eval import perplexity
from lowbit.models import load_model

TEXT = "\n".join(
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    f"seventeen eighteen nineteen twenty and so the long story of the day ended with the {w}."
    for w in ("garden", "letter", "carriage", "evening", "sister", "window"))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_folder(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("text") / "eval.txt"
    p.write_text(TEXT)
    return p


def test_eval_json_matches_api_and_baseline(capsys, tiny_dir, text_file):
    code, out, _ = run(capsys, "eval", tiny_dir, "--text", text_file, "--limit", 100, "--window", 48,
                       "--lastword", 3, "--baseline", tiny_dir, "--json", "--no-progress")
    assert code == 0
    rep = json.loads(out)
    model, tok = load_model(tiny_dir)
    ref = perplexity(model, tok, text_file=text_file, window=48, limit=100, progress=False)
    assert rep["model"]["tokens_scored"] == 100
    assert rep["model"]["perplexity"] == pytest.approx(ref.perplexity, rel=1e-6)
    assert rep["model"]["bits_per_byte"] == pytest.approx(ref.bits_per_byte, rel=1e-6)
    assert rep["model"]["lastword"]["examples"] == 3
    assert rep["ppl_change_pct"] == pytest.approx(0.0, abs=1e-9)
    # against itself: no divergence, every top token the same, a zero-width paired interval
    m = rep["model"]
    assert m["kld"] == {"estimate": 0.0, "low": 0.0, "high": 0.0, "level": 0.95}
    assert m["same_top"]["estimate"] == 1.0 and m["ppl_change_interval"]["high"] == 0.0
    assert m["lastword"]["interval"]["low"] <= m["lastword"]["accuracy"] <= m["lastword"]["interval"]["high"]
    assert rep["intervals"]["blocks"] == 32


def test_eval_baseline_reports_kld_with_intervals(capsys, tiny_dir, text_file, tmp_path):
    q = tmp_path / "q"
    code, _, err = run(capsys, "quantize", tiny_dir, "--scheme", "w8a8-int8-dynamic", "-o", q)
    assert code == 0, err
    code, out, _ = run(capsys, "eval", q, "--text", text_file, "--limit", 100, "--window", 48, "--lastword", 0,
                       "--baseline", tiny_dir, "--spread", 0, "--json", "--no-progress")
    assert code == 0
    m = json.loads(out)["model"]
    assert 0 < m["kld"]["low"] < m["kld"]["estimate"] < m["kld"]["high"]
    assert m["kld_percentiles"]["max"] >= m["kld"]["estimate"]
    code, out, _ = run(capsys, "eval", q, "--text", text_file, "--limit", 100, "--window", 48, "--lastword", 0,
                       "--baseline", tiny_dir, "--spread", 0, "--no-progress")
    assert "KL divergence (baseline || model)" in out and "same top token" in out and "(paired, 95%)" in out
    # the float model scored once, its reference reused by a later run: the same figures
    ref = tmp_path / "float.safetensors"
    code, _, err = run(capsys, "eval", tiny_dir, "--text", text_file, "--limit", 100, "--window", 48, "--lastword", 0,
                       "--spread", 0, "--save-reference", ref, "--json", "--no-progress")
    assert code == 0 and ref.is_file(), err
    code, out, _ = run(capsys, "eval", q, "--text", text_file, "--limit", 100, "--window", 48, "--lastword", 0,
                       "--baseline", ref, "--spread", 0, "--json", "--no-progress")
    assert code == 0
    rep = json.loads(out)
    assert rep["model"]["kld"] == m["kld"] and rep["baseline"]["perplexity"] == pytest.approx(
        rep["model"]["perplexity"] / (1 + rep["ppl_change_pct"] / 100))
    code, _, err = run(capsys, "eval", q, "--text", text_file, "--limit", 100, "--window", 32, "--baseline", ref,
                       "--no-progress")
    assert code == 2 and "float.safetensors" in err and "window 48" in err and len(err.strip().splitlines()) == 1
    code, _, err = run(capsys, "eval", q, "--baseline", tiny_dir, "--save-reference", ref)
    assert code == 2 and "--save-reference" in err
    # a reference file that cannot be written is refused before any model is scored, and never
    # replaces a file of the model folder
    for target, msg in ((tmp_path / "missing" / "r.safetensors", "does not exist"), (tmp_path, "is a folder"),
                        (tiny_dir / "config.json", "existing file of the model folder")):
        code, _, err = run(capsys, "eval", tiny_dir, "--save-reference", target, "--no-progress")
        assert code == 2 and msg in err and len(err.strip().splitlines()) == 1, err
    assert (tiny_dir / "config.json").read_text().startswith("{")


def test_eval_table(capsys, tiny_dir, text_file):
    code, out, _ = run(capsys, "eval", tiny_dir, "--text", text_file, "--limit", 50, "--lastword", 0, "--no-progress")
    assert code == 0
    assert "perplexity" in out and "bits/byte" in out


def test_compare_json_and_files(capsys, tiny_dir, text_file, tmp_path):
    code, out, _ = run(capsys, "compare", tiny_dir, "--schemes", "w8a16,nvfp4-e5m3", "--text", text_file,
                       "--limit", 60, "--window", 32, "--lastword", 2, "-o", tmp_path / "rep", "--json",
                       "--no-progress")
    assert code == 0
    rep = json.loads(out)
    assert [r["scheme"] for r in rep["schemes"]] == ["w8a16", "nvfp4-e5m3"]
    assert all(r["status"] == "ok" for r in rep["schemes"])
    assert (tmp_path / "rep" / "report.json").is_file() and (tmp_path / "rep" / "report.png").is_file()


def test_compare_calib_preset_sets_the_budget_and_gptq(capsys, tiny_dir, text_file, tmp_path):
    base = ["compare", tiny_dir, "--schemes", "w8a8-int8-dynamic", "--text", text_file, "--calib", text_file,
            "--limit", 30, "--window", 32, "--lastword", 0, "--json", "--no-progress"]
    code, out, err = run(capsys, *base, "-o", tmp_path / "a", "--calib-preset", "gptq-fast", "--calib-seq-len", 32)
    assert code == 0, err
    rep = json.loads(out)
    o = rep["options"]
    assert (o["calib_samples"], o["calib_seq_len"]) == (4, 32)
    # the preset as given, expanded where lowbit.quantize expands it (its budget, then its fields)
    assert o["calib_preset"] == "gptq-fast" and o["calib_options"] == {}
    assert rep["schemes"][0]["calibrated"] is True
    code, out, err = run(capsys, *base, "-o", tmp_path / "b")
    assert code == 0, err
    rep = json.loads(out)
    assert (rep["options"]["calib_samples"], rep["options"]["calib_seq_len"]) == (16, 512)  # lowbit.quantize's
    assert rep["options"]["calib_options"] == {} and rep["schemes"][0]["calibrated"] is False


def test_compare_table_shows_each_scheme(capsys, tiny_dir, text_file, tmp_path):
    code, out, _ = run(capsys, "compare", tiny_dir, "--schemes", "w8a16", "--text", text_file, "--limit", 30,
                       "--window", 32, "--lastword", 2, "-o", tmp_path / "rep", "--no-progress")
    assert code == 0
    assert "w8a16" in out and "float" in out and "report.json" in out
    assert "KLD ±95%" in out and "within noise of" in out and "size and time" in out


@pytest.mark.parametrize("args,msg", [
    (["eval", "/nonexistent/model"], "model path not found"),
    (["compare", "--schemes", "nvfp5"], "nvfp5"),
    (["quantize", "builtin", "--scheme", "w8a16", "--model-free", "--calib", "x.txt"], "--model-free takes no calibration"),
    (["quantize", "builtin", "--scheme", "w8a8-int8", "--smoothquant", "1.5"], "--smoothquant"),
    (["quantize", "builtin", "--scheme", "w8a8-int8", "--smoothquant", "often"], "'default' or 'none'"),
    (["quantize", "builtin", "--scheme", "w4a16", "--model-free", "--smoothquant", "0.5"],
     "--model-free takes no calibration"),
    (["quantize", "builtin", "--scheme", "nvfp4", "--layer-inputs", "fp16"],
     "--layer-inputs must be one of quantized, float, got 'fp16'"),
    (["quantize", "builtin", "--scheme", "w4a16", "--weight-rounding", "awq"],
     "--weight-rounding must be one of rtn, gptq, got 'awq'"),
    (["quantize", "builtin", "--scheme", "w4a16", "--model-free", "--weight-rounding", "gptq"],
     "--model-free takes no calibration"),
    (["compare", "--schemes", "w4a16", "--weight-rounding", "gtpq"], "--weight-rounding must be one of"),
    (["compare", "--schemes", "w4a16", "--calib-preset", "gptq"], "--calib-preset must be one of fast, default, gptq-fast, best"),
    (["quantize", "builtin", "--scheme", "w8a8-int8-dynamic", "--calib-preset", "fastest"],
     "--calib-preset must be one of fast, default, gptq-fast, best, got 'fastest'"),
    (["quantize", "builtin", "--scheme", "w8a8-int8-dynamic", "--model-free", "--calib-preset", "gptq-fast"],
     "--model-free takes no calibration"),
])
def test_errors_are_one_line_and_exit_nonzero(capsys, args, msg):
    code, out, err = run(capsys, *args)
    assert code == 2
    assert msg in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_eval_missing_text_file_is_one_line(capsys, tiny_dir, tmp_path):
    code, _, err = run(capsys, "eval", tiny_dir, "--text", tmp_path / "missing.txt", "--no-progress")
    assert code == 2 and "missing.txt" in err and len(err.strip().splitlines()) == 1


def test_quantize_writes_a_checkpoint_that_eval_reads(capsys, tiny_dir, text_file, tmp_path):
    out_dir = tmp_path / "q"
    code, out, err = run(capsys, "quantize", tiny_dir, "--scheme", "w8a16", "--output", out_dir, "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert summary["scheme"] == "w8a16" and (out_dir / "config.json").is_file()
    code, out, err = run(capsys, "eval", out_dir, "--text", text_file, "--limit", 40, "--lastword", 0,
                         "--baseline", tiny_dir, "--json", "--no-progress")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["model"]["perplexity"] != rep["baseline"]["perplexity"]
    assert abs(rep["ppl_change_pct"]) < 5


def test_byte_tokenizer_roundtrip():
    tok = byte_tokenizer()
    ids = tok("héllo", add_special_tokens=False)["input_ids"]
    assert ids == list("héllo".encode())
    assert tok.decode(ids) == "héllo"


def test_quantize_model_free_matches_in_memory(capsys, tiny_dir, text_file, tmp_path):
    a, b = tmp_path / "mf", tmp_path / "mem"
    code, _, err = run(capsys, "quantize", tiny_dir, "--scheme", "nvfp4-e5m3", "--model-free", "--workers", 1,
                       "--output", a, "--json")
    assert code == 0, err
    # in memory, RTN asked for (with calibration data a 4-bit scheme's default is GPTQ)
    code, _, err = run(capsys, "quantize", tiny_dir, "--scheme", "nvfp4-e5m3", "--output", b, "--json",
                       "--weight-rounding", "rtn", "--in-memory")
    assert code == 0, err
    res = []
    for d in (a, b):
        code, out, err = run(capsys, "eval", d, "--text", text_file, "--limit", 40, "--lastword", 0, "--json",
                             "--no-progress")
        assert code == 0, err
        res.append(json.loads(out)["model"]["perplexity"])
    assert res[0] == pytest.approx(res[1], rel=1e-6)


def test_compare_save_format_measures_disk(tiny_dir, text_file, tmp_path):
    from lowbit.report import CompareOptions, run_compare

    model, tok = load_model(tiny_dir)
    opts = CompareOptions(schemes=["w8a16"], limit=30, window=32, lastword=0, text_file=str(text_file),
                          sqnr_tokens=16, save_format="lowbit", progress=False)
    rep = run_compare(model, tok, opts=opts, output_dir=tmp_path / "rep")
    row = rep["schemes"][0]
    assert row["status"] == "ok", row.get("error")
    assert row["size_source"] == "disk (lowbit)"
    ck = tmp_path / "rep" / "checkpoints" / "w8a16"
    assert row["size_bytes"] == sum(p.stat().st_size for p in ck.rglob("*.safetensors"))


def test_eval_tasks_hands_model_to_lm_eval_with_local_task(capsys, monkeypatch, tiny_dir, text_file):
    import lowbit.eval.harness as harness

    seen = {}

    def fake_run(model, tok, tasks, include_path=None, **kw):
        seen.update(model=model, tasks=tasks, include_path=include_path)
        return {"lowbit_lastword": {"acc,none": 0.5}}

    monkeypatch.setattr(harness, "run_lm_eval", fake_run)
    code, out, err = run(capsys, "eval", tiny_dir, "--text", text_file, "--limit", 20, "--lastword", 3,
                         "--tasks", "lowbit_lastword", "--json", "--no-progress")
    assert code == 0, err
    assert json.loads(out)["lm_eval"] == {"lowbit_lastword": {"acc,none": 0.5}}
    assert seen["tasks"] == ["lowbit_lastword"]
    rows = (harness.Path(seen["include_path"]) / "lowbit_lastword.jsonl").read_text().splitlines()
    assert len(rows) == 3 and json.loads(rows[0])["word"] == "garden"


def test_quantize_weight_rounding_gptq_calibrates_a_weight_only_scheme(capsys, tiny_dir, text_file, tmp_path):
    outs = {}
    for wr in ("rtn", "gptq"):
        out_dir = tmp_path / wr
        code, _, err = run(capsys, "quantize", tiny_dir, "--scheme", "w8a16", "--output", out_dir, "--calib", text_file,
                           "--calib-samples", 2, "--calib-seq-len", 64, "--weight-rounding", wr, "--json")
        assert code == 0, err
        assert ("calibrating on" in err) == (wr == "gptq")
        outs[wr] = lowbit.load(out_dir)
    a = outs["rtn"].get_submodule("model.layers.0.mlp.down_proj")
    b = outs["gptq"].get_submodule("model.layers.0.mlp.down_proj")
    assert torch.equal(a.weight_scale, b.weight_scale) and not torch.equal(a.weight_codes, b.weight_codes)


def test_quantize_w4a16_with_calibration_text_is_gptq_by_default(capsys, tiny_dir, text_file, tmp_path):
    """`lowbit quantize --scheme w4a16` (not model-free) calibrates: GPTQ + reconstruction, the same
    codes as lowbit.quantize with calibration data and no options; --weight-rounding rtn is plain RTN."""
    code, _, err = run(capsys, "quantize", tiny_dir, "--scheme", "w4a16", "--output", tmp_path / "d", "--calib",
                       text_file, "--calib-samples", 2, "--calib-seq-len", 64, "--json")
    assert code == 0, err
    assert "calibrating on" in err
    got = lowbit.load(tmp_path / "d").get_submodule("model.layers.0.mlp.down_proj")
    model, tok = lowbit.load_model(tiny_dir)
    q = lowbit.quantize(model, "w4a16", calibration=str(text_file), tokenizer=tok, num_samples=2, seq_len=64,
                        progress=False)
    assert q.lowbit_calibration.weight_rounding == "gptq" and q.lowbit_calibration.reconstruct
    ref = q.get_submodule("model.layers.0.mlp.down_proj")
    assert torch.equal(got.weight_codes, ref.weight_codes) and torch.equal(got.weight_scale, ref.weight_scale)
    plain = lowbit.quantize(lowbit.load_model(tiny_dir)[0], "w4a16").get_submodule("model.layers.0.mlp.down_proj")
    assert not torch.equal(got.weight_codes, plain.weight_codes)


def _gptq_down_projs(capsys, tiny_dir, text_file, tmp_path, runs: dict) -> dict:
    """Layer 0's down_proj of ``lowbit quantize --scheme w4a16`` with GPTQ and no reconstruction,
    per run name, each with its extra options."""
    mods = {}
    for key, extra in runs.items():
        code, _, err = run(capsys, "quantize", tiny_dir, "--scheme", "w4a16", "--output", tmp_path / key, "--calib",
                           text_file, "--calib-samples", 2, "--calib-seq-len", 64, "--weight-rounding", "gptq",
                           "--reconstruct-iters", 0, *extra, "--json")
        assert code == 0, err
        mods[key] = lowbit.load(tmp_path / key).get_submodule("model.layers.0.mlp.down_proj")
    return mods


def _python_down_proj(tiny_dir, text_file, **options):
    """Layer 0's down_proj of lowbit.quantize(w4a16) with the CLI runs' calibration and ``options``."""
    model, tok = lowbit.load_model(tiny_dir)
    q = lowbit.quantize(model, "w4a16", calibration=str(text_file), tokenizer=tok, num_samples=2, seq_len=64,
                        weight_rounding="gptq", reconstruct_iters=0, progress=False, **options)
    return q.get_submodule("model.layers.0.mlp.down_proj")


def _refused_with_model_free(capsys, tiny_dir, tmp_path, flag: str) -> None:
    code, _, err = run(capsys, "quantize", tiny_dir, "--scheme", "w4a16", "--output", tmp_path / "mf",
                       "--model-free", flag)
    assert code == 2 and flag.replace("--no-", "--") in err


def test_quantize_gptq_act_order_is_the_python_option(capsys, tiny_dir, text_file, tmp_path):
    """--gptq-act-order changes GPTQ's codes (not its scales) exactly as gptq_act_order=True does in
    lowbit.quantize, and is refused by --model-free."""
    mods = _gptq_down_projs(capsys, tiny_dir, text_file, tmp_path, {"in-order": [], "act-order": ["--gptq-act-order"]})
    assert torch.equal(mods["in-order"].weight_scale, mods["act-order"].weight_scale)
    assert not torch.equal(mods["in-order"].weight_codes, mods["act-order"].weight_codes)
    assert torch.equal(_python_down_proj(tiny_dir, text_file, gptq_act_order=True).weight_codes,
                       mods["act-order"].weight_codes)
    _refused_with_model_free(capsys, tiny_dir, tmp_path, "--gptq-act-order")


def test_quantize_gptq_scale_search_is_the_python_option(capsys, tiny_dir, text_file, tmp_path):
    """--gptq-scale-search is on by default for w4a16 (GPTQ's scales searched), --no-gptq-scale-search
    keeps RTN's full-range scales, each exactly as lowbit.quantize's gptq_scale_search; refused by
    --model-free."""
    from lowbit.quant import quantize
    from lowbit.schemes import PRESETS

    mods = _gptq_down_projs(capsys, tiny_dir, text_file, tmp_path, {"default": [], "off": ["--no-gptq-scale-search"]})
    w = lowbit.load_model(tiny_dir)[0].get_submodule("model.layers.0.mlp.down_proj").weight.detach()
    spec = PRESETS["w4a16"].weights
    searched = _python_down_proj(tiny_dir, text_file)  # the default: scales searched on the Hessian
    assert torch.equal(mods["default"].weight_scale, searched.weight_scale)
    assert torch.equal(mods["default"].weight_codes, searched.weight_codes)
    assert not torch.equal(mods["default"].weight_scale, quantize(w, spec).scale)
    assert torch.equal(mods["off"].weight_scale, quantize(w, spec).scale)
    assert mods["default"].scheme.weights == spec  # the scheme and its observer are unchanged
    assert torch.equal(_python_down_proj(tiny_dir, text_file, gptq_scale_search=False).weight_codes,
                       mods["off"].weight_codes)
    _refused_with_model_free(capsys, tiny_dir, tmp_path, "--no-gptq-scale-search")


def test_quantize_calib_preset_gptq_fast_equals_its_options(capsys, tiny_dir, text_file, tmp_path):
    """--calib-preset gptq-fast calibrates a dynamic scheme with GPTQ, exactly as its fields given
    one by one; an explicit option overrides the preset's."""
    runs = {
        "preset": ["--calib-preset", "gptq-fast", "--calib-seq-len", 32],
        "fields": ["--weight-rounding", "gptq", "--layer-inputs", "float", "--calib-samples", 4,
                   "--calib-seq-len", 32],
        "rtn": ["--calib-preset", "gptq-fast", "--weight-rounding", "rtn", "--calib-seq-len", 32],
    }
    mods = {}
    for key, args in runs.items():
        code, _, err = run(capsys, "quantize", tiny_dir, "--scheme", "w8a8-int8-dynamic", "--output", tmp_path / key,
                           "--calib", text_file, *args, "--json")
        assert code == 0, err
        assert ("calibrating on" in err) == (key != "rtn")
        mods[key] = lowbit.load(tmp_path / key).get_submodule("model.layers.0.mlp.down_proj")
    assert torch.equal(mods["preset"].weight_codes, mods["fields"].weight_codes)
    assert not torch.equal(mods["preset"].weight_codes, mods["rtn"].weight_codes)
    assert torch.equal(mods["preset"].weight_scale, mods["rtn"].weight_scale)


@pytest.mark.parametrize("scheme,option,alpha", [
    ("w8a8-fp8", None, 0.5), ("w8a8-int8", None, 0.8), ("w8a8-int8", "none", None), ("w8a8-fp8", "0.3", 0.3),
])
def test_quantize_smooths_static_schemes_by_default(capsys, tiny_dir, text_file, tmp_path, scheme, option, alpha):
    args = ["--smoothquant", option] if option else []
    code, out, err = run(capsys, "quantize", tiny_dir, "--scheme", scheme, "--output", tmp_path / "q", "--calib",
                         text_file, "--calib-samples", 2, "--calib-seq-len", 32, *args, "--json")
    assert code == 0, err
    assert json.loads(out)["smoothquant"] == alpha
