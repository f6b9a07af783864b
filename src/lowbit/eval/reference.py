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

``save`` writes a reference to one safetensors file (the tensors, the head's weight, and as
metadata the window plan, the evaluation text's SHA-256 and the float model's report fields);
``load`` reads it back (never ``torch.load``), so a float model is scored once for any number of
quantized ones across runs (``lowbit eval FLOAT --save-reference F``, then
``lowbit eval QUANT --baseline F``), as llama.cpp's ``--kl-divergence-base`` file is.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

from lowbit.eval.perplexity import PerplexityResult, TextScores, score_text
from lowbit.eval.scoring import output_head
from lowbit.eval.text import EvalDataError

#: the ``format`` metadata of a reference file
REFERENCE_FORMAT = "lowbit-float-reference/1"
_TENSORS = ("targets", "hidden", "logprob", "argmax")


def check_reference_path(path: str | os.PathLike, source: str | os.PathLike | None = None) -> Path:
    """Where a reference file may be written: its folder exists, it is not a folder, and (given the
    evaluated model's folder ``source``) it is not an existing file of that folder. EvalDataError
    naming the path otherwise; checked before any model is scored."""
    p = Path(path)
    if p.is_dir():
        raise EvalDataError(f"{p}: is a folder; a float reference is one file (e.g. {p / 'float-ref.safetensors'})")
    if not p.resolve().parent.is_dir():
        raise EvalDataError(f"{p}: the folder {p.resolve().parent} does not exist")
    if source is not None and Path(source).is_dir():
        src = Path(source).resolve()
        if src in p.resolve().parents and p.exists():
            raise EvalDataError(f"{p}: an existing file of the model folder {src} would be overwritten")
    return p


def text_sha256(text: str) -> str:
    """The SHA-256 of an evaluation text (UTF-8), which a reference file records."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


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
    text_sha256: str | None = None   # of the text it was scored on (when known)
    fields: dict = field(default_factory=dict)  # the float model's report fields (lowbit.report.measures)

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

    def check_plan(self, text: str, window: int, stride: int | None, limit: int | None, source: str) -> None:
        """An EvalDataError naming ``source`` unless this reference was scored on ``text`` with this
        window plan (the tokens themselves are checked again as they are scored)."""
        if self.text_sha256 is not None and self.text_sha256 != text_sha256(text):
            raise EvalDataError(f"{source}: the float reference was scored on another evaluation text")
        r = self.result
        asked = (window, window - int(r.bos_prepended) if stride is None else stride)  # windows_of's default
        if (r.window, r.stride) != asked or (limit is not None and r.tokens_scored > limit):
            raise EvalDataError(f"{source}: the float reference was scored with window {r.window}, stride {r.stride}, "
                                f"{r.tokens_scored} tokens; this evaluation asks window {asked[0]}, stride {asked[1]}, "
                                f"limit {limit}")

    def save(self, path: str | os.PathLike) -> Path:
        """Write the reference to one safetensors file, atomically (see the module docstring).
        Only a float ``nn.Linear`` head can be written."""
        from safetensors.torch import save_file

        from lowbit.files.atomic import atomic_path

        if type(self.head) is not nn.Linear:
            raise EvalDataError(f"{path}: a float reference is written with a float nn.Linear output head, "
                                f"not {type(self.head).__name__}")
        check_reference_path(path)
        tensors = {k: getattr(self, k).contiguous() for k in _TENSORS}
        tensors["head.weight"] = self.head.weight.detach().float().cpu().contiguous()
        if self.head.bias is not None:
            tensors["head.bias"] = self.head.bias.detach().float().cpu().contiguous()
        meta = {"format": REFERENCE_FORMAT, "result": json.dumps(self.result.to_dict()),
                "softcap": json.dumps(self.softcap), "text_sha256": self.text_sha256 or "",
                "fields": json.dumps(self.fields)}
        path = Path(path)
        with atomic_path(path) as tmp:
            save_file(tensors, str(tmp), metadata=meta)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "FloatReference":
        """Read a file ``save`` wrote; anything else is an EvalDataError naming the file."""
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("format") != REFERENCE_FORMAT:
                    raise EvalDataError(f"{path}: not a lowbit float reference (format {meta.get('format')!r})")
                t = {k: f.get_tensor(k) for k in f.keys()}
        except EvalDataError:
            raise
        except Exception as e:  # a truncated or foreign file: one line naming it
            raise EvalDataError(f"{path}: cannot read a float reference ({type(e).__name__}: {e})") from None
        weight = t["head.weight"]
        head = nn.Linear(weight.shape[1], weight.shape[0], bias="head.bias" in t)
        with torch.no_grad():
            head.weight.copy_(weight)
            if head.bias is not None:
                head.bias.copy_(t["head.bias"])
        return cls(result=PerplexityResult(**json.loads(meta["result"])), head=head.eval(),
                   softcap=json.loads(meta["softcap"]), text_sha256=meta["text_sha256"] or None,
                   fields=json.loads(meta["fields"]), **{k: t[k] for k in _TENSORS})

    @property
    def nbytes(self) -> int:
        """Bytes held by the per-token tensors (the head is the model's own)."""
        return sum(t.numel() * t.element_size() for t in (self.targets, self.hidden, self.logprob, self.argmax))


def float_reference(model: nn.Module, tokenizer, text: str | None = None, **options) -> FloatReference:
    """Score ``model`` (the float one) on ``text`` and keep its reference; ``options`` as
    ``score_text``'s (text_file, window, stride, limit, progress, desc, max_logits)."""
    from lowbit.eval.text import read_text

    if text is None:
        text = read_text(options.pop("text_file", None))
    ref = FloatReference.of(score_text(model, tokenizer, text, keep_hidden=True, **options), model)
    ref.text_sha256 = text_sha256(text)
    return ref
