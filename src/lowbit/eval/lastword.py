"""Last-word accuracy, LAMBADA-style, built from local text.

An example is a paragraph whose text ends in a word (optionally followed by closing
punctuation or quotes, which are dropped): the context is everything before that word, the
target is `` word``. The model is correct when greedy decoding reproduces the target's tokens
exactly; with teacher forcing this is one forward pass: the argmax at every target position
equals the target token (lm-eval's ``is_greedy``). The context starts the way the tokenizer
starts a text (its BOS token when it adds one by default, lowbit.textstart); text is cut from
the left so that the context, the BOS included, is at most ``max_context_tokens`` tokens.
Only the hidden states at target positions reach the output head.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from lowbit.eval.intervals import Interval, wilson_interval
from lowbit.eval.scoring import DEFAULT_MAX_LOGITS, score_positions
from lowbit.eval.text import EvalDataError, read_paragraphs
from lowbit.textstart import bos_to_prepend

_ENDING = re.compile(r"^(?P<context>.*\S)\s+(?P<word>[A-Za-z]+)[\"'.,;:!?\)\u201d\u2019_-]*$", re.S)


@dataclass(frozen=True)
class LastWordExample:
    context: str
    word: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class LastWordResult:
    accuracy: float
    correct: int
    examples: int
    mean_logprob: float     # mean log-probability of the whole target word, nats
    bos_prepended: bool     # each context started with the tokenizer's BOS token

    @property
    def interval(self) -> Interval:
        """The accuracy with Wilson's 95% interval (the examples are independent)."""
        return wilson_interval(self.correct, self.examples)

    def to_dict(self) -> dict:
        return {**asdict(self), "interval": self.interval.to_dict()}


def lastword_examples(paragraphs: list[str], *, min_context_words: int = 20, min_word_len: int = 2,
                      limit: int | None = None) -> list[LastWordExample]:
    """Examples from paragraphs that end in a word with at least ``min_context_words`` before it."""
    out = []
    for p in paragraphs:
        m = _ENDING.match(p.strip())
        if not m:
            continue
        ctx, word = m["context"], m["word"]
        if len(word) < min_word_len or len(ctx.split()) < min_context_words:
            continue
        out.append(LastWordExample(ctx, word))
        if limit is not None and len(out) >= limit:
            break
    return out


def encode_example(tokenizer, ex: LastWordExample, max_context_tokens: int,
                   bos: int | None = None) -> tuple[list[int], int]:
    """Token ids of [bos] + context + " word" and the number of target tokens; the context text
    is cut from the left to ``max_context_tokens`` tokens, the BOS (when given) included."""
    start = [] if bos is None else [bos]
    keep = max_context_tokens - len(start)
    if keep < 1:
        raise EvalDataError(f"max_context_tokens must be at least {1 + len(start)}, got {max_context_tokens}")
    ctx = tokenizer(ex.context, add_special_tokens=False)["input_ids"]
    ctx = ctx[max(len(ctx) - keep, 0):]
    tgt = tokenizer(" " + ex.word, add_special_tokens=False)["input_ids"]
    if not tgt or not ctx:
        raise EvalDataError(f"cannot tokenize example ending in {ex.word!r}")
    return start + ctx + tgt, len(tgt)


@torch.no_grad()
def lastword_accuracy(model: nn.Module, tokenizer, examples: list[LastWordExample] | None = None, *,
                      text_file: str | os.PathLike | None = None, limit: int | None = None,
                      max_context_tokens: int = 128, batch_size: int = 8, progress: bool = True,
                      desc: str = "last word", max_logits: int = DEFAULT_MAX_LOGITS) -> LastWordResult:
    """Exact-match greedy last-word accuracy (default: examples from the built-in text)."""
    if examples is None:
        examples = lastword_examples(read_paragraphs(text_file), limit=limit)
    elif limit is not None:
        examples = examples[:limit]
    if not examples:
        raise EvalDataError("no last-word examples (need paragraphs ending in a word)")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    bos = bos_to_prepend(tokenizer)
    encoded = [encode_example(tokenizer, ex, max_context_tokens, bos) for ex in examples]
    correct, total_lp = 0, 0.0
    bar = tqdm(total=len(encoded), desc=desc, unit="ex", disable=not progress, leave=False)
    for s in range(0, len(encoded), batch_size):
        batch = encoded[s:s + batch_size]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        pos, owner = [], []
        for i, (seq, n_tgt) in enumerate(batch):  # right padding: real tokens keep positions 0..L-1
            ids[i, :len(seq)] = torch.tensor(seq)
            mask[i, :len(seq)] = 1
            for t in range(len(seq) - n_tgt, len(seq)):
                pos.append((i, t))
                owner.append(i)
        lp, arg = score_positions(model, ids, torch.tensor(pos), attention_mask=mask, max_logits=max_logits)
        targets = ids[torch.tensor(pos)[:, 0], torch.tensor(pos)[:, 1]]
        owner_t = torch.tensor(owner)
        for i in range(len(batch)):
            sel = owner_t == i
            correct += int(bool((arg[sel] == targets[sel]).all()))
            total_lp += float(lp[sel].double().sum())
        bar.update(len(batch))
    bar.close()
    return LastWordResult(accuracy=correct / len(encoded), correct=correct, examples=len(encoded),
                          mean_logprob=total_lp / len(encoded), bos_prepended=bos is not None)
