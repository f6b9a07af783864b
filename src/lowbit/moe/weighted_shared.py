"""Shared experts held as three 3-D parameters and weighted per token, split per expert.

Inkling's shared experts (``InklingSharedExperts``) hold ``gate_proj`` [E, I, H], ``up_proj``
[E, I, H] and ``down_proj`` [E, H, I] and are called as ``forward(hidden_states, gammas)``: every
token goes through every expert (``bmm``), expert e's ``act(gate) * up`` is multiplied by the
token's weight ``gammas[..., e]`` before ``down_proj``, and the experts' outputs are summed in
float32. Such a module is recognised from itself, not from its name or class: exactly the three
parameters transformers names ``gate_proj``, ``up_proj`` and ``down_proj``, 3-D with one leading
dimension E that an int attribute of the module also holds, shapes of one gated MLP per expert,
no layout flags (``lowbit.moe.split`` takes those), and a forward of two positional arguments.
The layout is the candidate (orientation [E, out, in] or [E, in, out]; the weight multiplying
the down projection's input, or the expert's input) whose split computes what the module's own
forward computes on a copy holding seeded random values (``_matches``; its own weights, maybe
not loaded yet, play no part). No candidate, or no ``act_fn``: a ``QuantizationError`` naming
the module, never a guess.

``WeightedSharedExperts`` holds expert e as ``ExpertMLP`` child ``e`` (linears
``shared_experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``) and is called like the module it
replaces: out = sum_e down_e(act(gate_e(x)) * up_e(x) * gamma_e), the weight kept on the down
projection's input as in the original (so down_proj's input observers see what the original's
down input is). Its ``layout`` (``FusedLayout(separate=True)``) tells the streamed skeleton and
model-free quantization that a checkpoint holds expert e's linear as ``<module>.<proj>[e]``.
"""

from __future__ import annotations

import copy
import inspect
from enum import Enum

import torch
import torch.nn as nn

from lowbit.errors import QuantizationError
from lowbit.moe.experts import ExpertList, ExpertMLP, Gate, GateKind
from lowbit.moe.slices import FusedLayout, Proj, expert_part, linear_of, positional_arity
from lowbit.targets import probe_key

LEAVES = tuple(p.value for p in Proj)  # gate_proj, up_proj, down_proj: transformers' names of the three


class Site(str, Enum):
    """Where expert e's per-token weight multiplies."""

    HIDDEN = "hidden"  # down_proj's input: act(gate(x)) * up(x) * w (Inkling)
    INPUT = "input"    # the expert's input: the expert called on x * w

    def __str__(self) -> str:
        return self.value


class WeightedSharedExperts(ExpertList):
    """Experts ``0`` .. ``E-1``, every one on every token, weighted per token (module docstring).
    ``weights_arg``: the replaced forward's name of its second argument (callers pass it by
    keyword: Inkling's ``gammas=``)."""

    def __init__(self, experts: list[ExpertMLP], layout: FusedLayout, site: Site, weights_arg: str) -> None:
        super().__init__(experts)
        self.layout = layout
        self.site = site
        self.weights_arg = weights_arg

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if len(args) + len(kwargs) != 1 or (kwargs and self.weights_arg not in kwargs):
            raise TypeError(f"WeightedSharedExperts takes the hidden states and {self.weights_arg!r}")
        weights = args[0] if args else kwargs[self.weights_arg]
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        w = weights.reshape(-1, self.num_experts)
        outs = []
        for e in range(self.num_experts):
            ex, we = self[e], w[:, e, None]
            xe = x * we if self.site is Site.INPUT else x
            h = ex.gate(ex.gate_proj(xe), ex.up_proj(xe))
            outs.append(ex.down_proj(h * we if self.site is Site.HIDDEN else h))
        return torch.stack(outs).float().sum(dim=0).to(hidden_states.dtype).view(shape)


def _fused(module: nn.Module) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter] | None:
    """The module's gate, up and down parameters when it holds exactly those, 3-D, E matrices each
    (E also an int attribute), shaped as one gated MLP per expert; else None."""
    params = module._parameters
    if set(params) != set(LEAVES) or not all(isinstance(params[k], nn.Parameter) and params[k].dim() == 3
                                             for k in LEAVES):
        return None
    g, u, d = (params[k] for k in LEAVES)
    e = g.shape[0]
    counts = [v for v in vars(module).values() if isinstance(v, int) and not isinstance(v, bool)]
    if e not in counts or u.shape != g.shape or tuple(d.shape) != (e, g.shape[2], g.shape[1]):
        return None
    return g, u, d


