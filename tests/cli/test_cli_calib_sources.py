"""``--calib`` as users bring it (JSONL conversations, mixtures, padding, chat templates), what
the summary and report.json say about it, and each bad input as one error line, nothing written."""

from __future__ import annotations

import json

import pytest

from helpers.cli import assert_one_error, leftovers, run
from helpers.eval_fixtures import byte_tokenizer, save_tiny_folder

CHATML = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
STRICT = ("{% for m in messages %}{% if m['role'] == 'user' %}U:{{ m['content'] }}\n"
          "{% elif m['role'] == 'assistant' %}A:{{ m['content'] }}\n"
          "{% else %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    tok = byte_tokenizer()
    tok.chat_template = CHATML
    return save_tiny_folder(tmp_path_factory.mktemp("chat") / "model", tokenizer=tok)


def conversations(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"Tell me about item {i}, please."},
                          {"role": "assistant", "content": f"Item {i} is a fine item with {i} parts."}]}
            for i in range(n)]


@pytest.fixture
def chat_jsonl(tmp_path):
    f = tmp_path / "chat.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in conversations(12)), encoding="utf-8")
    return f


def quantize(capsys, model, out, *args):
    return run(capsys, "quantize", model, "--scheme", "w8a8-int8", "--output", out, "--calib-samples", 4,
               "--calib-seq-len", 32, *args)


@pytest.mark.parametrize("where", ["streamed", "in-memory"])
def test_quantize_on_chat_jsonl_says_what_it_used(capsys, chat_model, chat_jsonl, tmp_path, where):
    extra = ["--in-memory"] if where == "in-memory" else []
    code, out, err = quantize(capsys, chat_model, tmp_path / "q", "--calib", chat_jsonl, *extra, "--json")
    assert code == 0, err
    cal = json.loads(out)["calibration"]
    assert (cal["samples"], cal["seq_len"], cal["tokens"]) == (4, 32, 128)
    assert (cal["packing"], cal["chat_template"]) == ("packed", "the model's own")
    assert cal["sources"] == [{"source": str(chat_jsonl), "kind": "jsonl", "weight": 1.0, "samples": 12,
                               "conversations": 12, "windows": 4, "tokens": 128}]
    code, out, err = quantize(capsys, chat_model, tmp_path / "q2", "--calib", chat_jsonl, *extra)
    assert code == 0, err
    said = " ".join(out.split())  # the console wraps long lines
    assert "calibrated on " in said and "chat.jsonl" in said
    assert ("(jsonl, 12 samples, 12 conversations: 4 windows): 4 windows of up to 32 tokens, 128 tokens counted, "
            "packed, chat template: the model's own") in said


def test_quantize_mixture_padding_and_template_file(capsys, chat_model, chat_jsonl, tmp_path):
    prose = tmp_path / "prose.txt"
    prose.write_text("A paragraph of plain prose, long enough for a window or two of tokens.\n" * 4, encoding="utf-8")
    code, out, err = quantize(capsys, chat_model, tmp_path / "mix", "--calib", chat_jsonl, "--calib", prose,
                              "--calib-weights", "3,1", "--json")
    assert code == 0, err
    cal = json.loads(out)["calibration"]
    assert [(s["kind"], s["weight"], s["windows"]) for s in cal["sources"]] == [("jsonl", 3.0, 3), ("text file", 1.0, 1)]
    tf = tmp_path / "strict.jinja"
    tf.write_text(STRICT, encoding="utf-8")
    code, out, err = quantize(capsys, chat_model, tmp_path / "pad", "--calib", chat_jsonl, "--no-calib-pack",
                              "--chat-template", tf, "--json")
    assert code == 0, err
    cal = json.loads(out)["calibration"]
    lengths = sorted(len(f"U:Tell me about item {i}, please.\nA:Item {i} is a fine item with {i} parts.\n")
                     for i in (0, 4, 7, 11))  # 4 of 12 samples, evenly spaced, cut at 32 tokens
    assert cal["packing"] == "padded" and cal["chat_template"] == str(tf)
    assert cal["tokens"] == sum(min(n, 32) for n in lengths) == 128  # every sample is longer than a window
    code, out, err = quantize(capsys, chat_model, tmp_path / "none", "--calib", chat_jsonl, "--chat-template", "none",
                              "--json")
    assert code == 0, err and json.loads(out)["calibration"]["chat_template"] == "none (message contents only)"


