"""An importance matrix from calibration data: each linear's mean squared input per column.

llama.cpp's ``llama-imatrix`` runs text through the float model and keeps, for every matrix
multiplication, the mean over all tokens of each input column's square; ``llama-quantize
--imatrix`` then weights each column's rounding error by it (``lowbit.numerics.ggml.encode(...,
importance=)`` takes the same vector). ``importance_matrix`` computes that statistic for every
``nn.Linear`` of a model on lowbit's calibration windows: sums of squares accumulated in float64
over every token that reaches the linear (a split MoE expert sees only the tokens routed to it, as
llama-imatrix counts per expert), divided by that count.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn as nn

from lowbit.calibration.hessian import HessianSum
from lowbit.errors import QuantizationError


class _Reached(Exception):
    """The forward reached the output head (``_stop``): everything measured has been seen."""


def _stop(module, args):
    raise _Reached


@torch.no_grad()
def importance_matrix(model: nn.Module, tokens: torch.Tensor, *, batch_size: int = 4,
                      names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """{linear name: float32 [in_features]} mean squared input per column over ``tokens``
    [n, seq_len] (``lowbit.calibration.calibration_tokens``), run through ``model`` in batches of
    ``batch_size`` windows. ``names``: the linears to measure (default: every ``nn.Linear``). A
    linear no token reached is a QuantizationError naming it."""
    return input_statistics(model, tokens, batch_size=batch_size, names=names)[0]


class InputStatistics:
    """The sums behind ``input_statistics``, gathered by forward pre-hooks on ``linears`` (name ->
    ``nn.Linear``) while ``observing()``: each linear's float64 sum of squared inputs per column and
    its token count and, with ``hessians``, GPTQ's input Hessian sum (``HessianSum``; linears that
    read the same input tensor in one batch share one). Call ``next_batch()`` before each batch:
    inputs are recognised as shared within a batch only. Whatever runs the linears (the whole model,
    one decoder layer on captured inputs) gives the same sums for the same inputs."""

    def __init__(self, linears: dict[str, nn.Linear], hessians: bool = False) -> None:
        self.linears = linears
        self.hessians = hessians
        self.sums = {n: torch.zeros(m.in_features, dtype=torch.float64) for n, m in linears.items()}
        self.counts = dict.fromkeys(linears, 0)
        self.owner: dict[str, HessianSum] = {}
        self._seen: dict[int, tuple] = {}  # this batch's inputs: id -> (weak reference, its squares' sum, its Hessian)

    def next_batch(self) -> None:
        self._seen.clear()

    def _hook(self, name: str):
        def observe(module, args):
            x = args[0].detach().reshape(-1, module.in_features)
            ref, first, h = self._seen.get(id(args[0]), (None, None, None))
            if ref is None or ref() is not args[0]:  # the same tensor object, not a reused address
                xd = x.to(torch.float64)
                square = (xd * xd).sum(dim=0).cpu()  # once per input tensor: q/k/v, gate/up read one
                h = self.owner.setdefault(name, HessianSum()) if self.hessians else None
                if h is not None:
                    h.add(x)
                self._seen[id(args[0])] = (weakref.ref(args[0]), square, h)
            else:
                square = first
                if h is not None:
                    self.owner.setdefault(name, h)
            self.sums[name] += square
            self.counts[name] += x.shape[0]
        return observe

    @contextmanager
    def observing(self) -> Iterator[None]:
        """The linears' hooks, registered for the block."""
        handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in self.linears.items()]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def result(self, unseen: float | None = None) -> tuple[dict[str, torch.Tensor], dict[str, HessianSum]]:
        """(linear name -> mean squared input per column, float32; linear name -> Hessian sum):
        ``input_statistics``' contract, ``unseen`` included."""
        missed = [n for n, c in self.counts.items() if c == 0]
        if missed and unseen is None:
            raise QuantizationError(f"linear {missed[0]!r} saw no calibration token ({len(missed)} in all): its "
                                    f"importance is undefined")
        return {n: (self.sums[n] / c).to(torch.float32) if (c := self.counts[n]) else
                torch.full((m.in_features,), float(unseen), dtype=torch.float32)
                for n, m in self.linears.items()}, self.owner


@torch.no_grad()
def input_statistics(model: nn.Module, tokens: torch.Tensor, *, batch_size: int = 4, names: list[str] | None = None,
                     hessians: bool = False, unseen: float | None = None
                     ) -> tuple[dict[str, torch.Tensor], dict[str, HessianSum]]:
    """``importance_matrix``'s vectors and, with ``hessians``, GPTQ's input Hessian sum of every
    linear (``HessianSum``; linears that read the same input tensor, e.g. q/k/v, share one object).
    The Hessians of all linears are held at once: sum of in_features^2 float64 values.
    ``unseen``: None, a linear no token reached is a QuantizationError naming it; a value, its
    vector holds that value in every column and it has no Hessian (llama-imatrix stores 1 for an
    MoE expert the text never routed to). The forward stops at the model's output head (its
    ``get_output_embeddings()``), after the head's own input is measured: the logits, the largest
    product of a small model (SmolLM2-135M: 28 of 134 MFLOP per token), are never computed."""
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and (names is None or n in names)}
    if names is not None and set(names) - set(linears):
        raise QuantizationError(f"no nn.Linear named {sorted(set(names) - set(linears))[0]!r} in the model")
    stats = InputStatistics(linears, hessians)
    head = getattr(model, "get_output_embeddings", lambda: None)()
    dev = next(model.parameters()).device
    with stats.observing():
        # its logits are not needed: the pass stops once its input is seen (registered after the linears' hooks)
        stop = head.register_forward_pre_hook(_stop) if isinstance(head, nn.Module) else None
        try:
            for s in range(0, tokens.shape[0], batch_size):
                stats.next_batch()
                try:
                    model(input_ids=tokens[s:s + batch_size].to(dev), use_cache=False)
                except _Reached:
                    pass
        finally:
            if stop is not None:
                stop.remove()
    return stats.result(unseen)
