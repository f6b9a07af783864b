"""The float model's view of an evaluation text, kept once and reused for every quantized model.

What is kept, per scored token: the float model's final hidden state at the position that
predicts it ([N, H] float32), the token, the float log-probability of the token and its greedy
prediction; and the float model's output head (the lm_head module, with its logit soft-cap).
From the hidden state and the head the float distribution over the **whole vocabulary** is
recomputed exactly, chunk by chunk, whenever a quantized model is scored against it
(``score_text(reference=...)``), so the KL divergence is the full computation, not an
approximation from the top-k tokens, and no full-vocabulary logits are ever stored: a
262k-token vocabulary over 32k tokens of a 640-wide model keeps 80 MiB of hidden states
(llama.cpp's ``--kl-divergence-base`` file would hold the logits, V x N 16-bit values: 16 GiB).

The head is the float model's own module (a reference, not a copy): when the float model stays
alive (``lowbit compare``) nothing is duplicated; when it is dropped (``lowbit eval --baseline``)
only the head's weight stays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from lowbit.eval.perplexity import PerplexityResult, TextScores, score_text
from lowbit.eval.scoring import output_head


@dataclass
class FloatReference:
    """The float model's scored tokens of one evaluation (see the module docstring)."""

    result: PerplexityResult
    targets: torch.Tensor      # [N] int64
    hidden: torch.Tensor       # [N, H] float32, the state the head turns into the token's distribution
    logprob: torch.Tensor      # [N] float32
    argmax: torch.Tensor       # [N] int64
    head: nn.Module
    softcap: float | None

    @classmethod
    def of(cls, scores: TextScores, model: nn.Module) -> "FloatReference":
        """The reference of ``scores`` (scored with ``keep_hidden=True``) and ``model``'s head."""
        if scores.hidden is None:
            raise ValueError("the float scores were taken without keep_hidden=True: no hidden states to keep")
        head, softcap = output_head(model)
        return cls(result=scores.result, targets=scores.targets, hidden=scores.hidden, logprob=scores.logprob,
                   argmax=scores.argmax, head=head, softcap=softcap)

    def scores(self) -> TextScores:
        """The float model's own ``TextScores`` (no hidden states)."""
        return TextScores(result=self.result, targets=self.targets, logprob=self.logprob, argmax=self.argmax)

    @property
    def nbytes(self) -> int:
        """Bytes held by the per-token tensors (the head is the model's own)."""
        return sum(t.numel() * t.element_size() for t in (self.targets, self.hidden, self.logprob, self.argmax))


def float_reference(model: nn.Module, tokenizer, text: str | None = None, **options) -> FloatReference:
    """Score ``model`` (the float one) on ``text`` and keep its reference; ``options`` as
    ``score_text``'s (text_file, window, stride, limit, progress, desc, max_logits)."""
    return FloatReference.of(score_text(model, tokenizer, text, keep_hidden=True, **options), model)
