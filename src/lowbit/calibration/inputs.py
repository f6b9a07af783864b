"""Calibration inputs: token ids [n, T] (and which positions count) from what the user gives.

``calibration`` may be
- a LongTensor [n, seq_len] of token ids (used as given; a 1-D tensor is one sample),
- a list/tuple of strings, a path (text, ``.jsonl``, ``.csv``, ``.parquet`` file, a ``datasets``
  ``save_to_disk`` folder), a ``datasets.Dataset``, the name of a dataset in the local
  ``datasets`` cache, or ``"builtin"`` (``lowbit.calibration.sources``),
- a ``CalibrationSource`` or a list of them: a mixture, each source given its share of the
  ``num_samples`` windows in proportion to its ``weight`` (``packing.shares``; a source that has
  fewer windows than its share gives what it has).
The built-in text is the first 200 KB of Jane Austen's *Emma* (public domain, via Debian's
r-cran-janeaustenr); the evaluation text ships separately and comes from *Persuasion*.

Conversations are rendered with the chat template (``lowbit.calibration.chat``), texts are used
as they are. Then, per source, packed or padded (``lowbit.calibration.windows``): packed, the
samples are joined paragraph by paragraph (with a newline between them), tokenized once and cut
into windows of ``seq_len`` tokens; padded, one window per sample. Each window starts the way
the tokenizer starts a text (``lowbit.textstart``): its BOS token first when it adds one by
default. ``CalibrationSet.info`` says what was used (the report's ``data``).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch

from lowbit.calibration.chat import DEFAULT_CHAT_TEMPLATE, Renderer
from lowbit.calibration.windows import padded, shares, windows
from lowbit.calibration.records import CalibrationError, Conversation
from lowbit.calibration.sources import CalibrationSource, Samples, read_source
from lowbit.textstart import bos_to_prepend

DEFAULT_PACK = True  # packed windows (every position real text), as auto-round concatenates samples


@dataclass(frozen=True)
class SourceInfo:
    source: str
    kind: str
    weight: float
    samples: int         # samples read (texts and conversations)
    conversations: int
    windows: int         # calibration windows taken from it
    tokens: int          # real (non-padding) tokens in them


@dataclass(frozen=True)
class CalibrationInfo:
    """What calibration ran on (``CalibrationReport.data``, report.json, the quantize summary)."""

    samples: int         # windows
    tokens: int          # positions that count (padding excluded)
    seq_len: int         # window length
    packing: str         # "packed", "padded" or "as given" (token ids)
    chat_template: str   # Renderer.describe
    sources: tuple[SourceInfo, ...] = field(default_factory=tuple)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["sources"] = [asdict(s) for s in self.sources]
        return d


@dataclass(frozen=True)
class CalibrationSet:
    """ids [n, T] int64; valid [n, T] bool (None: every position counts); what was used."""

    ids: torch.Tensor
    valid: torch.Tensor | None
    info: CalibrationInfo


def token_ids(tokenizer, text: str) -> list[int]:
    """``text``'s ids without special tokens (a plain callable returning ids works too)."""
    if tokenizer is None:
        raise CalibrationError("calibration text needs a tokenizer (pass tokenizer=...)")
    try:
        enc = tokenizer(text, add_special_tokens=False)
        ids = enc["input_ids"]
    except TypeError:  # a plain callable returning ids
        ids = tokenizer(text)
    if isinstance(ids, torch.Tensor):
        ids = ids.reshape(-1).tolist()
    return list(ids)


def _given_ids(t: torch.Tensor, num_samples: int) -> CalibrationSet:
    if t.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise CalibrationError(f"calibration token ids must be an integer tensor, got {t.dtype}")
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2 or t.numel() == 0:
        raise CalibrationError(f"calibration token ids must have shape [n, seq_len], got {tuple(t.shape)}")
    t = t.to(torch.int64)[:num_samples] if t.shape[0] > num_samples else t.to(torch.int64)
    src = SourceInfo("token ids", "token ids", 1.0, int(t.shape[0]), 0, int(t.shape[0]), int(t.numel()))
    return CalibrationSet(t, None, CalibrationInfo(int(t.shape[0]), int(t.numel()), int(t.shape[1]), "as given",
                                                   "none (token ids)", (src,)))


