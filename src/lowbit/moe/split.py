"""Find transformers' fused expert modules and split them into ``SplitExperts``.

A fused experts module is recognised by its parameters and layout flags, as transformers 5 defines
them (``transformers.integrations.moe.use_experts_implementation``): ``num_experts``, a 3-D
``down_proj`` and a 3-D ``gate_up_proj`` (``up_proj`` when ``has_gate`` is False), with the layout
flags ``is_transposed`` (weights stored [E, in, out]), ``is_concatenated`` (gate rows then up
rows; False: interleaved g0, u0, g1, u1, ...) and ``has_bias`` (``gate_up_proj_bias`` [E, 2I],
``down_proj_bias`` [E, H]). Expert e's linears hold exactly the rows of the fused tensors
(copies, in the fused tensors' dtype and device), so the split module computes what the fused
one does. A module without the flags that is called on rows laid out per expert (Llama 4's
experts) is split by ``lowbit.moe.batched``, one holding a single [E, out, in] weight called on
rows grouped by expert with their counts (JetMoE's ``input_linear`` / ``output_linear``) by
``lowbit.moe.grouped``, a linear applying its row blocks to input groups (DeepSeek-V4's
``o_a_proj``) by ``lowbit.moe.row_groups``, shared experts held as three 3-D parameters and
weighted per token (Inkling's ``shared_experts``) by ``lowbit.moe.weighted_shared``, each layout
checked against the module's own forward; any other stays a weight lowbit cannot quantize (``lowbit.targets.unquantizable_targets``: an
error, or a listed warning). The gating is transformers' default (``act_fn(gate) * up``) unless the class
defines its own ``_apply_gate``; the one known own gating is gpt-oss's clamped SwiGLU (``alpha``
and ``limit`` attributes). Anything else is refused, naming the module.
"""

from __future__ import annotations

import copy
import warnings
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn as nn

from lowbit.errors import QuantizationError
from lowbit.moe.batched import is_batched_experts, probe_experts, split_batched
from lowbit.moe.experts import ExpertMLP, Gate, GateKind, SplitExperts
from lowbit.moe.grouped import is_grouped_linears, split_grouped
from lowbit.moe.row_groups import row_groups, split_row_groups
from lowbit.moe.slices import FusedLayout, Proj, expert_part
from lowbit.moe.weighted_shared import is_weighted_shared, split_weighted_shared
from lowbit.targets import ROUTER_COMPONENTS, probe_key


def is_fused_experts(module: nn.Module) -> bool:
    down = getattr(module, "down_proj", None)
    up = getattr(module, "gate_up_proj", None)
    if up is None:
        up = getattr(module, "up_proj", None)
    # the layout flags transformers' experts decorator sets: without them the layout is unknown
    # (Llama 4's experts), and the module stays a target lowbit cannot quantize (listed, never guessed)
    flags = all(isinstance(getattr(module, f, None), bool) for f in ("is_transposed", "is_concatenated", "has_bias"))
    return (flags and isinstance(getattr(module, "num_experts", None), int) and isinstance(down, nn.Parameter)
            and isinstance(up, nn.Parameter) and down.dim() == 3 and up.dim() == 3)


def _default_gating(cls: type) -> bool:
    """Whether ``cls`` gates as transformers' default (no ``_apply_gate``, or the default one the
    experts decorator installs)."""
    fn = getattr(cls, "_apply_gate", None)
    if fn is None:
        return True
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:  # a transformers without the decorator's default: only a missing method is default
        return False
    return fn is _default_apply_gate


def _gate(name: str, module: nn.Module) -> Gate:
    has_gate = getattr(module, "has_gate", True)
    if not has_gate:
        return Gate(GateKind.ACT, act=module.act_fn)
    if _default_gating(type(module)):
        return Gate(GateKind.ACT_MUL, act=module.act_fn)
    if isinstance(getattr(module, "alpha", None), float) and isinstance(getattr(module, "limit", None), float) \
            and not getattr(module, "is_concatenated", True):
        return Gate(GateKind.CLAMPED_SWIGLU, alpha=module.alpha, limit=module.limit)
    # the class's own gating, bound to a copy of the module without its tensors (its constants and
    # activation stay); checked below against the fused module's forward (_split_matches)
    shell = copy.copy(module)
    shell._parameters, shell._buffers = {}, dict(module._buffers)
    return Gate(GateKind.OWN, own=type(module)._apply_gate.__get__(shell), concatenated=module.is_concatenated)


