"""The figures of one model on the evaluation text, as report fields: perplexity, its interval
and float-rounding spread, last-word accuracy with its Wilson interval, and, against the float
reference, KL divergence, same-top-token share and the paired perplexity change
(``lowbit.eval.divergence``); and which rows are within noise of each other.

``lowbit compare`` and ``lowbit eval --baseline`` both report through ``measure``: one set of
field names in every report.json.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from lowbit.eval.divergence import divergence, paired, perplexity_interval
from lowbit.eval.intervals import DEFAULT_BLOCKS, LEVEL
from lowbit.eval.lastword import lastword_accuracy
from lowbit.eval.perplexity import TextScores, score_text
from lowbit.eval.reference import FloatReference, text_sha256
from lowbit.eval.spread import measure_spread
from lowbit.eval.text import read_text

INTERVALS = {"level": LEVEL, "blocks": DEFAULT_BLOCKS,
             "method": "per-token means: batch means over contiguous blocks of scored tokens, Student's t; "
                       "perplexity change and differences between models: paired, on the same tokens; "
                       "last-word accuracy: Wilson score interval"}


@dataclass(frozen=True)
class EvalSettings:
    """Where and how much to evaluate (the same for every model of one report)."""

    text_file: str | None = None
    window: int = 512
    stride: int | None = None
    limit: int | None = None
    lastword_context: int = 128
    spread: int = 0
    progress: bool = True


def measure(model, tokenizer, settings: EvalSettings, examples, label: str, *,
            reference: FloatReference | None = None, keep_reference: bool = False,
            ) -> tuple[dict, TextScores | FloatReference]:
    """Report fields of ``model`` and its per-token scores (the FloatReference instead when
    ``keep_reference``: the float model's, for the other models to be measured against)."""
    t0 = time.perf_counter()
    s = settings
    text = read_text(s.text_file)  # read once: scored, perturbed for the spread, hashed for a reference
    scores = score_text(model, tokenizer, text, window=s.window, stride=s.stride, limit=s.limit,
                        reference=reference, keep_hidden=keep_reference, progress=s.progress,
                        desc=f"{label}: perplexity")
    ppl = scores.result
    out = {"perplexity": ppl.perplexity, "perplexity_interval": perplexity_interval(scores).to_dict(),
           "bits_per_byte": ppl.bits_per_byte, "nll": ppl.nll, "tokens_scored": ppl.tokens_scored,
           "bytes_scored": ppl.bytes_scored, "windows": ppl.windows, "window": ppl.window, "stride": ppl.stride,
           "bos_prepended": ppl.bos_prepended}
    if reference is not None:
        d = divergence(scores)
        out.update(kld=d.kld.to_dict(), kld_percentiles=d.kld_percentiles, same_top=d.same_top.to_dict(),
                   ppl_change_pct=100.0 * (ppl.perplexity / reference.result.perplexity - 1.0),
                   ppl_change_interval=d.ppl_change_pct.to_dict(), rms_delta_p=d.rms_delta_p)
    sp = measure_spread(model, tokenizer, ppl.perplexity, seeds=s.spread, text=text,
                        window=s.window, stride=s.stride, limit=s.limit)
    if sp is not None:
        out["ppl_spread"] = sp
    if examples:
        lw = lastword_accuracy(model, tokenizer, examples, max_context_tokens=s.lastword_context,
                               progress=s.progress, desc=f"{label}: last word")
        out.update(lastword_accuracy=lw.accuracy, lastword_correct=lw.correct, lastword_examples=lw.examples,
                   lastword_logprob=lw.mean_logprob, lastword_interval=lw.interval.to_dict())
    out["eval_seconds"] = time.perf_counter() - t0
    if keep_reference:
        ref = FloatReference.of(scores, model)
        ref.text_sha256, ref.fields = text_sha256(text), out
        return out, ref
    scores.hidden = None
    return out, scores


def noise_pairs(scores: dict[str, TextScores]) -> list[dict]:
    """Every pair of models scored against one reference: ``lowbit.eval.divergence.paired``'s
    fields with the two labels (``a`` before ``b`` in the given order)."""
    labels = list(scores)
    return [{"a": a, "b": b, **paired(scores[a], scores[b])}
            for i, a in enumerate(labels) for b in labels[i + 1:]]


def within_noise_of(pairs: list[dict], label: str) -> list[str]:
    """The labels whose paired KLD interval with ``label`` contains zero."""
    return [p["b"] if p["a"] == label else p["a"] for p in pairs
            if label in (p["a"], p["b"]) and p["within_noise"]]
