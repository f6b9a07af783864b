"""Calibration inputs as users bring them: JSONL, CSV, Parquet, datasets folders and objects,
cached dataset names, mixtures, chat templates, packing and padding, and every bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers.eval_fixtures import byte_tokenizer
from lowbit.calibration import CalibrationConfig, CalibrationError, CalibrationSource, calibration_set, calibration_tokens
from lowbit.calibration.windows import padded, shares, windows

CHATML = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# a template that knows only user and assistant turns, and says so
STRICT = ("{% for m in messages %}{% if m['role'] == 'user' %}U:{{ m['content'] }}\n"
          "{% elif m['role'] == 'assistant' %}A:{{ m['content'] }}\n"
          "{% else %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{% endfor %}")
# one that silently drops what it does not know
LOSSY = "{% for m in messages %}{% if m['role'] == 'user' %}U:{{ m['content'] }}\n{% endif %}{% endfor %}"


def chat_tok(template: str | None = CHATML):
    tok = byte_tokenizer()
    tok.chat_template = template
    return tok


def conv(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"question {i}?"},
                         {"role": "assistant", "content": f"answer number {i}."}]}


def rendered(i: int) -> str:
    return f"<|user|>question {i}?<|end|>\n<|assistant|>answer number {i}.<|end|>\n"


def as_bytes(ids: torch.Tensor) -> bytes:
    return bytes(ids.reshape(-1).tolist())


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------- inputs
def test_jsonl_conversations_render_with_the_models_template_and_pack(tmp_path):
    f = write_jsonl(tmp_path / "chat.jsonl", [conv(0), conv(1), conv(2)])
    cs = calibration_set(f, chat_tok(), num_samples=100, seq_len=16)
    text = "\n".join(rendered(i) for i in range(3)).encode()
    n = len(text) // 16
    assert cs.ids.shape == (n, 16) and cs.valid is None
    assert as_bytes(cs.ids) == text[:n * 16]  # packed: consecutive windows of the joined renders
    info = cs.info.as_dict()
    assert info["packing"] == "packed" and info["chat_template"] == "the model's own"
    assert info["samples"] == n and info["tokens"] == n * 16
    assert info["sources"] == [{"source": str(f), "kind": "jsonl", "weight": 1.0, "samples": 3, "conversations": 3,
                                "windows": n, "tokens": n * 16}]


def test_jsonl_text_field_and_column(tmp_path):
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": "abcdefgh", "body": "12345678"}, {"text": "ijklmnop", "body": "x"}])
    assert as_bytes(calibration_tokens(f, byte_tokenizer(), num_samples=10, seq_len=4)) == b"abcdefgh\nijklmno"
    cs = calibration_set(f, byte_tokenizer(), num_samples=10, seq_len=4, column="body")
    assert as_bytes(cs.ids) == b"12345678"


def test_padded_windows_one_per_sample_with_a_mask(tmp_path):
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": "a" * 3}, {"text": "b" * 30}, {"text": "c" * 7}])
    tok = byte_tokenizer()  # pad: its eos (id 0)
    cs = calibration_set(f, tok, num_samples=10, seq_len=10, pack=False)
    assert cs.ids.shape == (3, 10)
    assert cs.valid.sum(1).tolist() == [3, 10, 7]
    assert as_bytes(cs.ids[0, :3]) == b"aaa" and cs.ids[0, 3:].tolist() == [0] * 7
    assert as_bytes(cs.ids[1]) == b"b" * 10  # cut at seq_len
    assert cs.info.packing == "padded" and cs.info.tokens == 20 and cs.info.seq_len == 10
    short = calibration_set(f, tok, num_samples=10, seq_len=64, pack=False)
    assert short.ids.shape == (3, 30)  # padded to the longest sample, not to seq_len
    with pytest.raises(CalibrationError, match="padded calibration windows"):
        calibration_tokens(f, tok, num_samples=10, seq_len=10, pack=False)


def test_padding_and_packing_start_like_the_tokenizer():
    ids, valid = padded([[5, 6], [7]], 4, 4, bos=1, pad_id=9)
    assert ids.tolist() == [[1, 5, 6], [1, 7, 9]] and valid.tolist() == [[True] * 3, [True, True, False]]
    assert windows(torch.arange(10), 2, 4, bos=1).tolist() == [[1, 0, 1, 2], [1, 6, 7, 8]]
    assert shares([3, 1], 4) == [3, 1] and shares([1, 1, 1], 4) == [2, 1, 1] and shares([1], 7) == [7]


def test_csv_and_parquet_tables(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text('id,text\n1,abcdefgh\n2,"ij,klmnop"\n', encoding="utf-8")
    assert as_bytes(calibration_tokens(f, byte_tokenizer(), num_samples=10, seq_len=4)) == b"abcdefgh\nij,klmn"  # 18 bytes: 4 windows
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    p = tmp_path / "c.parquet"
    pq.write_table(pa.table({"conversation": [conv(0)["messages"], conv(1)["messages"]], "n": [0, 1]}), p)
    cs = calibration_set(p, chat_tok(), num_samples=100, seq_len=8, column="conversation")
    joined = (rendered(0) + "\n" + rendered(1)).encode()
    assert as_bytes(cs.ids) == joined[: len(joined) // 8 * 8]
    assert cs.info.sources[0].kind == "parquet" and cs.info.sources[0].conversations == 2


def test_datasets_object_folder_and_cache(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    rows = [conv(0), conv(1)]
    ds = datasets.Dataset.from_list(rows)
    want = (rendered(0) + "\n" + rendered(1)).encode()
    want = want[: len(want) // 8 * 8]
    tok = chat_tok()
    assert as_bytes(calibration_set(ds, tok, num_samples=100, seq_len=8).ids) == want
    ds.save_to_disk(str(tmp_path / "saved"))
    assert as_bytes(calibration_set(tmp_path / "saved", tok, num_samples=100, seq_len=8).ids) == want
    dd = datasets.DatasetDict({"train_sft": ds, "test_sft": ds.select([0])})
    dd.save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(CalibrationError, match="pick a split .*train_sft, test_sft"):
        calibration_set(tmp_path / "dict", tok, num_samples=100, seq_len=8)
    one = calibration_set(tmp_path / "dict", tok, num_samples=100, seq_len=8, split="test_sft")
    assert as_bytes(one.ids) == rendered(0).encode()[: len(rendered(0)) // 8 * 8]
    # a dataset name found in the local datasets cache (prepared once, as load_dataset leaves it)
    cache = tmp_path / "cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    jsonl = write_jsonl(tmp_path / "src.jsonl", rows)
    b = datasets.load_dataset_builder("json", data_files={"train": str(jsonl)}, cache_dir=str(cache))
    b.download_and_prepare()
    built = Path(b.cache_dir)  # cache/json/default-<hash>/0.0.0/<hash>
    named = cache / "me___chat" / "default" / built.parent.name / built.name
    named.parent.mkdir(parents=True)
    built.rename(named)
    (named / "json-train.arrow").rename(named / "chat-train.arrow")
    cached = calibration_set("me/chat", tok, num_samples=100, seq_len=8)
    assert as_bytes(cached.ids) == want and cached.info.sources[0].kind == "cached dataset"
    with pytest.raises(CalibrationError, match="'me/other' is no local file or folder, and no dataset of that name "
                                               "is in the local datasets cache"):
        calibration_set("me/other", tok)


def test_weighted_mixture(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": "a" * 100}])
    b = tmp_path / "b.txt"
    b.write_text("b" * 100 + "\n", encoding="utf-8")
    cs = calibration_set([CalibrationSource(a, weight=3), CalibrationSource(b, weight=1)], byte_tokenizer(),
                         num_samples=8, seq_len=4)
    assert [as_bytes(w) for w in cs.ids] == [b"aaaa"] * 6 + [b"bbbb"] * 2
    assert [(s.windows, s.tokens) for s in cs.info.sources] == [(6, 24), (2, 8)]
    mixed = calibration_set([CalibrationSource(a), CalibrationSource(["bb"])], byte_tokenizer(), num_samples=2,
                            seq_len=8, pack=False)
    assert mixed.valid.sum(1).tolist() == [8, 2]  # the short source padded to the common width
    with pytest.raises(CalibrationError, match="gets none of the 2 windows"):
        calibration_set([CalibrationSource(a, 10), CalibrationSource(b, 1), CalibrationSource(b, 1)],
                        byte_tokenizer(), num_samples=2, seq_len=4)
    with pytest.raises(CalibrationError, match="weight must be a positive number"):
        CalibrationSource(a, weight=0)


def test_template_choices(tmp_path):
    f = write_jsonl(tmp_path / "c.jsonl", [conv(0)])
    plain = calibration_set(f, chat_tok(None), num_samples=9, seq_len=4, chat_template="none")
    assert as_bytes(plain.ids) == b"question 0?\nanswer number 0."[:28]
    assert plain.info.chat_template == "none (message contents only)"
    tf = tmp_path / "t.jinja"
    tf.write_text(STRICT, encoding="utf-8")
    own = calibration_set(f, chat_tok(None), num_samples=9, seq_len=4, chat_template=str(tf))
    assert as_bytes(own.ids) == b"U:question 0?\nA:answer number 0.\n"[:32] and own.info.chat_template == str(tf)
    # a template that puts the BOS text first: the window adds BOS itself (not doubled)
    tok = chat_tok("{{ bos_token }}" + CHATML)
    tok.bos_token = "\x07"
    assert as_bytes(calibration_set(f, tok, num_samples=99, seq_len=4).ids).startswith(b"<|user|>")


# ---------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("lines, match", [
    (['{"text": "ok"}', '{"text": "broken'], r"bad\.jsonl:2:\d+: not JSON"),
    (['{"text": "ok"}', '{"body": "x"}'], r"bad\.jsonl:2: no 'text' field"),
    (['{"other": "x"}'], r"bad\.jsonl:1: no 'text' or 'messages' column"),
    (['[1, 2]'], r"bad\.jsonl:1: a line must be a JSON object"),
    (['{"messages": [{"role": "user"}]}'], r"bad\.jsonl:1: 'messages': message 0 needs a string 'content'"),
    (['{"messages": []}'], r"bad\.jsonl:1: 'messages': the conversation has no messages"),
    (['{"text": 3}'], r"bad\.jsonl:1: 'text' must be a string or a list"),
    (['', '{"text": "  "}'], r"'.*bad\.jsonl' has no samples"),
])
def test_bad_jsonl(tmp_path, lines, match):
    f = tmp_path / "bad.jsonl"
    f.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(CalibrationError, match=match):
        calibration_set(f, chat_tok())


def test_bad_sources(tmp_path):
    tok = chat_tok()
    (tmp_path / "x.pdf").write_bytes(b"%PDF")
    with pytest.raises(CalibrationError, match=r"lowbit does not read '\.pdf' files"):
        calibration_set(tmp_path / "x.pdf", tok)
    with pytest.raises(CalibrationError, match="not found: it does not exist"):
        calibration_set(tmp_path / "missing.jsonl", tok)
    with pytest.raises(CalibrationError, match=r"is not a file path \(give text as a list of strings"):
        calibration_set("It was a truth universally acknowledged. " * 20, tok)  # a text, not a path
    (tmp_path / "empty.csv").write_text("text\n", encoding="utf-8")
    with pytest.raises(CalibrationError, match="has no samples"):
        calibration_set(tmp_path / "empty.csv", tok)
    (tmp_path / "t.csv").write_text("a,b\n1,2\n", encoding="utf-8")
    with pytest.raises(CalibrationError, match=r"t\.csv: no column 'body' \(columns: a, b\)"):
        calibration_set(tmp_path / "t.csv", tok, column="body")
    (tmp_path / "plain").mkdir()
    with pytest.raises(CalibrationError, match="not a folder saved by datasets' save_to_disk"):
        calibration_set(tmp_path / "plain", tok)
    datasets = pytest.importorskip("datasets")
    with pytest.raises(CalibrationError, match="has no rows"):
        calibration_set(datasets.Dataset.from_dict({"text": []}), tok)
    with pytest.raises(CalibrationError, match=r"Dataset: no column 'body'"):
        calibration_set(datasets.Dataset.from_dict({"text": ["x"]}), tok, column="body")


def test_conversations_the_template_cannot_render(tmp_path):
    odd = write_jsonl(tmp_path / "c.jsonl", [conv(0), {"messages": [{"role": "tool", "content": "42"}]}])
    with pytest.raises(CalibrationError, match=r"c\.jsonl:2: 'messages': the chat template refused the conversation "
                                               r"\(roles tool\): unknown role tool"):
        calibration_set(odd, chat_tok(STRICT))
    with pytest.raises(CalibrationError, match=r"c\.jsonl:1: 'messages': the chat template left out message 1 "
                                               r"\(role 'assistant'\)"):
        calibration_set(odd, chat_tok(LOSSY))
    with pytest.raises(CalibrationError, match=r"c\.jsonl:1: .*needs a chat template and the tokenizer has none"):
        calibration_set(odd, chat_tok(None))
    with pytest.raises(CalibrationError, match="chat template file .*not found"):
        CalibrationConfig(chat_template=str(tmp_path / "none.jinja"))
