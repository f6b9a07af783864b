"""Perplexity over local text in fixed windows (optionally strided), with bits per byte.

The text is tokenized once (no special tokens) and cut into windows; each window starts the way
the tokenizer starts a text (lowbit.textstart): with its BOS token when it adds one by default
(Gemma, Llama 3), with nothing otherwise (SmolLM2). ``window`` counts every token the model
sees, the BOS included:

- with BOS: BOS + ``window - 1`` text tokens; every text token can be scored, the first from
  the BOS alone; the BOS itself is never scored;
- without: ``window`` text tokens; the first is never scored (it has no context).

Windows start every ``stride`` text tokens (default: the text tokens of a window, so they do not
overlap; at most that many); each scores the text tokens not scored by an earlier window, so a
non-overlapping window scores ``window - 1`` tokens either way, and every scored token has
between 1 and ``window - 1`` tokens of context. ``limit`` caps the number of scored tokens.
Bits per byte divides the total negative log-likelihood (in bits) by the UTF-8 bytes those
scored tokens cover, which makes results comparable across tokenizers.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn as nn
from tqdm.auto import tqdm

from lowbit.eval.scoring import (DEFAULT_MAX_LOGITS, chunked_divergence, chunked_logits_apply, hidden_states,
                                 output_head)
from lowbit.eval.text import EvalDataError, read_text
from lowbit.textstart import bos_to_prepend, prepend


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    nll: float              # mean negative log-likelihood per scored token, nats
    tokens_scored: int
    bytes_scored: int
    bits_per_byte: float
    windows: int
    window: int             # tokens per forward, the BOS included
    stride: int             # text tokens between window starts
    bos_prepended: bool     # each window started with the tokenizer's BOS token

    def to_dict(self) -> dict:
        return asdict(self)


def tokenize_with_bytes(tokenizer, text: str) -> tuple[torch.Tensor, np.ndarray]:
    """Token ids [N] and the UTF-8 byte count each token covers (they sum to the text's bytes
    up to untokenized trailing characters)."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = enc["input_ids"]
        ends = np.array([e for _, e in enc["offset_mapping"]], dtype=np.int64)
        ends = np.maximum.accumulate(ends) if len(ends) else ends
        char_bytes = np.fromiter((len(c.encode("utf-8")) for c in text), dtype=np.int64, count=len(text))
        prefix = np.concatenate([[0], np.cumsum(char_bytes)])
        end_bytes = prefix[ends]
        nbytes = np.diff(np.concatenate([[0], end_bytes]))
    else:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        nbytes = np.array([len(tokenizer.decode([i]).encode("utf-8")) for i in ids], dtype=np.int64)
    return torch.tensor(ids, dtype=torch.long), nbytes


def window_plan(n_tokens: int, window: int, stride: int, limit: int | None, *,
                prefix: int = 0) -> list[tuple[int, int, int]]:
    """(begin, end, n_scored) per window, in text-token indices: the window holds text tokens
    [begin, end) after ``prefix`` start tokens (0, or 1 for a BOS), so at most
    ``window - prefix`` of them; the scored tokens are [end - n_scored, end). Without a prefix a
    window's first text token is not scored (no context); with one it can be."""
    if window < 2:
        raise EvalDataError(f"window must be at least 2 tokens, got {window}")
    if prefix not in (0, 1):
        raise EvalDataError(f"a window starts with 0 or 1 BOS token, got prefix {prefix}")
    span, skip = window - prefix, 1 - prefix  # text tokens per window; unscored ones at its start
    if not 1 <= stride <= span:
        bos = f" (window {window} less the BOS token each window starts with)" if prefix else ""
        raise EvalDataError(f"stride must be in [1, {span}]{bos}, got {stride}")
    plan, prev_end, total = [], 0, 0
    for begin in range(0, max(n_tokens - skip, 0), stride):
        end = min(begin + span, n_tokens)
        n = min(end - prev_end, end - begin - skip)
        if limit is not None and total + n > limit:
            cut = total + n - limit
            end, n = end - cut, n - cut
        if n > 0:
            plan.append((begin, end, n))
            total += n
        prev_end = end
        if end >= n_tokens or (limit is not None and total >= limit):
            break
    return plan


def windows_of(tokenizer, text: str, window: int, stride: int | None, limit: int | None):
    """(token ids, bytes per token, window plan, stride, BOS or None) of the evaluation of ``text``
    (see the module docstring): the one plan lowbit's and an engine's scoring share. A text too
    short for one window is an EvalDataError."""
    bos = bos_to_prepend(tokenizer)
    prefix = 0 if bos is None else 1
    stride = window - prefix if stride is None else stride
    ids, nbytes = tokenize_with_bytes(tokenizer, text)
    plan = window_plan(len(ids), window, stride, limit, prefix=prefix)
    if not plan:
        raise EvalDataError(f"text too short for perplexity: {len(ids)} tokens")
    return ids, nbytes, plan, stride, bos


