"""Which modules of a model get quantized: exact rules on module types and name components.

Quantized: every ``nn.Linear`` except the output embedding (lm_head, unless asked), MoE
routers (last name component exactly ``gate``, ``router`` or ``shared_expert_gate``), modules under a non-text
tower (a name component exactly one of NON_TEXT_COMPONENTS), and names matching an ``ignore``
pattern (an exact name, or a regular expression that must match the whole name).
"""

from __future__ import annotations

import copy
import re
from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from lowbit.param_uses import ParamKind, Trace, structural_kind, trace_model

ROUTER_COMPONENTS = frozenset({"gate", "router", "shared_expert_gate"})  # MoE routers stay in float
NON_TEXT_COMPONENTS = frozenset({
    "vision_tower", "vision_model", "visual", "vision_encoder", "audio_tower", "audio_model",
    "multi_modal_projector", "mm_projector",
})


def matches_ignore(name: str, ignore: Iterable[str]) -> bool:
    for pat in ignore:
        if name == pat or re.fullmatch(pat, name):
            return True
    return False


def is_excluded_name(name: str, ignore: Iterable[str] = ()) -> bool:
    """The name-based exclusions shared by in-memory and model-free quantization."""
    parts = name.split(".")
    if parts[-1] in ROUTER_COMPONENTS:
        return True
    if any(p in NON_TEXT_COMPONENTS for p in parts):
        return True
    return matches_ignore(name, ignore)


def output_embedding_names(model: nn.Module) -> set[str]:
    out = getattr(model, "get_output_embeddings", lambda: None)()
    if out is None:
        return set()
    return {n for n, m in model.named_modules() if m is out}


def probe_key(module: nn.Module, *shapes) -> tuple:
    """What a probe of ``module`` on seeded random values depends on: its class, ``shapes`` (its
    tensors' sizes, as the caller names them) and its plain attributes (ints, floats, strings,
    flags: its constants). The memo key of every such probe (``is_plain_linear``,
    ``lowbit.moe.row_groups``, ``lowbit.moe.weighted_shared``, ``lowbit.moe.split``)."""
    attrs = tuple(sorted((k, v) for k, v in vars(module).items()
                         if not k.startswith("_") and isinstance(v, (int, float, str, bool, type(None)))))
    return (type(module), shapes, attrs)


#: memo of ``is_plain_linear``'s probe: (class, in, out, bias, plain attributes) -> verdict. The probe
#: is a pure function of these (its weights are seeded random), so a model's many linears of one
#: class and shape (FalconLinear: every projection) are probed once.
_PLAIN: dict[tuple, bool] = {}


