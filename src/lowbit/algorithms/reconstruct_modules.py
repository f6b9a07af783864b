"""The modules a block reconstruction puts in a decoder layer while it runs
(``lowbit.algorithms.reconstruct``): a re-rounded linear computing with its offsets' weight, a
linear of another scheme held fixed, and the layer's run over its calls."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lowbit.backends.shared_input import SharedInput, input_key
from lowbit.quant import fake_quantize


def _input_spec(q):
    """The input quantization of a linear the reconstruction re-rounds (a plain ``nn.Linear``
    computes on float inputs)."""
    from lowbit.modules import QuantLinear

    return q.scheme.input_activations if isinstance(q, QuantLinear) else None


def _dtype(q) -> torch.dtype:
    from lowbit.modules import QuantLinear

    return q.dtype if isinstance(q, QuantLinear) else q.weight.dtype


def _ste_input(q, x: torch.Tensor) -> torch.Tensor:
    """x (float32) QDQ'd under ``q``'s input spec, straight-through in the backward."""
    x32 = x.to(torch.float32)
    with torch.no_grad():
        xq = fake_quantize(x32, q.scheme.input_activations, scale=q.input_scale, global_scale=q.input_global_scale)
    return x32 + (xq - x32).detach()


class SoftLinear(nn.Module):
    """A QuantLinear's (or a plain linear's) forward with its weight as offsets (``off``: an
    ``Offsets`` or another grid's, ``reconstruct_layer``'s ``offsets``; activations QDQ'd
    straight-through; siblings given one ``shared`` compute their common input's QDQ once)."""

    def __init__(self, q, off, shared: SharedInput) -> None:
        super().__init__()
        self.q, self.off, self.shared = q, off, shared
        self.w: torch.Tensor | None = None  # the rounded weight of this step or evaluation (None: round now)

    @property
    def weight(self) -> torch.Tensor:
        """The weight this step computes with (what a model's forward reading ``.weight`` sees)."""
        return (self.off.weight() if self.w is None else self.w).detach().to(_dtype(self.q))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q
        if _input_spec(q) is not None:
            x32 = self.shared.get(x, input_key(q, "reconstruct-ste"), lambda: _ste_input(q, x))
        else:
            x32 = x.to(torch.float32)
        b = None if q.bias is None else q.bias.to(torch.float32)
        return F.linear(x32, self.off.weight() if self.w is None else self.w, b).to(x.dtype)


class FixedLinear(nn.Module):
    """A QuantLinear that this reconstruction does not re-round (another scheme of a mixed
    recipe): without autograd its own forward; with autograd its dequantized weight on the
    straight-through QDQ'd input, so the gradient reaches the linears before it."""

    def __init__(self, q, shared: SharedInput) -> None:
        super().__init__()
        self.q, self.shared = q, shared
        self.w = q.dequantized_weight(torch.float32)

    @property
    def weight(self) -> torch.Tensor:
        return self.w.to(self.q.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q
        if not torch.is_grad_enabled():  # the reference numerics (the layer's backends match them or are not reused)
            from lowbit.backends.reference import ReferenceBackend

            return ReferenceBackend().forward(q, x)
        if q.scheme.input_activations is not None:
            x32 = self.shared.get(x, input_key(q, "reconstruct-ste"), lambda: _ste_input(q, x))
        else:
            x32 = x.to(torch.float32)
        b = None if q.bias is None else q.bias.to(torch.float32)
        return F.linear(x32, self.w, b).to(x.dtype)


def run_calls(layer: nn.Module, calls, device) -> list[torch.Tensor]:
    """The layer's hidden-state output per call (args, kwargs), with autograd as the caller has it."""
    from lowbit.calls import move_call

    outs = []
    for call in calls:
        args, kwargs = move_call(call, device)
        out = layer(*args, **kwargs)
        outs.append(out[0] if isinstance(out, (tuple, list)) else out)
    return outs
