"""Fused experts called on a batch already laid out per expert (Llama 4), split per expert.

Llama 4's experts module takes the routed hidden states as one tensor of E * T rows (expert e's
rows are ``e*T .. (e+1)*T - 1``, each token's row already scaled by its router score, zero for an
expert not chosen), multiplies each expert's rows by its slice of the 3-D ``gate_up_proj`` and
``down_proj`` and returns E * T rows. It carries no layout flags, so the layout is found from the
module itself: a module with an int ``num_experts``, 3-D ``gate_up_proj`` and ``down_proj``
parameters and a forward of one tensor; the weights' orientation comes from their shapes, and
the gate/up order (concatenated halves or interleaved) is the candidate whose split computes
what the module's own forward computes on one expert of seeded random weights (``probe_experts``,
``_matches``; the module's weights may not be loaded yet; no candidate: a QuantizationError
naming the module, never a guess). ``BatchedExperts`` holds the experts as ``ExpertMLP``
children ``0`` .. ``E-1`` (linears ``experts.{e}.gate_proj`` ...) and is called like the module
it replaces.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from lowbit.errors import QuantizationError
from lowbit.moe.experts import ExpertList, ExpertMLP, Gate, GateKind
from lowbit.moe.slices import FusedLayout, Proj, expert_part, linear_of, positional_arity


class BatchedExperts(ExpertList):
    """Experts ``0`` .. ``E-1`` called on E * T rows laid out per expert (module docstring);
    ``layout``: how the fused tensors it was split from hold each expert (what a checkpoint of
    the fused module holds, read per expert by ``lowbit.streamed``)."""

    def __init__(self, experts: list[ExpertMLP], layout: FusedLayout) -> None:
        super().__init__(experts)
        self.layout = layout

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        h = hidden_states.shape[-1]
        x = hidden_states.reshape(self.num_experts, -1, h)
        return torch.stack([self[e](x[e]) for e in range(self.num_experts)]).reshape(-1, h)


def is_batched_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a fused experts module of the batched kind (module docstring)."""
    up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(getattr(module, "num_experts", None), int) and isinstance(up, nn.Parameter)
            and isinstance(down, nn.Parameter) and up.dim() == 3 and down.dim() == 3):
        return False
    if isinstance(getattr(module, "is_transposed", None), bool):  # transformers' flagged kind: split.py
        return False
    return positional_arity(module) == 1


def _build(module: nn.Module, layout: FusedLayout) -> BatchedExperts:
    gate = Gate(GateKind.ACT_MUL, act=module.act_fn)
    up_all, down_all = module.gate_up_proj.detach(), module.down_proj.detach()
    return BatchedExperts([ExpertMLP(linear_of(expert_part(up_all, e, Proj.GATE, layout)),
                                     linear_of(expert_part(up_all, e, Proj.UP, layout)),
                                     linear_of(expert_part(down_all, e, Proj.DOWN, layout)), gate)
                           for e in range(module.num_experts)], layout)


def probe_experts(module: nn.Module) -> nn.Module:
    """A shallow copy of a fused experts ``module`` holding one expert of seeded random values in
    every per-expert tensor (its forward is the module's own code; the module itself is not
    touched, and its own weights, maybe not loaded yet, play no part)."""
    g = torch.Generator().manual_seed(0)
    probe = copy.copy(module)
    probe._parameters = dict(module._parameters)
    for leaf, p in module._parameters.items():
        if p is not None and p.dim() >= 2 and p.shape[0] == module.num_experts:
            probe._parameters[leaf] = nn.Parameter(torch.randn((1,) + tuple(p.shape[1:]), generator=g) * 0.5,
                                                   requires_grad=False)
    probe.num_experts = 1
    return probe


@torch.no_grad()
def _matches(probe: nn.Module, split: BatchedExperts, hidden: int) -> bool:
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(1))
    ref = probe(x)
    return ref.shape == x.shape and torch.allclose(split(x), ref, rtol=1e-4, atol=1e-5)


def split_batched(name: str, module: nn.Module) -> BatchedExperts:
    """The ``BatchedExperts`` computing what ``module`` computes (module docstring)."""
    up, down = module.gate_up_proj, module.down_proj
    transposed = up.shape[1] == down.shape[2]  # [E, H, 2I] with down [E, I, H]: stored [in, out]
    hidden = down.shape[2] if transposed else down.shape[1]
    if not hasattr(module, "act_fn"):
        raise QuantizationError(f"module {name!r} ({type(module).__name__}): fused experts without an act_fn, "
                                f"whose layout lowbit cannot check; they cannot be split")
    probe = probe_experts(module)
    for concatenated in (True, False):
        layout = FusedLayout(transposed=transposed, concatenated=concatenated)
        if _matches(probe, _build(probe, layout), hidden):
            return _build(module, layout)
    raise QuantizationError(f"module {name!r} ({type(module).__name__}): no known layout of its fused experts "
                            f"computes what it computes; lowbit cannot split them")