def is_plain_linear(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Linear`` that computes x W^T + b on its last axis: its class
    keeps ``nn.Linear.forward``, or its own forward, run on a stand-in with seeded random weights
    (weights on the meta device do too; the module's own are not copied), returns ``F.linear``'s
    values (or a tuple holding them: a router that also returns its scores). A subclass with
    another computation (DeepSeek-V4's grouped ``o_a_proj``: one block of rows per head group,
    through ``bmm``) is not a linear to lowbit: ``lowbit.linearize`` splits it into one linear per
    group when its forward is that block-diagonal product (``lowbit.moe.row_groups``); otherwise
    its weight is surveyed like any parameter (a matmul weight outside a linear: refused, naming it)."""
    if not isinstance(module, nn.Linear):
        return False
    if type(module).forward is nn.Linear.forward:
        return True
    key = probe_key(module, module.in_features, module.out_features, module.bias is None)
    if key not in _PLAIN:
        _PLAIN[key] = _probe_plain(module)
    return _PLAIN[key]


@torch.no_grad()
def _probe_plain(module: nn.Linear) -> bool:
    gen = torch.Generator().manual_seed(0)
    probe = copy.copy(module)  # shallow: new parameter and buffer tables, the module's tensors untouched
    probe._parameters = {k: None if p is None else nn.Parameter(torch.randn(p.shape, generator=gen),
                                                                 requires_grad=False)
                         for k, p in module._parameters.items()}
    probe._buffers = {k: None if b is None else torch.zeros(b.shape, dtype=b.dtype)
                      for k, b in module._buffers.items()}
    x = torch.randn(3, module.in_features, generator=gen)
    try:
        y = probe(x)
    except Exception:  # noqa: BLE001 - a forward that cannot take [rows, in] is not a plain linear
        return False
    want = F.linear(x, probe.weight, probe.bias)
    return any(isinstance(t, torch.Tensor) and t.shape == want.shape and torch.allclose(t, want, rtol=1e-4, atol=1e-5)
               for t in (y if isinstance(y, (tuple, list)) else (y,)))


def quantizable_linears(model: nn.Module, ignore: Iterable[str] = (), include_lm_head: bool = False) -> list[str]:
    """Names of the linears (``is_plain_linear``) to quantize, in model order."""
    ignore = list(ignore)
    heads = set() if include_lm_head else output_embedding_names(model)
    names = []
    for name, mod in model.named_modules():
        if not is_plain_linear(mod):
            continue
        if name in heads or is_excluded_name(name, ignore):
            continue
        names.append(name)
    return names


def _weight_candidates(model: nn.Module, ignore: list[str], include_lm_head: bool) -> dict[str, tuple[nn.Module, nn.Parameter]]:
    """Floating-point parameters of two or more dimensions outside linears (``is_plain_linear``)
    and ``nn.Embedding`` modules, the output embedding (unless ``include_lm_head``) and the modules
    excluded by name: parameter name -> (its module, it)."""
    heads = set() if include_lm_head else output_embedding_names(model)
    out = {}
    for mod_name, mod in model.named_modules():
        if isinstance(mod, nn.Embedding) or is_plain_linear(mod) or mod_name in heads or is_excluded_name(mod_name, ignore):
            continue
        for p_name, p in mod.named_parameters(recurse=False):
            if p.dim() >= 2 and p.is_floating_point():
                out[f"{mod_name}.{p_name}" if mod_name else p_name] = (mod, p)
    return out


def survey_weights(model: nn.Module, ignore: Iterable[str] = (), include_lm_head: bool = False) -> Trace:
    """What the forward does with the model's weights (``lowbit.param_uses.trace_model``, one
    forward on a few tokens): the kind of every parameter of two or more dimensions that is not an
    ``nn.Linear`` weight (nor an embedding table, the output embedding or a module excluded by
    name; only ``ParamKind.MATMUL`` ones are targets), the linears whose weight is read without
    calling them, the routers found by their top-k and the linears whose outputs weight hidden
    vectors (``param_uses``: coefficient linears). When the forward cannot run (a model on
    the meta device), the kinds come from types and shapes (``structural_kind``) and no linear is
    set apart."""
    cands = _weight_candidates(model, list(ignore), include_lm_head)
    traced = trace_model(model, {n: p for n, (_, p) in cands.items()})
    if traced is None:
        return Trace({n: structural_kind(m, p) for n, (m, p) in cands.items()}, [], [], traced=False)
    heads = set() if include_lm_head else output_embedding_names(model)
    ignore = list(ignore)
    keep = [n for n in traced.read_directly if n not in heads and not is_excluded_name(n, ignore)]
    routers = [n for n in traced.routers if n not in heads and not is_excluded_name(n, ignore)]
    coefs = [n for n in traced.coefficients if n not in heads and not is_excluded_name(n, ignore)]
    return Trace(traced.kinds, keep, routers, coefficients=coefs)


def unquantizable_targets(model: nn.Module, ignore: Iterable[str] = (), include_lm_head: bool = False
                          ) -> list[tuple[str, tuple[int, ...]]]:
    """Weight matrices a scheme targets that lowbit cannot quantize: (parameter name, shape).

    A target is a matmul weight (``survey_weights``: ``ParamKind.MATMUL``) that is not an
    ``nn.Linear`` weight (those are quantized; transformers' ``Conv1D``, fused experts and linears
    applied per input group become linears first, ``lowbit.linearize``). Depthwise convolutions, Mamba's ``A_log``, router
    score-correction biases and other parameters the forward does not multiply as a matrix are
    not targets (they stay in float, ``float_weights``)."""
    return matmul_targets(model, survey_weights(model, ignore, include_lm_head).kinds)


def matmul_targets(model: nn.Module, kinds: dict[str, ParamKind]) -> list[tuple[str, tuple[int, ...]]]:
    """The ``ParamKind.MATMUL`` entries of ``kinds`` with their shapes."""
    shapes = dict(model.named_parameters(remove_duplicate=False))
    return [(n, tuple(shapes[n].shape)) for n, k in kinds.items() if k is ParamKind.MATMUL]


READ_DIRECTLY = "linear whose weight the forward reads without calling it"
COEFFICIENTS = "linear whose outputs weight hidden vectors (mixing coefficients, as a router's)"


def float_weights(survey: Trace) -> dict[str, str]:
    """What stays in float and why, from ``survey_weights``: name -> kind (the non-target
    parameters, the linears whose weight the forward reads directly, and the coefficient linears)."""
    out = {n: k.value for n, k in survey.kinds.items() if k is not ParamKind.MATMUL}
    out.update({f"{n}.weight": READ_DIRECTLY for n in survey.read_directly})
    out.update({f"{n}.weight": COEFFICIENTS for n in survey.coefficients})
    return out


def set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` at the dotted ``name`` of ``model`` (replacing what is there)."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)