def test_compare_report_names_the_calibration(capsys, chat_model, chat_jsonl, tmp_path):
    text = tmp_path / "eval.txt"
    text.write_text("Some held-out text to score, one paragraph a line.\n" * 6, encoding="utf-8")
    code, out, err = run(capsys, "compare", chat_model, "--schemes", "w8a8-int8", "--text", text, "--calib",
                         chat_jsonl, "--calib-samples", 4, "--calib-seq-len", 32, "--no-calib-pack", "--limit", 30,
                         "--window", 32, "--lastword", 0, "--spread", 0, "-o", tmp_path / "rep", "--json",
                         "--no-progress")
    assert code == 0, err
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    data = rep["schemes"][0]["calibration_data"]
    assert data == rep["calibration_data"]
    assert (data["packing"], data["chat_template"], data["samples"]) == ("padded", "the model's own", 4)
    assert data["sources"][0]["source"] == str(chat_jsonl) and data["sources"][0]["conversations"] == 12
    assert rep["options"]["calib"] == str(chat_jsonl) and rep["options"]["calib_options"] == {"pack": False}


BAD = {
    "not-json": ('{"text": "fine"}\n{"text": "cut\n', r"bad.jsonl:2:"),
    "missing-field": ('{"text": "fine"}\n{"body": "x"}\n', "bad.jsonl:2: no 'text' field"),
    "empty": ("\n\n", "has no samples"),
    "roles": (json.dumps({"messages": [{"role": "tool", "content": "42"}]}) + "\n",
              "the chat template refused the conversation"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_calibration_file_is_one_error_nothing_written(capsys, chat_model, tmp_path, case):
    text, names = BAD[case]
    f = tmp_path / "bad.jsonl"
    f.write_text(text, encoding="utf-8")
    tf = tmp_path / "strict.jinja"
    tf.write_text(STRICT, encoding="utf-8")
    for extra in ([], ["--in-memory"]):
        out = tmp_path / f"q{len(extra)}"
        code, _, err = quantize(capsys, chat_model, out, "--calib", f, "--chat-template", tf, *extra)
        assert_one_error(code, err, names)
        assert leftovers(out) == []


@pytest.mark.parametrize("args, names", [
    (["--calib", "{dir}/x.pdf"], ["lowbit does not read '.pdf' files"]),
    (["--calib", "{dir}/t.csv", "--calib-column", "body"], ["t.csv: no column 'body'"]),
    (["--calib", "{dir}/t.csv", "--calib", "builtin", "--calib-weights", "1"], ["--calib-weights gives 1 weights"]),
    (["--calib", "{dir}/t.csv", "--calib-weights", "x"], ["--calib-weights must be comma-separated numbers"]),
    (["--calib", "{dir}/t.csv", "--chat-template", "{dir}/missing.jinja"], ["chat template file", "not found"]),
    (["--calib", "{dir}/nosuchdir/data"], ["not found: it does not exist"]),
    (["--calib", "someone/no-such-dataset"], ["no local file or folder", "local datasets cache"]),
])
def test_bad_calibration_options(capsys, chat_model, tmp_path, args, names):
    (tmp_path / "x.pdf").write_bytes(b"%PDF")
    (tmp_path / "t.csv").write_text("a,b\n1,2\n", encoding="utf-8")
    out = tmp_path / "q"
    code, _, err = quantize(capsys, chat_model, out, *[a.format(dir=tmp_path) for a in args])
    assert_one_error(code, err, *names)
    assert leftovers(out) == []


def test_model_free_takes_no_calibration_data_options(capsys, chat_model, tmp_path):
    code, _, err = run(capsys, "quantize", chat_model, "--scheme", "w8a16", "--model-free", "--output", tmp_path / "m",
                       "--chat-template", "none")
    assert_one_error(code, err, "--model-free takes no calibration", "--chat-template")