def as_sources(calibration, column: str | None = None, split: str | None = None) -> list[CalibrationSource]:
    """``calibration`` as a list of CalibrationSources (``column`` / ``split``: for those that name none)."""
    if isinstance(calibration, CalibrationSource):
        items = [calibration]
    elif isinstance(calibration, Sequence) and not isinstance(calibration, (str, bytes)) and calibration \
            and all(isinstance(c, CalibrationSource) for c in calibration):
        items = list(calibration)
    else:
        items = [CalibrationSource(calibration)]
    return [CalibrationSource(s.data, s.weight, s.column if s.column is not None else column,
                              s.split if s.split is not None else split) for s in items]


def calibration_set(calibration, tokenizer=None, *, num_samples: int = 16, seq_len: int = 512,
                    pack: bool = DEFAULT_PACK, chat_template=DEFAULT_CHAT_TEMPLATE, column: str | None = None,
                    split: str | None = None) -> CalibrationSet:
    """The calibration windows of ``calibration`` (see the module docstring); every source is
    read and checked before anything is tokenized."""
    if isinstance(calibration, torch.Tensor):
        return _given_ids(calibration, num_samples)
    sources = as_sources(calibration, column, split)
    read = [read_source(s) for s in sources]
    renderer = Renderer.of(chat_template, tokenizer)
    texts = [[renderer.render(x) for x in r.items] for r in read]  # every conversation checked first
    n_each = shares([s.weight for s in sources], num_samples)
    for s, n in zip(read, n_each):
        if n == 0:
            raise CalibrationError(f"calibration source {s.name!r} gets none of the {num_samples} windows at its "
                                   f"weight: raise its weight or the number of samples")
    bos = bos_to_prepend(tokenizer)
    parts: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    for t, n in zip(texts, n_each):
        if pack:
            parts.append((windows(torch.tensor(token_ids(tokenizer, "\n".join(t)), dtype=torch.int64), n, seq_len,
                                  bos), None))
        else:
            parts.append(padded([token_ids(tokenizer, x) for x in t], n, seq_len, bos, _pad_id(tokenizer)))
    ids, valid = _stack(parts, _pad_id(tokenizer) if not pack else 0)
    infos = tuple(SourceInfo(r.name, r.kind.value, float(s.weight), len(r.items),
                             sum(isinstance(x, Conversation) for x in r.items), int(p[0].shape[0]),
                             int(p[0].numel() if p[1] is None else p[1].sum()))
                  for r, s, p in zip(read, sources, parts))
    convs = any(i.conversations for i in infos)
    info = CalibrationInfo(int(ids.shape[0]), sum(i.tokens for i in infos), int(ids.shape[1]),
                           "packed" if pack else "padded", renderer.describe(convs), infos)
    return CalibrationSet(ids, valid, info)


def _pad_id(tokenizer) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        v = getattr(tokenizer, name, None)
        if isinstance(v, int):
            return v
    return 0


def _stack(parts, pad_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The sources' windows one after another (padded ones to the widest; None: no padding)."""
    if len(parts) == 1 and parts[0][1] is None:
        return parts[0]
    width = max(p[0].shape[1] for p in parts)
    ids, valid = [], []
    for t, v in parts:
        v = torch.ones_like(t, dtype=torch.bool) if v is None else v
        extra = width - t.shape[1]
        ids.append(torch.nn.functional.pad(t, (0, extra), value=pad_id))
        valid.append(torch.nn.functional.pad(v, (0, extra), value=False))
    ids_t, valid_t = torch.cat(ids), torch.cat(valid)
    return ids_t, (None if bool(valid_t.all()) else valid_t)


def calibration_tokens(calibration, tokenizer=None, *, num_samples: int = 16, seq_len: int = 512,
                       **options) -> torch.Tensor:
    """Token ids [n, seq_len] (int64) for ``calibration``: ``calibration_set(...).ids``; padded
    windows are refused here (their positions do not all count: use ``calibration_set``)."""
    cs = calibration_set(calibration, tokenizer, num_samples=num_samples, seq_len=seq_len, **options)
    if cs.valid is not None:
        raise CalibrationError("padded calibration windows need their validity mask: use calibration_set")
    return cs.ids


def read_paragraphs(path: str | os.PathLike) -> list[str]:
    from lowbit.textfiles import read_paragraphs as _read

    return _read(path, kind="calibration", error=CalibrationError)
