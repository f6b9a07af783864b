"""Perplexity and last-word accuracy scored by an inference engine instead of lowbit's model.

The windows, start tokens, scored positions, byte counts and examples are exactly those of
``lowbit.eval.perplexity`` and ``lowbit.eval.lastword`` (same plan, same tokenizer calls), so the
results are the same report fields, comparable number for number with lowbit's own evaluation;
only the log-probabilities (and argmaxes) come from ``score``: a function from a list of token-id
prompts to, per prompt, (log p(ids[t] | ids[:t]), ids[t] is the argmax) for t >= 1
(e.g. ``lowbit.engines.run_vllm``'s prompt log-probabilities). All prompts go in one call.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from lowbit.eval.lastword import LastWordExample, LastWordResult, encode_example, lastword_examples
from lowbit.eval.perplexity import PerplexityResult, windows_of
from lowbit.eval.text import EvalDataError, read_paragraphs, read_text

Scorer = Callable[[list[list[int]]], tuple[list[list[float]], list[list[bool]]]]


def perplexity_prompts(tokenizer, text: str, window: int, stride: int | None, limit: int | None):
    """(prompts, [(first scored prompt position, n scored, bytes)], stride, bos) of lowbit's plan."""
    ids, nbytes, plan, stride, bos = windows_of(tokenizer, text, window, stride, limit)
    prefix = 0 if bos is None else 1
    prompts, spans = [], []
    for begin, end, n in plan:
        prompts.append(([] if bos is None else [bos]) + ids[begin:end].tolist())
        spans.append((end - begin - n + prefix, n, int(nbytes[end - n:end].sum())))
    return prompts, spans, stride, bos


def engine_report(score: Scorer, tokenizer, *, text: str | None = None, text_file=None, window: int = 512,
                  stride: int | None = None, limit: int | None = None, lastword: int = 0,
                  examples: Sequence[LastWordExample] | None = None, max_context_tokens: int = 128,
                  ) -> tuple[PerplexityResult, LastWordResult | None]:
    """``lowbit.eval.perplexity``'s result and (``lastword`` > 0) ``lastword_accuracy``'s (greedy exact
    match by teacher forcing), every log-probability from one call of ``score``."""
    if text is None:
        text = read_text(text_file)
    prompts, spans, stride, bos = perplexity_prompts(tokenizer, text, window, stride, limit)
    encoded = []
    if lastword > 0:
        if examples is None:
            examples = lastword_examples(read_paragraphs(text_file), limit=lastword)
        examples = list(examples)[:lastword]
        if not examples:
            raise EvalDataError("no last-word examples (need paragraphs ending in a word)")
        encoded = [encode_example(tokenizer, ex, max_context_tokens, bos) for ex in examples]
    lps, greedy = score(prompts + [ids for ids, _ in encoded])
    nll, count, nb = 0.0, 0, 0
    for lp, (first, n, b) in zip(lps, spans):
        nll -= math.fsum(lp[first - 1:first - 1 + n])  # lp[i] scores prompt position i + 1
        count += n
        nb += b
    mean = nll / count
    ppl = PerplexityResult(perplexity=math.exp(mean), nll=mean, tokens_scored=count, bytes_scored=nb,
                           bits_per_byte=nll / math.log(2) / max(nb, 1), windows=len(prompts),
                           window=window, stride=stride, bos_prepended=bos is not None)
    if not encoded:
        return ppl, None
    correct, total = 0, 0.0
    for (ids, n_tgt), lp, g in zip(encoded, lps[len(prompts):], greedy[len(prompts):]):
        correct += int(all(g[-n_tgt:]))
        total += math.fsum(lp[-n_tgt:])
    lw = LastWordResult(accuracy=correct / len(encoded), correct=correct, examples=len(encoded),
                        mean_logprob=total / len(encoded), bos_prepended=bos is not None)
    return ppl, lw