@dataclass
class TextScores:
    """Per scored token, in text order (the window plan's): the model's log-probability of the
    token and its greedy prediction; with a reference (``score_text(reference=...)``) the
    reference's and KL(reference || model); with ``keep_hidden`` the final hidden states that
    predict each token (what ``lowbit.eval.reference.FloatReference`` keeps)."""

    result: PerplexityResult
    targets: torch.Tensor               # [N] int64, the scored tokens
    logprob: torch.Tensor               # [N] float32, log p(token | context), nats
    argmax: torch.Tensor                # [N] int64, the greedy prediction at that position
    hidden: torch.Tensor | None = None  # [N, H] float32 on the CPU (keep_hidden)
    ref_logprob: torch.Tensor | None = None
    ref_argmax: torch.Tensor | None = None
    kld: torch.Tensor | None = None     # [N] float64, KL(reference || model) per token, nats

    @property
    def nll(self) -> torch.Tensor:
        """Negative log-likelihood per token, float64."""
        return -self.logprob.double()


def _check_reference(reference, offset: int, targets: torch.Tensor) -> None:
    n = targets.shape[0]
    if reference.targets.shape[0] < offset + n or not torch.equal(reference.targets[offset:offset + n], targets.cpu()):
        raise EvalDataError("the float reference was computed on other tokens: evaluate both models on the same "
                            "text with the same window, stride and limit (and tokenizer)")


@torch.no_grad()
def score_text(model: nn.Module, tokenizer, text: str | None = None, *, text_file: str | os.PathLike | None = None,
               window: int = 512, stride: int | None = None, limit: int | None = None,
               reference=None, keep_hidden: bool = False, progress: bool = True, desc: str = "perplexity",
               max_logits: int = DEFAULT_MAX_LOGITS) -> TextScores:
    """Score every token of ``text``'s window plan (see the module docstring) with ``model``.
    ``reference`` (a ``FloatReference`` of the same text, window, stride and limit) adds its
    log-probabilities and the per-token KL divergence, full vocabulary, chunked (scoring.py)."""
    if text is None:
        text = read_text(text_file)
    ids, nbytes, plan, stride, bos = windows_of(tokenizer, text, window, stride, limit)
    prefix = 0 if bos is None else 1
    head, softcap = output_head(model)
    dev = next(model.parameters()).device
    parts: dict[str, list[torch.Tensor]] = {}
    nll, count, nb = 0.0, 0, 0
    bar = tqdm(total=sum(p[2] for p in plan), desc=desc, unit="tok", disable=not progress, leave=False)
    for begin, end, n in plan:
        chunk = prepend(ids[begin:end], bos)[None].to(dev)
        t = torch.arange(end - begin - n, end - begin, device=dev) + prefix  # chunk positions of the scored tokens
        hs = hidden_states(model, chunk)[0, t - 1]
        targets = chunk[0, t]
        if reference is None:
            lp, arg = chunked_logits_apply(hs, head, targets, softcap, max_logits)
            got = {"logprob": lp, "argmax": arg}
        else:
            _check_reference(reference, count, targets)
            got = chunked_divergence(hs, head, softcap, targets, reference.hidden[count:count + n], reference.head,
                                     reference.softcap, max_logits)
        got["targets"] = targets.cpu()
        if keep_hidden:
            got["hidden"] = hs.float().cpu()
        for k, v in got.items():
            parts.setdefault(k, []).append(v)
        nll -= float(got["logprob"].double().sum())
        count += n
        nb += int(nbytes[end - n:end].sum())
        bar.update(n)
    bar.close()
    mean = nll / count
    result = PerplexityResult(perplexity=math.exp(mean), nll=mean, tokens_scored=count, bytes_scored=nb,
                              bits_per_byte=nll / math.log(2) / max(nb, 1), windows=len(plan),
                              window=window, stride=stride, bos_prepended=bos is not None)
    return TextScores(result=result, **{k: torch.cat(v) for k, v in parts.items()})


def perplexity(model: nn.Module, tokenizer, text: str | None = None, *, text_file: str | os.PathLike | None = None,
               window: int = 512, stride: int | None = None, limit: int | None = None,
               progress: bool = True, desc: str = "perplexity", max_logits: int = DEFAULT_MAX_LOGITS,
               ) -> PerplexityResult:
    """Perplexity of ``model`` on ``text`` (default: the built-in evaluation text); each window
    starts with the tokenizer's BOS when it adds one (see the module docstring)."""
    return score_text(model, tokenizer, text, text_file=text_file, window=window, stride=stride, limit=limit,
                      progress=progress, desc=desc, max_logits=max_logits).result