def _linear(w: torch.Tensor, b: torch.Tensor | None) -> nn.Linear:
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device="meta")
    lin.weight = nn.Parameter(w, requires_grad=False)
    if b is not None:
        lin.bias = nn.Parameter(b, requires_grad=False)
    return lin


def _split_one(name: str, module: nn.Module) -> SplitExperts:
    if getattr(module, "has_post_expert_norm", False):
        raise QuantizationError(f"module {name!r} ({type(module).__name__}) normalizes each expert's output "
                                f"(has_post_expert_norm), which lowbit cannot split yet")
    gate = _gate(name, module)
    has_gate = gate.kind is not GateKind.ACT
    layout = FusedLayout(transposed=module.is_transposed, concatenated=module.is_concatenated, has_gate=has_gate)
    bias = module.has_bias
    up_all = module.gate_up_proj if has_gate else module.up_proj
    up_bias_all = getattr(module, "gate_up_proj_bias" if has_gate else "up_proj_bias", None) if bias else None
    down_bias_all = getattr(module, "down_proj_bias", None) if bias else None

    def part(t, e, proj):
        return None if t is None else expert_part(t.detach(), e, proj, layout)

    if not _split_matches(module, layout, gate, bias):
        own = " (its own _apply_gate)" if gate.kind is GateKind.OWN else ""
        raise QuantizationError(f"module {name!r} ({type(module).__name__}): one expert split as lowbit reads its "
                                f"layout{own} does not compute what the module's forward computes (an expert "
                                f"output norm, another gating): lowbit cannot split these experts")
    experts = []
    for e in range(module.num_experts):
        g_lin = _linear(part(up_all, e, Proj.GATE), part(up_bias_all, e, Proj.GATE)) if has_gate else None
        experts.append(ExpertMLP(g_lin, _linear(part(up_all, e, Proj.UP), part(up_bias_all, e, Proj.UP)),
                                 _linear(part(module.down_proj, e, Proj.DOWN), part(down_bias_all, e, Proj.DOWN)),
                                 gate))
    return SplitExperts(experts, layout)


#: memo of ``_split_matches``: the probe's key (class, shapes, submodules' classes, layout, gating,
#: whether its tensors are on the meta device, plain attributes) -> verdict; a model's many
#: blocks of one kind are probed once
_MATCHES: dict[tuple, bool] = {}


def _split_matches(module: nn.Module, layout: FusedLayout, gate: Gate, bias: bool) -> bool:
    """Whether one expert split with ``gate`` computes what the fused module's own forward computes
    for tokens all routed to it, on one expert of seeded random values (``probe_experts``: the
    module's own weights may not be loaded yet). Checked for every module, whatever its gating:
    the layout flags do not say everything a forward does (ERGO's experts normalize each expert's
    output with a norm of their own)."""
    key = probe_key(module, tuple((k, tuple(p.shape)) for k, p in module._parameters.items() if p is not None),
                    tuple((k, type(m)) for k, m in module._modules.items()), layout, gate.kind, bias,
                    any(p.is_meta for p in module.parameters()))
    if key not in _MATCHES:
        _MATCHES[key] = _probe_split(module, layout, gate, bias)
    return _MATCHES[key]


@torch.no_grad()
def _probe_split(module: nn.Module, layout: FusedLayout, gate: Gate, bias: bool) -> bool:
    probe = probe_experts(module)
    up = "gate_up_proj" if layout.has_gate else "up_proj"
    up_all = getattr(probe, up)
    x = torch.randn(3, up_all.shape[1 if layout.transposed else 2], generator=torch.Generator().manual_seed(1))
    idx = torch.zeros(3, 1, dtype=torch.long)

    def part(leaf, p):
        t = getattr(probe, leaf, None) if bias or not leaf.endswith("_bias") else None
        return None if t is None else expert_part(t.detach(), 0, p, layout)

    lin = [_linear(part(up, p), part(f"{up}_bias", p)) if layout.has_gate or p is Proj.UP else None
           for p in (Proj.GATE, Proj.UP)]
    lin.append(_linear(part("down_proj", Proj.DOWN), part("down_proj_bias", Proj.DOWN)))
    try:
        ref = probe(x, idx, torch.ones(3, 1))
        got = ExpertMLP(*lin, gate)(x)
    except (RuntimeError, TypeError, ValueError, IndexError):  # a gating whose output the experts cannot take
        return False
    # relative to the output's norm: a fused kernel (grouped_mm) sums in another order, an element
    # near zero then differs by more than a per-element tolerance (gpt-oss: 3e-7 of the norm)
    return ref.shape == got.shape and float((got - ref).norm()) <= 1e-4 * float(ref.norm()) + 1e-6


