"""``lowbit quantize --recipe / --target-bits`` and ``lowbit compare`` with recipe and budget rows,
on a tiny model folder; bad recipe input is one error line, exit 2, nothing written."""

from __future__ import annotations

import json

import pytest

from helpers.cli import run
from helpers.eval_fixtures import save_tiny_folder
from lowbit.recipes import Recipe

TEXT = "\n".join(f"the {w} was quiet and the evening went on as every evening before it had gone, slowly."
                 for w in ("garden", "letter", "carriage", "sister", "window", "morning", "river", "house"))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_folder(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("text") / "t.txt"
    p.write_text(TEXT)
    return p


def _recipe(tmp_path, text: str, suffix=".yaml"):
    p = tmp_path / f"r{suffix}"
    p.write_text(text)
    return p


def test_quantize_with_a_recipe_file_writes_its_groups_and_the_recipe(capsys, tiny_dir, tmp_path):
    r = _recipe(tmp_path, '"re:.*self_attn": w8a8-int8-dynamic\ndefault: w8a16\n')
    out = tmp_path / "q"
    code, stdout, err = run(capsys, "quantize", tiny_dir, "--recipe", r, "--output", out, "--json",
                            "--format", "compressed-tensors")
    assert code == 0, err
    s = json.loads(stdout)
    assert s["scheme"] == "r" and s["quantized"]["schemes"] == {"w8a8-int8-dynamic": 8, "w8a16": 6}
    assert Recipe.of(out / "recipe.json") == Recipe.of(r)
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    assert len(groups) == 2
    code, stdout, err = run(capsys, "inspect", out, "--json")
    rep = json.loads(stdout)
    assert code == 0 and sorted(g["layers"] for g in rep["groups"]) == [6, 8]
    assert rep["average_bits"] == pytest.approx(s["quantized"]["average_bits"])


def test_quantize_target_bits_chooses_saves_and_reuses_the_recipe(capsys, tiny_dir, text_file, tmp_path):
    out = tmp_path / "auto"
    code, stdout, err = run(capsys, "quantize", tiny_dir, "--target-bits", 6, "--candidates", "w4a16,w8a16",
                            "--calib", text_file, "--calib-samples", 4, "--calib-seq-len", 32, "--output", out,
                            "--json")
    assert code == 0, err
    s = json.loads(stdout)
    assert s["auto_recipe"]["average_bits"] <= 6 and s["quantized"]["average_bits"] == pytest.approx(
        s["auto_recipe"]["average_bits"])
    assert set(s["quantized"]["schemes"]) == {"w4a16", "w8a16"}
    again = tmp_path / "again"
    code, stdout, err = run(capsys, "quantize", tiny_dir, "--recipe", out / "recipe.json", "--calib", text_file,
                            "--calib-samples", 4, "--calib-seq-len", 32, "--output", again, "--json", "--in-memory")
    assert code == 0, err
    assert json.loads(stdout)["quantized"]["schemes"] == s["quantized"]["schemes"]


def test_compare_takes_recipes_and_budgets_as_rows(capsys, tiny_dir, text_file, tmp_path):
    r = _recipe(tmp_path, '{"re:.*mlp": "w4a16", "default": "w8a16"}', ".json")
    code, stdout, err = run(capsys, "compare", tiny_dir, "--schemes", "w8a16", "--recipe", r, "--target-bits", "5,7",
                            "--candidates", "w4a16,w8a16", "--calib", text_file, "--calib-samples", 2,
                            "--calib-seq-len", 32, "--text", text_file, "--limit", 40, "--window", 32,
                            "--lastword", 0, "--spread", 0, "-o", tmp_path / "rep", "--json", "--no-progress")
    assert code == 0, err
    rows = json.loads(stdout)["schemes"]
    assert [x["scheme"] for x in rows] == ["w8a16", "r", "auto-5b", "auto-7b"]
    assert all(x["status"] == "ok" for x in rows), [x.get("error") for x in rows]
    assert rows[1]["linears_per_scheme"] == {"w8a16": 8, "w4a16": 6} and rows[1]["recipe"]["default"] == "w8a16"
    assert rows[2]["average_bits"] <= 5 < rows[3]["average_bits"] <= 7
    assert rows[0]["average_bits"] == pytest.approx(8 + 16 / 64, abs=0.2)


@pytest.mark.parametrize("text,suffix,needle", [
    ('"re:.*nothing": w8a16\ndefault: w4a16\n', ".yaml", "'re:.*nothing' matches no quantizable linear"),
    ('"re:.*mlp": w8a16\n"re:.*down_proj": w4a16\n', ".yaml", "is claimed by recipe entries"),
    ('{"default": "nvfp5"}', ".json", "unknown scheme 'nvfp5'"),
    ('{"default": ', ".json", "is not valid JSON"),
    ('"re:.*q_proj": w8a16\ndefault: w4a16\n', ".yaml", "splits modules that engines run as one tensor"),
])
def test_bad_recipes_are_one_line_and_write_nothing(capsys, tiny_dir, tmp_path, text, suffix, needle):
    r = _recipe(tmp_path, text, suffix)
    out = tmp_path / "q"
    code, stdout, err = run(capsys, "quantize", tiny_dir, "--recipe", r, "--output", out, "--in-memory")
    assert code == 2 and needle in err and err.count("error:") == 1, err
    assert not out.exists() and not list(tmp_path.glob(".q*"))


@pytest.mark.parametrize("args,needle", [
    (["--scheme", "w8a16", "--target-bits", "5", "--candidates", "w8a16"], "give one of --scheme, --recipe or --target-bits"),
    (["--target-bits", "5"], "--target-bits needs --candidates"),
    (["--scheme", "w8a16", "--candidates", "w8a16"], "--candidates goes with --target-bits"),
    (["--target-bits", "3", "--candidates", "w4a16,w8a16"], "no mix of the candidates meets 3 average bits: they reach"),
    (["--target-bits", "5", "--candidates", "w4a16", "--model-free"], "--target-bits measures layers"),
])
def test_bad_budget_options_are_one_line(capsys, tiny_dir, tmp_path, args, needle):
    code, _, err = run(capsys, "quantize", tiny_dir, *args, "--output", tmp_path / "q")
    assert code == 2 and needle in err, err
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("given", ["recipe", "scheme"])
def test_a_numeric_alpha_is_resolved_alike_by_the_api_quantize_and_compare(capsys, tiny_dir, text_file, tmp_path,
                                                                          given):
    """One rule for ``smoothquant=0.5``: each scheme gets what it gets alone (a dynamic or
    weight-only scheme is smoothed too), for one scheme and for every group of a recipe."""
    import lowbit
    from lowbit.models import load_model
    from lowbit.report.compare import CompareOptions, RowSpec, quantize_with_options

    r = _recipe(tmp_path, '"re:.*self_attn": w8a8-int8-dynamic\ndefault: w8a16\n')
    want = {"w8a8-int8-dynamic": 0.5, "w8a16": 0.5} if given == "recipe" else 0.5
    plan = ["--recipe", r] if given == "recipe" else ["--scheme", "w8a8-int8-dynamic"]
    calib = ["--calib", text_file, "--calib-samples", 2, "--calib-seq-len", 32]
    code, stdout, err = run(capsys, "quantize", tiny_dir, *plan, "--smoothquant", "0.5", *calib, "--in-memory",
                            "--output", tmp_path / "q", "--json")
    assert code == 0, err
    assert json.loads(stdout)["smoothquant"] == want
    model, tok = load_model(tiny_dir)
    api = lowbit.quantize(model, Recipe.of(r) if given == "recipe" else "w8a8-int8-dynamic",
                          calibration=str(text_file), tokenizer=tok, smoothquant=0.5, num_samples=2, seq_len=32)
    sq = api.lowbit_calibration.smoothquant
    assert sq == want
    spec = RowSpec("r", recipe=Recipe.of(r)) if given == "recipe" else RowSpec("w", scheme="w8a8-int8-dynamic")
    opts = CompareOptions(smoothquant=0.5, calib=str(text_file), calib_samples=2, calib_seq_len=32, progress=False)
    _, calibrated, sq = quantize_with_options(load_model(tiny_dir)[0], spec, tok, opts)
    assert calibrated and sq == want


@pytest.mark.parametrize("args,needle", [
    (["--target-bits", "0", "--candidates", "w4a16"], "--target-bits '0': must be a positive number of bits"),
    (["--target-bits", "x", "--candidates", "w4a16"], "--target-bits 'x': not a number of bits"),
    (["--target-bits", " , ", "--candidates", "w4a16"], "--target-bits needs at least one number of bits"),
    (["--target-bits", "5"], "--target-bits needs --candidates"),
    (["SCHEME", "w8a16", "--candidates", "w4a16"], "--candidates goes with --target-bits"),
    (["--target-bits", "5", "--candidates", "w4a16,w4a16"], "candidate 'w4a16' is given twice"),
    (["--target-bits", "5", "--candidates", "w4a16,nvfp9"], "unknown scheme 'nvfp9'"),
    (["--recipe", "no-such-recipe.json"], "--recipe no-such-recipe.json: no such file"),
])
def test_quantize_and_compare_refuse_bad_budget_options_with_the_same_line(capsys, tiny_dir, tmp_path, args, needle):
    """The two commands share one parser (lowbit.cli.recipe_options): one error line, exit 2."""
    from helpers.cli import assert_one_error

    lines = []
    for command, flag in (("quantize", "--scheme"), ("compare", "--schemes")):
        argv = [flag if a == "SCHEME" else a for a in args]
        code, _, err = run(capsys, command, tiny_dir, *argv, "--output", tmp_path / command)
        lines.append(assert_one_error(code, err, needle))
        assert not (tmp_path / command).exists()
    assert lines[0] == lines[1]


def test_quantize_takes_one_budget(capsys, tiny_dir, tmp_path):
    from helpers.cli import assert_one_error

    code, _, err = run(capsys, "quantize", tiny_dir, "--target-bits", "5,6", "--candidates", "w4a16",
                       "--output", tmp_path / "q")
    assert_one_error(code, err, "--target-bits 5,6: quantize takes one budget")


def test_quantize_target_bits_measures_on_the_calibration_it_quantizes_with(capsys, tmp_path):
    """--no-calib-pack and --chat-template reach the sensitivity pass: it measured on the set
    (padded conversations under the template) that calibrated the quantization."""
    from helpers.eval_fixtures import byte_tokenizer

    tok = byte_tokenizer()
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    model = save_tiny_folder(tmp_path / "chat", tokenizer=tok)
    chats = tmp_path / "chat.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"and item {i}?"},
                                                       {"role": "assistant", "content": "so" * i}]}) + "\n"
                             for i in range(8)), encoding="utf-8")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}", encoding="utf-8")
    code, stdout, err = run(capsys, "quantize", model, "--target-bits", 6, "--candidates", "w4a16,w8a16",
                            "--calib", chats, "--no-calib-pack", "--chat-template", template, "--calib-samples", 8,
                            "--calib-seq-len", 32, "--reconstruct-iters", 0, "--output", tmp_path / "q", "--json")
    assert code == 0, err
    s = json.loads(stdout)
    auto, used = s["auto_recipe"], s["calibration"]
    assert (used["packing"], used["chat_template"], used["samples"]) == ("padded", str(template), 8)
    assert auto["calibration"] == used and auto["windows"] == [0, 2, 5, 7]
