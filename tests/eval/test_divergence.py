"""KL divergence, same top token and the paired perplexity change against a float reference:
equal to a brute-force float64 computation over the full vocabulary, exactly zero for a model
against itself, and refused on other tokens."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

from helpers.eval_fixtures import bos_byte_tokenizer, byte_tokenizer
from helpers.models import tiny_llama
from lowbit.eval import EvalDataError, tokenize_with_bytes, window_plan
from lowbit.eval.divergence import divergence, paired
from lowbit.eval.perplexity import score_text
from lowbit.eval.reference import float_reference
from lowbit.eval.scoring import chunked_divergence, kl_rows
from lowbit.textstart import bos_to_prepend, prepend

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
        "must be in want of a wife. However little known the feelings or views of such a man may be "
        "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
        "surrounding families, that he is considered the rightful property of some one or other of "
        "their daughters.")


def _noisy(model, scale: float, seed: int = 1):
    """A copy of ``model`` with every weight matrix perturbed: a stand-in for a quantized model."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=gen) * scale * p.abs().mean())
    return out


@torch.no_grad()
def _brute_force(ref_model, model, tok, window, stride, limit):
    """Per scored token, float64 over the whole vocabulary from each model's full logits."""
    ids, _ = tokenize_with_bytes(tok, TEXT)
    bos = bos_to_prepend(tok)
    prefix = 0 if bos is None else 1
    plan = window_plan(len(ids), window, stride or window - prefix, limit, prefix=prefix)
    kld, same, dnll = [], [], []
    for begin, end, n in plan:
        chunk = prepend(ids[begin:end], bos)[None]
        t = torch.arange(end - begin - n, end - begin) + prefix
        lp = torch.log_softmax(ref_model(chunk).logits[0].double(), -1)[t - 1]
        lq = torch.log_softmax(model(chunk).logits[0].double(), -1)[t - 1]
        tgt = chunk[0, t]
        kld.append((lp.exp() * (lp - lq)).sum(-1))
        same.append(lp.argmax(-1) == lq.argmax(-1))
        dnll.append(lp[torch.arange(n), tgt] - lq[torch.arange(n), tgt])
    return torch.cat(kld), torch.cat(same), torch.cat(dnll)


@pytest.mark.parametrize("bos,window,stride", [(False, 64, None), (True, 48, 16)])
def test_kld_and_agreement_equal_the_brute_force_computation(bos, window, stride):
    tok = bos_byte_tokenizer() if bos else byte_tokenizer()
    ref_model = tiny_llama()
    model = _noisy(ref_model, 0.3)
    opts = dict(window=window, stride=stride, limit=200, progress=False)
    ref = float_reference(ref_model, tok, TEXT, **opts)
    scores = score_text(model, tok, TEXT, reference=ref, **opts)
    kld, same, dnll = _brute_force(ref_model, model, tok, window, stride, 200)
    torch.testing.assert_close(scores.kld, kld, rtol=1e-4, atol=1e-6)
    d = divergence(scores)
    assert d.tokens == 200
    assert d.kld.estimate == pytest.approx(float(kld.mean()), rel=1e-4)
    assert d.kld.estimate > 1e-3  # the perturbation is visible: the comparison means something
    assert d.same_top.estimate == float(same.double().mean())
    assert d.same_top.estimate < 1.0
    assert d.ppl_change_pct.estimate == pytest.approx(100 * math.expm1(float(dnll.mean())), rel=1e-4)
    assert d.kld_percentiles["max"] == pytest.approx(float(kld.max()), rel=1e-4)
    assert d.kld_percentiles["p50"] == pytest.approx(float(kld.quantile(0.5)), rel=1e-4, abs=1e-6)
    assert d.kld_percentiles["p99"] == pytest.approx(float(kld.quantile(0.99)), rel=1e-4, abs=1e-6)
    assert d.kld.low < d.kld.estimate < d.kld.high
    # the model's own perplexity is the same with and without a reference
    alone = score_text(model, tok, TEXT, **opts)
    assert torch.equal(alone.logprob, scores.logprob) and torch.equal(alone.argmax, scores.argmax)