def is_weighted_shared(module: nn.Module) -> bool:
    """Whether ``module`` holds weighted shared experts of this layout (module docstring)."""
    if isinstance(getattr(module, "is_transposed", None), bool) or _fused(module) is None:
        return False  # transformers' flagged experts: lowbit.moe.split
    return positional_arity(module) == 2


def _build(module: nn.Module, transposed: bool, site: Site) -> WeightedSharedExperts:
    layout = FusedLayout(transposed=transposed, separate=True)
    g, u, d = (t.detach() for t in _fused(module))
    gate = Gate(GateKind.ACT_MUL, act=module.act_fn)
    experts = [ExpertMLP(linear_of(expert_part(g, e, Proj.GATE, layout)), linear_of(expert_part(u, e, Proj.UP, layout)),
                         linear_of(expert_part(d, e, Proj.DOWN, layout)), gate) for e in range(g.shape[0])]
    return WeightedSharedExperts(experts, layout, site, _weights_arg(module))


def _weights_arg(module: nn.Module) -> str:
    params = [p for p in inspect.signature(module.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return params[1].name


@torch.no_grad()
def _matches(module: nn.Module, transposed: bool, site: Site) -> bool:
    """Whether the split in this layout computes what ``module``'s own forward computes, on a copy
    of it holding seeded random values, for 3 tokens with per-token weights."""
    gen = torch.Generator().manual_seed(0)
    probe = copy.copy(module)  # shallow: a new parameter table, the module's own tensors untouched
    probe._parameters = {k: nn.Parameter(torch.randn(tuple(p.shape), generator=gen) * 0.5, requires_grad=False)
                         for k, p in module._parameters.items()}
    g = probe._parameters[Proj.GATE.value]
    hidden = g.shape[1] if transposed else g.shape[2]
    x = torch.randn(1, 3, hidden, generator=gen)
    w = torch.rand(1, 3, g.shape[0], generator=gen) + 0.25
    try:
        ref = probe(x, w)
        got = _build(probe, transposed, site)(x, w)
    except (RuntimeError, TypeError, ValueError, IndexError):  # a forward that cannot take this layout
        return False
    return isinstance(ref, torch.Tensor) and ref.shape == got.shape and torch.allclose(got, ref, rtol=1e-4, atol=1e-5)


#: memo of ``_layout``: (class, shapes, plain attributes) -> (transposed, site) or None (the probe
#: is a pure function of these: its values are seeded random)
_LAYOUTS: dict[tuple, tuple[bool, Site] | None] = {}


def _layout(module: nn.Module) -> tuple[bool, Site] | None:
    key = probe_key(module, tuple(tuple(p.shape) for p in _fused(module)))
    if key not in _LAYOUTS:
        _LAYOUTS[key] = next(((t, s) for t in (False, True) for s in Site if _matches(module, t, s)), None)
    return _LAYOUTS[key]


def weighted_layout(module: nn.Module) -> FusedLayout | None:
    """How a checkpoint of ``module`` (weighted shared experts whose layout lowbit finds) holds
    its experts, or None."""
    if not is_weighted_shared(module) or not callable(getattr(module, "act_fn", None)):
        return None
    found = _layout(module)
    return None if found is None else FusedLayout(transposed=found[0], separate=True)


def split_weighted_shared(name: str, module: nn.Module) -> WeightedSharedExperts:
    """The ``WeightedSharedExperts`` computing what ``module`` computes (module docstring)."""
    if not callable(getattr(module, "act_fn", None)):
        raise QuantizationError(f"module {name!r} ({type(module).__name__}): weighted shared experts without an "
                                f"act_fn, whose layout lowbit cannot check; they cannot be split")
    found = _layout(module)
    if found is None:
        raise QuantizationError(f"module {name!r} ({type(module).__name__}): no known layout of its weighted shared "
                                f"experts computes what it computes; lowbit cannot split them")
    return _build(module, *found)