@torch.no_grad()
def split_experts(model: nn.Module) -> list[str]:
    """Replace every fused experts module of ``model`` by its ``SplitExperts`` (in place); returns
    the names of the replaced modules, in model order. Idempotent: split modules are left alone.
    A module recognised but not reproduced by its split (``QuantizationError`` from its kind's
    check) is left as it is, with a warning giving the reason: its weights are then matmul weights
    lowbit cannot quantize (``lowbit.targets.unquantizable_targets``: refused by name, or kept in
    float and listed with ``allow_unquantized``). Memory: one block's experts are copied at a time
    (the fused tensors are released as soon as their block is replaced, unless the caller holds them)."""
    names = [n for n, m in model.named_modules() if is_fused_experts(m) or is_batched_experts(m)
             or is_grouped_linears(m) or row_groups(m) or is_weighted_shared(m)]
    done = []
    for name in names:  # one block at a time: its fused tensors are freed before the next is split
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        try:
            new = _split(name, getattr(parent, child))
        except QuantizationError as e:
            warnings.warn(f"lowbit: {e}; its weights stay as they are", stacklevel=2)
            continue
        setattr(parent, child, new)
        done.append(name)
    return done


def _split(name: str, old: nn.Module) -> nn.Module:
    if is_fused_experts(old):
        return _split_one(name, old)
    if is_batched_experts(old):
        return split_batched(name, old)
    if row_groups(old):
        return split_row_groups(old)
    if is_weighted_shared(old):
        return split_weighted_shared(name, old)
    return split_grouped(name, old)


def expert_blocks(model: nn.Module) -> dict[str, SplitExperts]:
    """name -> SplitExperts of every split experts module under ``model``."""
    return {n: m for n, m in model.named_modules() if isinstance(m, SplitExperts)}


def router_names(model: nn.Module) -> list[str]:
    """Names of the router modules (last name component in ROUTER_COMPONENTS, holding a 2-D weight): they
    stay in float and are listed in the checkpoint's ``ignore``."""
    out = []
    for n, m in model.named_modules():
        w = getattr(m, "weight", None)
        if n.rpartition(".")[2] in ROUTER_COMPONENTS and isinstance(w, torch.Tensor) and w.dim() == 2:
            out.append(n)
    return out


@contextmanager
def all_tokens(module: nn.Module) -> Iterator[None]:
    """Within the block, every expert of every SplitExperts under ``module`` runs on every token
    (their outputs still combine by the real routing)."""
    blocks = [m for m in module.modules() if isinstance(m, SplitExperts)]
    before = [b.route_all_tokens for b in blocks]
    for b in blocks:
        b.route_all_tokens = True
    try:
        yield
    finally:
        for b, v in zip(blocks, before):
            b.route_all_tokens = v


def same_input_groups(layer: nn.Module, groups: list[list[str]], keys: list[str]) -> dict[str, str]:
    """Among ``groups`` (linear paths relative to ``layer``, named by ``keys``), those that read one
    and the same tensor while every expert runs on every token (``all_tokens``): the first linear
    of every expert of a SplitExperts block (gate_proj, or up_proj without a gate). Returns
    key -> the key of the first such group of its block (groups not shared are left out)."""
    first: dict[str, str] = {}
    for name, block in ((n, m) for n, m in layer.named_modules() if isinstance(m, SplitExperts)):
        for e in range(len(block)):
            lead = "gate_proj" if block[e].gate_proj is not None else "up_proj"
            first[f"{name}.{e}.{lead}" if name else f"{e}.{lead}"] = name
    out: dict[str, str] = {}
    rep: dict[str, str] = {}
    for g, key in zip(groups, keys):
        block = first.get(g[0])
        if block is None:
            continue
        rep.setdefault(block, key)
        out[key] = rep[block]
    return out