def test_a_model_against_itself_is_zero_divergence_and_full_agreement():
    tok, model = byte_tokenizer(), tiny_llama()
    ref = float_reference(model, tok, TEXT, window=64, limit=150, progress=False)
    scores = score_text(model, tok, TEXT, window=64, limit=150, reference=ref, progress=False)
    d = divergence(scores)
    assert d.kld.estimate == 0.0 and d.kld.high == 0.0 and d.kld_percentiles["max"] == 0.0
    assert d.same_top.estimate == 1.0 and d.ppl_change_pct.estimate == 0.0 and d.rms_delta_p == 0.0
    assert d.perplexity.estimate == pytest.approx(ref.result.perplexity, rel=1e-12)


def test_paired_comparison_separates_models_and_not_a_model_from_itself():
    tok, ref_model = byte_tokenizer(), tiny_llama()
    opts = dict(window=64, limit=250, progress=False)
    ref = float_reference(ref_model, tok, TEXT, **opts)
    small = score_text(_noisy(ref_model, 0.05), tok, TEXT, reference=ref, **opts)
    large = score_text(_noisy(ref_model, 0.5), tok, TEXT, reference=ref, **opts)
    p = paired(large, small)
    assert p["kld_difference"]["low"] > 0 and not p["within_noise"]
    assert paired(small, small)["within_noise"] and paired(small, small)["kld_difference"]["estimate"] == 0.0


def test_a_reference_of_other_tokens_is_refused():
    tok, model = byte_tokenizer(), tiny_llama()
    ref = float_reference(model, tok, TEXT, window=64, limit=100, progress=False)
    with pytest.raises(EvalDataError, match="other tokens"):
        score_text(model, tok, TEXT, window=32, limit=100, reference=ref, progress=False)
    with pytest.raises(EvalDataError, match="other tokens"):
        score_text(model, tok, TEXT[5:], window=64, limit=100, reference=ref, progress=False)


def test_chunked_divergence_keeps_both_heads_within_the_budget_and_applies_softcaps():
    torch.manual_seed(0)
    calls = []

    class Head(nn.Linear):
        def forward(self, h):
            calls.append(h.shape[0] * self.out_features)
            return super().forward(h)

    head, ref_head = Head(8, 300, bias=False), Head(16, 300, bias=False)
    h, rh = torch.randn(23, 8), torch.randn(23, 16)
    targets = torch.randint(0, 300, (23,))
    out = chunked_divergence(h, head, 3.0, targets, rh, ref_head, None, max_logits=1800)
    assert max(calls) <= 900  # two heads share the budget: 3 positions a chunk
    lq = torch.log_softmax(torch.tanh(head(h).double() / 3.0) * 3.0, -1)
    lp = torch.log_softmax(ref_head(rh).double(), -1)
    torch.testing.assert_close(out["kld"], (lp.exp() * (lp - lq)).sum(-1), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out["logprob"].double(), lq[torch.arange(23), targets], rtol=0, atol=1e-5)
    assert torch.equal(out["ref_argmax"], lp.argmax(-1))


def test_kl_rows_ignores_zero_probability_terms():
    ref = torch.log(torch.tensor([[0.5, 0.5, 0.0]]))
    q = torch.log(torch.tensor([[0.25, 0.25, 0.5]]))
    assert kl_rows(ref, q).item() == pytest.approx(math.log(2))


def test_a_saved_reference_measures_exactly_as_the_live_one(tmp_path):
    from lowbit.eval.reference import FloatReference

    tok, ref_model = byte_tokenizer(), tiny_llama()
    opts = dict(window=64, limit=150, progress=False)
    ref = float_reference(ref_model, tok, TEXT, **opts)
    path = ref.save(tmp_path / "ref.safetensors")
    back = FloatReference.load(path)
    assert back.text_sha256 == ref.text_sha256 and back.result == ref.result
    model = _noisy(ref_model, 0.2)
    live = score_text(model, tok, TEXT, reference=ref, **opts)
    read = score_text(model, tok, TEXT, reference=back, **opts)
    assert torch.equal(live.kld, read.kld) and torch.equal(live.ref_argmax, read.ref_argmax)
    back.check_plan(TEXT, 64, None, 150, str(path))
    with pytest.raises(EvalDataError, match="another evaluation text"):
        back.check_plan(TEXT + " more", 64, None, 150, str(path))
    with pytest.raises(EvalDataError, match="window 64"):
        back.check_plan(TEXT, 32, None, 150, str(path))
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(EvalDataError, match="bad.safetensors: cannot read"):
        FloatReference.load(tmp_path / "bad.safetensors")
