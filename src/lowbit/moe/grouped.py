"""Per-expert linears held as one 3-D weight and called on rows grouped by expert, split into one
``nn.Linear`` per expert.

JetMoE's ``JetMoeParallelExperts`` (its MoE's ``input_linear`` / ``output_linear`` and its
mixture-of-attention's query and output projections) holds ``weight`` [E, out, in] and is called
as ``forward(rows, counts)``: the rows come grouped by expert (``counts[e]`` rows for expert e, in
expert order) and each group is multiplied by its expert's matrix. It is recognised from the module
itself, not from its name or class: an int ``num_experts``, one parameter, 3-D with ``num_experts``
matrices, and a forward of two positional arguments. The orientation ([E, out, in] or
[E, in, out]) is the candidate whose split computes what the module's own forward computes on
seeded random matrices, with rows grouped unevenly and an expert without rows (``_matches``; the
module's own weight, maybe not loaded yet, plays no part); no candidate: a ``QuantizationError``
naming the module, never a guess.

``GroupedLinears`` holds expert e's linear as child ``e`` (``mlp.input_linear.{e}``, quantized
and saved like any linear) and is called like the module it replaces: the rows split by the
counts, each group through its expert's linear, concatenated in order. An expert no token is
routed to is called on no rows, as in the fused module.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from lowbit.errors import QuantizationError
from lowbit.moe.slices import linear_of, positional_arity


class GroupedLinears(nn.Module):
    """Linears ``0`` .. ``E-1`` called on rows grouped by expert (module docstring); ``transposed``:
    the fused weight was stored [E, in, out]; ``leaf``: its parameter's name (a streamed run reads
    expert e's linear as ``<module>.<leaf>[e]``, ``lowbit.streamed.skeleton``)."""

    def __init__(self, linears: list[nn.Linear], transposed: bool, leaf: str = "weight") -> None:
        super().__init__()
        for e, lin in enumerate(linears):
            self.add_module(str(e), lin)
        self.num_experts = len(linears)
        self.transposed = transposed
        self.leaf = leaf  # the fused parameter's name (what a checkpoint of the module holds: ``<module>.<leaf>``)

    def __getitem__(self, e: int) -> nn.Module:
        return self._modules[str(e)]

    def __len__(self) -> int:
        return self.num_experts

    def forward(self, inputs: torch.Tensor, counts) -> torch.Tensor:
        sizes = counts.tolist() if isinstance(counts, torch.Tensor) else list(counts)
        parts = inputs.split(sizes, dim=0)
        return torch.cat([self[e](parts[e]) for e in range(self.num_experts)], dim=0)


def _weight(module: nn.Module) -> nn.Parameter | None:
    params = list(module.parameters(recurse=False))
    e = getattr(module, "num_experts", None)
    if len(params) != 1 or list(module.children()) or not isinstance(e, int) or isinstance(e, bool):
        return None
    w = params[0]
    return w if w.dim() == 3 and w.shape[0] == e else None


def is_grouped_linears(module: nn.Module) -> bool:
    """Whether ``module`` is a grouped per-expert linear (module docstring)."""
    if isinstance(module, GroupedLinears) or _weight(module) is None:
        return False
    return positional_arity(module) == 2


def _build(w: torch.Tensor, transposed: bool, leaf: str = "weight") -> GroupedLinears:
    return GroupedLinears([linear_of(w[e].t().contiguous() if transposed else w[e].clone())
                           for e in range(w.shape[0])], transposed, leaf)


@torch.no_grad()
def _matches(module: nn.Module, transposed: bool) -> bool:
    """Whether the split in this orientation computes what ``module``'s own forward computes, on a
    copy of it holding seeded random matrices, rows grouped (1, 2, 0, 1, ...)."""
    w = _weight(module)
    g = torch.Generator().manual_seed(0)
    probe = copy.copy(module)
    probe._parameters = {k: nn.Parameter(torch.randn(tuple(v.shape), generator=g), requires_grad=False)
                         for k, v in module._parameters.items()}
    pw = _weight(probe)
    counts = [(1, 2, 0)[e % 3] for e in range(w.shape[0])]
    x = torch.randn(sum(counts), w.shape[1] if transposed else w.shape[2], generator=g)
    try:
        ref = probe(x, counts)
        got = _build(pw, transposed)(x, counts)
    except (RuntimeError, TypeError, ValueError, IndexError):
        return False
    return isinstance(ref, torch.Tensor) and ref.shape == got.shape and torch.allclose(got, ref, rtol=1e-4, atol=1e-5)


def split_grouped(name: str, module: nn.Module) -> GroupedLinears:
    """The ``GroupedLinears`` computing what ``module`` computes (module docstring)."""
    for transposed in (False, True):
        if _matches(module, transposed):
            leaf = next(k for k, v in module._parameters.items() if v is _weight(module))
            return _build(_weight(module).detach(), transposed, leaf)
    raise QuantizationError(f"module {name!r} ({type(module).__name__}): per-expert matrices called on grouped "
                            f"rows in no layout lowbit knows ([E, out, in] or [E, in, out]); it cannot split them")
