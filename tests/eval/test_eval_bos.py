"""Windows start the way the tokenizer starts a text: BOS first when it adds one by default
(perplexity, last-word contexts, calibration windows, the reports), nothing otherwise, with the
numbers of a tokenizer without BOS exactly as they were."""

from __future__ import annotations

import json
import math

import pytest
import torch

from helpers.models import tiny_llama
from helpers.eval_fixtures import BOS_ID, bos_byte_tokenizer, byte_tokenizer, save_tiny_folder
from lowbit.calibration import calibration_tokens
from lowbit.eval import EvalDataError, LastWordExample, lastword_accuracy, perplexity, tokenize_with_bytes, window_plan
from lowbit.eval.lastword import encode_example
from lowbit.textstart import bos_to_prepend

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
        "must be in want of a wife. However little known the feelings or views of such a man may be "
        "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
        "surrounding families.")


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def bos_tok():
    return bos_byte_tokenizer()


def test_bos_is_found_only_where_the_tokenizer_adds_it(tok, bos_tok):
    assert bos_tok("ab")["input_ids"] == [BOS_ID, 97, 98]
    assert bos_to_prepend(bos_tok) == BOS_ID
    assert bos_to_prepend(tok) is None
    # a BOS token the tokenizer does not put in front by default is not prepended
    from transformers import PreTrainedTokenizerFast
    named_only = PreTrainedTokenizerFast(tokenizer_object=byte_tokenizer().backend_tokenizer, eos_token=chr(256),
                                         bos_token=chr(256 + BOS_ID))
    assert named_only.bos_token_id == BOS_ID and bos_to_prepend(named_only) is None
    assert bos_to_prepend(lambda text: [1, 2, 3]) is None  # a plain callable


def test_window_plan_with_bos_scores_every_text_token():
    # BOS + 3 text tokens per window of 4: each window's first text token is scored from the BOS
    plan = window_plan(10, 4, 3, None, prefix=1)
    assert plan == [(0, 3, 3), (3, 6, 3), (6, 9, 3), (9, 10, 1)]
    assert sum(n for *_, n in plan) == 10
    assert window_plan(10, 4, 2, None, prefix=1) == [(0, 3, 3), (2, 5, 2), (4, 7, 2), (6, 9, 2), (8, 10, 1)]
    assert window_plan(10, 4, 3, 5, prefix=1) == [(0, 3, 3), (3, 5, 2)]
    assert window_plan(1, 4, 3, None, prefix=1) == [(0, 1, 1)]
    with pytest.raises(EvalDataError, match=r"stride must be in \[1, 3\].*BOS"):
        window_plan(10, 4, 4, None, prefix=1)
    assert window_plan(10, 4, 4, None) == [(0, 4, 3), (4, 8, 3), (8, 10, 1)]  # no prefix: as before


def _seen_windows(model):
    seen = []
    model.model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(args[0].clone()))
    return seen


@torch.no_grad()
def _reference(model, ids, window, limit, bos):
    """Non-overlapping windows from full logits: [bos] + window - 1 text tokens, all scored; or
    window text tokens, the first unscored."""
    span = window - (bos is not None)
    nll, n, chunks = 0.0, 0, []
    for begin in range(0, len(ids), span):
        text = ids[begin:begin + span]
        inp = text if bos is None else torch.cat([torch.tensor([bos]), text])
        lp = torch.log_softmax(model(inp[None]).logits[0].double(), -1)
        for t in range(1, len(inp)):
            if n == limit:
                break
            nll -= float(lp[t - 1, inp[t]])
            n += 1
        chunks.append(inp)
        if n == limit:
            break
    return nll / n, n, chunks


@pytest.mark.parametrize("with_bos", [True, False])
def test_perplexity_windows_start_like_the_tokenizer(tok, bos_tok, with_bos):
    t = bos_tok if with_bos else tok
    model = tiny_llama()
    res = perplexity(model, t, TEXT, window=32, limit=100, progress=False)
    ids, _ = tokenize_with_bytes(t, TEXT)
    ref_nll, ref_n, ref_chunks = _reference(model, ids, 32, 100, BOS_ID if with_bos else None)
    assert res.bos_prepended is with_bos and res.to_dict()["bos_prepended"] is with_bos
    assert res.tokens_scored == ref_n == 100
    assert res.nll == pytest.approx(ref_nll, rel=1e-6)
    assert res.perplexity == pytest.approx(math.exp(ref_nll), rel=1e-6)
    assert res.window == 32 and res.stride == (31 if with_bos else 32) and res.windows == len(ref_chunks)


