"""Calibration windows out of token ids: packed (cut from one stream) or padded (one sample
each), and the split of a window budget between weighted sources. Pure functions on tensors.

Packed (the default, what auto-round does): the samples' texts are joined (a newline between
them), tokenized once and cut into consecutive non-overlapping windows of ``seq_len`` tokens
(``windows``); every position is real text, a window may start or end inside a sample.

Padded: one window per sample, the sample's first tokens (cut at ``seq_len``), then ``pad_id``
up to the longest window (at most ``seq_len``); ``valid`` marks the real positions. Padding is
on the right, so under causal attention no real position attends to a padded one: real
positions compute exactly what they would alone, and statistics skip the padded ones.
"""

from __future__ import annotations

import torch

from lowbit.calibration.records import CalibrationError
from lowbit.errors import OptionRef
from lowbit.textstart import prepend


def spaced(n: int, keep: int) -> torch.Tensor:
    """Indices of ``keep`` of ``n`` items, evenly spaced (first and last kept); all when fewer."""
    if n <= keep:
        return torch.arange(n)
    return torch.linspace(0, n - 1, keep).round().long()


def _seq(seq_len: int) -> OptionRef:
    return OptionRef("seq_len", seq_len, flag="calib_seq_len")


def windows(ids: torch.Tensor, num_samples: int, seq_len: int, bos: int | None = None) -> torch.Tensor:
    """Cut a 1-D id sequence into at most ``num_samples`` evenly spaced windows [n, seq_len]:
    ``seq_len`` text tokens each, or ``bos`` + ``seq_len - 1`` when ``bos`` is given."""
    span = seq_len - (bos is not None)
    if span < 1:
        raise CalibrationError("{seq} leaves no text token after the BOS token", seq=_seq(seq_len))
    n_win = ids.numel() // span
    if n_win == 0:
        raise CalibrationError(
            f"calibration text has {ids.numel()} tokens, fewer than one window of {{seq}}"
            + (f" (BOS + {span} text tokens)" if bos is not None else "") + ": give a longer text or a shorter window",
            seq=_seq(seq_len))
    all_w = ids[: n_win * span].reshape(n_win, span)
    if n_win > num_samples:
        all_w = all_w[spaced(n_win, num_samples)]
    return prepend(all_w, bos)


def padded(samples: list[list[int]], num_samples: int, seq_len: int, bos: int | None,
           pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [n, T], valid [n, T] bool): one window per sample (at most ``num_samples`` of them,
    evenly spaced), ``bos`` first when given, cut at ``seq_len`` tokens, right-padded with
    ``pad_id`` to the longest window T <= seq_len. Samples without a token are skipped."""
    span = seq_len - (bos is not None)
    if span < 1:
        raise CalibrationError("{seq} leaves no text token after the BOS token", seq=_seq(seq_len))
    kept = [s for s in samples if len(s)]
    if not kept:
        raise CalibrationError("the calibration samples have no tokens")
    kept = [kept[int(i)] for i in spaced(len(kept), num_samples)]
    rows = [([] if bos is None else [bos]) + list(s[:span]) for s in kept]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), int(pad_id), dtype=torch.int64)
    valid = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.int64)
        valid[i, :len(r)] = True
    return ids, valid


def shares(weights: list[float], total: int) -> list[int]:
    """``total`` windows split in proportion to ``weights`` (largest remainder; ties to the first)."""
    s = float(sum(weights))
    exact = [total * w / s for w in weights]
    out = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in order[: total - sum(out)]:
        out[i] += 1
    return out
