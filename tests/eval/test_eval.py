"""lowbit.eval: windows, chunked log-probabilities, perplexity, bits per byte, last-word accuracy."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from helpers.models import tiny_llama
from helpers.eval_fixtures import BigramLM, byte_tokenizer
from lowbit.eval import (EvalDataError, LastWordExample, chunked_logits_apply, lastword_accuracy,
                         lastword_examples, perplexity, read_paragraphs, tokenize_with_bytes, window_plan)
from lowbit.eval.text import default_calibration_text_path, default_eval_text_path

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
        "must be in want of a wife. However little known the feelings or views of such a man may be "
        "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
        "surrounding families, that he is considered the rightful property of some one or other of "
        "their daughters.")


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def test_window_plan_fixed_strided_and_limited():
    assert window_plan(10, 4, 4, None) == [(0, 4, 3), (4, 8, 3), (8, 10, 1)]
    # strided: every token but the first is scored exactly once
    plan = window_plan(10, 4, 2, None)
    assert plan == [(0, 4, 3), (2, 6, 2), (4, 8, 2), (6, 10, 2)]
    assert sum(n for *_, n in plan) == 9
    # limit cuts the last window short
    assert window_plan(10, 4, 4, 5) == [(0, 4, 3), (4, 7, 2)]
    assert window_plan(1, 4, 4, None) == []
    with pytest.raises(EvalDataError, match="stride"):
        window_plan(10, 4, 5, None)
    with pytest.raises(EvalDataError, match="window"):
        window_plan(10, 1, 1, None)


@torch.no_grad()
def _reference_nll(model, ids, plan):
    nll, n = 0.0, 0
    for begin, end, k in plan:
        logits = model(ids[None, begin:end]).logits[0].double()
        lp = torch.log_softmax(logits, -1)
        t = torch.arange(end - begin - k, end - begin)
        nll -= float(lp[t - 1, ids[begin:end][t]].sum())
        n += k
    return nll / n


@pytest.mark.parametrize("window,stride", [(32, None), (32, 8)])
def test_perplexity_matches_full_logits(tok, window, stride):
    model = tiny_llama()
    res = perplexity(model, tok, TEXT, window=window, stride=stride, limit=150, progress=False)
    ids, _ = tokenize_with_bytes(tok, TEXT)
    plan = window_plan(len(ids), window, stride or window, 150)
    ref = _reference_nll(model, ids, plan)
    assert res.tokens_scored == 150
    assert res.windows == len(plan)
    assert res.nll == pytest.approx(ref, rel=1e-5)
    assert res.perplexity == pytest.approx(math.exp(ref), rel=1e-5)
    # byte tokenizer on ASCII text: one byte per token
    assert res.bytes_scored == 150
    assert res.bits_per_byte == pytest.approx(ref / math.log(2), rel=1e-5)


def test_tokenize_with_bytes_counts_every_byte(tok):
    text = "Café — naïve ✓ done"
    ids, nbytes = tokenize_with_bytes(tok, text)
    assert int(nbytes.sum()) == len(text.encode("utf-8"))
    assert len(ids) == len(nbytes) == len(text.encode("utf-8"))


class _BudgetHead(nn.Module):
    """A head that fails if it is ever asked for more logits than the budget."""

    def __init__(self, lin, budget):
        super().__init__()
        self.lin, self.budget, self.calls = lin, budget, 0
        self.out_features = lin.out_features

    def forward(self, h):
        assert h.shape[0] * self.out_features <= self.budget
        self.calls += 1
        return self.lin(h)


def test_chunked_logits_respect_budget_and_match():
    torch.manual_seed(0)
    lin = nn.Linear(16, 1000, bias=False)
    h = torch.randn(37, 16)
    targets = torch.randint(0, 1000, (37,))
    full = torch.log_softmax(lin(h).double(), -1)
    head = _BudgetHead(lin, 5000)
    lp, arg = chunked_logits_apply(h, head, targets, max_logits=5000)
    assert head.calls == math.ceil(37 / 2)  # the budget holds a model's and a reference's logits together
    torch.testing.assert_close(lp.double(), full[torch.arange(37), targets], rtol=0, atol=1e-5)
    assert torch.equal(arg, full.argmax(-1))
    # soft-capping (Gemma) is applied before the softmax
    lp_cap, _ = chunked_logits_apply(h, lin, targets, softcap=2.0)
    capped = torch.log_softmax(torch.tanh(lin(h).double() / 2.0) * 2.0, -1)
    torch.testing.assert_close(lp_cap.double(), capped[torch.arange(37), targets], rtol=0, atol=1e-5)


def test_perplexity_chunk_size_does_not_change_result(tok):
    model = tiny_llama()
    a = perplexity(model, tok, TEXT, window=64, limit=100, progress=False)
    b = perplexity(model, tok, TEXT, window=64, limit=100, progress=False, max_logits=256 * 3)
    assert a.nll == pytest.approx(b.nll, rel=1e-6)


def test_lastword_examples_parsing():
    paras = [
        "one two three four five six seven eight nine ten, said Anne to her friend.",
        "one two three four five six seven eight nine ten ends with a number 42.",
        "too short friend.",
        "\"one two three four five six seven eight nine ten, it was quite settled,\" replied Mary.\"",
    ]
    ex = lastword_examples(paras, min_context_words=10)
    assert [e.word for e in ex] == ["friend", "Mary"]
    assert ex[0].context.endswith("to her")
    assert lastword_examples(paras, min_context_words=10, limit=1) == ex[:1]


def test_lastword_accuracy_counts_exact_greedy_matches(tok):
    lm = BigramLM()
    examples = [
        LastWordExample("the alphabet goes xyz", "abc"),     # z->' ', ' '->a, a->b, b->c: correct
        LastWordExample("the alphabet goes xyz", "abd"),     # last letter wrong
        LastWordExample("the alphabet goes xy", "abc"),      # y->z, not ' ': wrong at the space
        LastWordExample("no pattern here, just z", "abcdef"),  # correct, longer word
        LastWordExample("ends with q", "abc"),               # q->r: wrong
    ]
    res = lastword_accuracy(lm, tok, examples, batch_size=2, progress=False)
    assert res.examples == 5
    assert res.correct == 2
    assert res.accuracy == pytest.approx(0.4)
    # single-example batches give the same answer
    assert lastword_accuracy(lm, tok, examples, batch_size=1, progress=False).correct == 2


def test_lastword_batched_equals_unbatched_on_llama(tok):
    model = tiny_llama()
    paras = [f"{TEXT[: 60 + 13 * i]} and then came word{chr(97 + i)}" for i in range(5)]
    ex = [LastWordExample(p.rsplit(" ", 1)[0], p.rsplit(" ", 1)[1]) for p in paras]
    a = lastword_accuracy(model, tok, ex, batch_size=5, progress=False)
    b = lastword_accuracy(model, tok, ex, batch_size=1, progress=False)
    assert a.correct == b.correct
    assert a.mean_logprob == pytest.approx(b.mean_logprob, rel=1e-4)


def test_builtin_texts_are_shipped_and_disjoint():
    ev = read_paragraphs()
    assert default_eval_text_path().name == "evaluation.txt"
    assert sum(len(p) for p in ev) > 50_000
    assert any("Anne" in p for p in ev)  # Persuasion
    assert len(lastword_examples(ev)) >= 100
    cal = default_calibration_text_path()
    if cal.is_file():
        cal_paras = set(read_paragraphs(cal))
        assert not cal_paras & set(ev)


def test_missing_text_is_a_clear_error(tmp_path):
    with pytest.raises(EvalDataError, match="not found"):
        read_paragraphs(tmp_path / "nope.txt")
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(EvalDataError, match="no text"):
        read_paragraphs(tmp_path / "empty.txt")