def test_windows_fed_to_the_model_start_with_bos_only_for_a_bos_tokenizer(tok, bos_tok):
    model = tiny_llama()
    for t, bos in ((bos_tok, BOS_ID), (tok, None)):
        seen = _seen_windows(model)
        res = perplexity(model, t, TEXT, window=32, limit=90, progress=False)
        ids, _ = tokenize_with_bytes(t, TEXT)
        assert len(seen) == res.windows == 3
        for w in seen:
            assert w.shape[1] <= 32
        if bos is None:
            assert [int(w[0, 0]) for w in seen] == [int(ids[0]), int(ids[32]), int(ids[64])]
            assert torch.equal(torch.cat([w[0] for w in seen]), ids[:sum(w.shape[1] for w in seen)])
        else:
            assert all(int(w[0, 0]) == BOS_ID for w in seen)
            assert torch.equal(torch.cat([w[0, 1:] for w in seen]), ids[:sum(w.shape[1] - 1 for w in seen)])
        model.model.embed_tokens._forward_hooks.clear()


def test_perplexity_without_bos_is_unchanged(tok):
    """The numbers of a tokenizer without BOS are those of the plan lowbit always used (windows of
    ``window`` text tokens, stride = window, each window's first token unscored)."""
    model = tiny_llama()
    ids, _ = tokenize_with_bytes(tok, TEXT)
    for window, stride in ((32, None), (32, 8)):
        res = perplexity(model, tok, TEXT, window=window, stride=stride, limit=150, progress=False)
        plan = window_plan(len(ids), window, stride or window, 150)
        nll = 0.0
        with torch.no_grad():
            for begin, end, k in plan:
                lp = torch.log_softmax(model(ids[None, begin:end]).logits[0].double(), -1)
                t = torch.arange(end - begin - k, end - begin)
                nll -= float(lp[t - 1, ids[begin:end][t]].sum())
        assert res.tokens_scored == 150 and not res.bos_prepended
        assert res.nll == pytest.approx(nll / 150, rel=1e-6)


def test_lastword_context_starts_with_bos(tok, bos_tok):
    ex = LastWordExample("the quick brown fox jumps over the lazy", "dog")
    ids, n = encode_example(bos_tok, ex, 12, bos_to_prepend(bos_tok))
    assert ids[0] == BOS_ID and n == 4 and len(ids) == 12 + 4
    assert ids[1:] == bos_tok(ex.context + " dog", add_special_tokens=False)["input_ids"][-15:]
    plain, n0 = encode_example(tok, ex, 12)
    assert plain == tok(ex.context + " dog", add_special_tokens=False)["input_ids"][-16:] and n0 == 4
    with pytest.raises(EvalDataError, match="max_context_tokens must be at least 2"):
        encode_example(bos_tok, ex, 1, BOS_ID)
    model = tiny_llama()
    a = lastword_accuracy(model, bos_tok, [ex], progress=False)
    b = lastword_accuracy(model, tok, [ex], progress=False)
    assert a.bos_prepended and not b.bos_prepended and a.to_dict()["bos_prepended"]
    assert a.mean_logprob != b.mean_logprob  # the BOS changes what the model sees


def test_calibration_windows_start_with_bos(tok, bos_tok):
    texts = [TEXT, TEXT.upper()]
    ids = torch.tensor(tok("\n".join(texts), add_special_tokens=False)["input_ids"])
    plain = calibration_tokens(texts, tok, num_samples=100, seq_len=16)
    n = ids.numel() // 16
    assert torch.equal(plain, ids[:n * 16].reshape(n, 16))  # as before: no BOS
    with_bos = calibration_tokens(texts, bos_tok, num_samples=100, seq_len=16)
    m = ids.numel() // 15
    assert with_bos.shape == (m, 16) and bool((with_bos[:, 0] == BOS_ID).all())
    assert torch.equal(with_bos[:, 1:], ids[:m * 15].reshape(m, 15))
    few = calibration_tokens(texts, bos_tok, num_samples=3, seq_len=16)
    assert few.shape == (3, 16) and bool((few[:, 0] == BOS_ID).all())
    given = torch.arange(32).reshape(2, 16)
    assert torch.equal(calibration_tokens(given, bos_tok), given)  # token ids are used as given


def _cli(*args):
    from lowbit.cli import main

    try:
        main([str(a) for a in args])
    except SystemExit as e:
        assert not e.code


def test_reports_state_whether_bos_was_prepended(capsys, tmp_path):
    text = tmp_path / "eval.txt"
    text.write_text("\n".join(f"{TEXT} and then the {w}." for w in ("garden", "letter", "evening")))
    folders = {True: save_tiny_folder(tmp_path / "bos", tokenizer=bos_byte_tokenizer()),
               False: save_tiny_folder(tmp_path / "plain")}
    for with_bos, folder in folders.items():
        _cli("eval", folder, "--text", text, "--limit", 40, "--window", 32, "--lastword", 2, "--json", "--no-progress")
        rep = json.loads(capsys.readouterr().out)["model"]
        assert rep["bos_prepended"] is with_bos and rep["lastword"]["bos_prepended"] is with_bos
        assert rep["tokens_scored"] == 40 and rep["stride"] == (31 if with_bos else 32)
    _cli("compare", folders[True], "--schemes", "w8a16", "--text", text, "--limit", 30, "--window", 32,
         "--lastword", 0, "-o", tmp_path / "rep", "--json", "--no-progress")
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert rep["float"]["bos_prepended"] is True and rep["schemes"][0]["bos_prepended"] is True
