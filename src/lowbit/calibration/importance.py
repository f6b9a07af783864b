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
    sums = {n: torch.zeros(m.in_features, dtype=torch.float64) for n, m in linears.items()}
    counts = dict.fromkeys(linears, 0)
    owner: dict[str, HessianSum] = {}
    seen: dict[int, tuple] = {}  # this batch's inputs: id -> (weak reference, its squares' sum, its Hessian)

    def hook(name):
        def observe(module, args):
            x = args[0].detach().reshape(-1, module.in_features)
            ref, first, h = seen.get(id(args[0]), (None, None, None))
            if ref is None or ref() is not args[0]:  # the same tensor object, not a reused address
                xd = x.to(torch.float64)
                square = (xd * xd).sum(dim=0).cpu()  # once per input tensor: q/k/v, gate/up read one
                h = owner.setdefault(name, HessianSum()) if hessians else None
                if h is not None:
                    h.add(x)
                seen[id(args[0])] = (weakref.ref(args[0]), square, h)
            else:
                square = first
                if h is not None:
                    owner.setdefault(name, h)
            sums[name] += square
            counts[name] += x.shape[0]
        return observe

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if isinstance(head, nn.Module):  # its logits are not needed: the pass stops once its input is seen
        handles.append(head.register_forward_pre_hook(_stop))
    dev = next(model.parameters()).device
    try:
        for s in range(0, tokens.shape[0], batch_size):
            seen.clear()
            try:
                model(input_ids=tokens[s:s + batch_size].to(dev), use_cache=False)
            except _Reached:
                pass
    finally:
        for h in handles:
            h.remove()
    missed = [n for n, c in counts.items() if c == 0]
    if missed and unseen is None:
        raise QuantizationError(f"linear {missed[0]!r} saw no calibration token ({len(missed)} in all): its "
                                f"importance is undefined")
    return {n: (sums[n] / counts[n]).to(torch.float32) if counts[n] else
            torch.full((linears[n].in_features,), float(unseen), dtype=torch.float32) for n in linears}, owner
