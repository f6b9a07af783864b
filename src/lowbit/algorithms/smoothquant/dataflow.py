"""SmoothQuant mappings of one decoder layer, read from its data flow instead of a family table.

One call of the layer (one window of its calibration inputs) runs under a ``TorchFunctionMode``
with hooks on its modules. Every output of a *candidate source* is tagged with the source's
name: a module with a 1-D ``weight`` as wide as its output's last dimension (a norm) or an
``nn.Linear``. A tag follows its tensor through pure views (view, reshape, flatten, a dtype
cast, row indexing) and, through the ops that commute with a positive per-channel scale: a
product with a tensor that is not tagged (the gated MLP's ``act(gate) * up``, a router score),
a division by one, and ReLU. A tensor derived from the source in any other way is never
untagged-but-derived: the op that derived it is itself a use that forbids folding. Then every use of a tagged tensor is one of:

- the input of a target linear (called as a module): that target reads the source;
- a matmul with a weight that is not a target (a router, ``shared_expert_gate``): a *float
  target*, its weight columns rescaled with the targets' so that it computes the same;
- anything else (a residual add, an attention score, a nonlinearity): the source cannot be folded.

A source is a mapping when its tagged values reach at least one target and nothing else. How a
norm folds a per-channel division by s is checked, not assumed: a copy of the norm with each fold
(``SourceKind.RMS``: weight / s; ``LAYERNORM``: weight and bias / s; ``RMS_ONE_PLUS``: Gemma's
(1 + w) / s - 1) applied must compute the original output / s on a random input; none that does:
the source is reported, not folded. A linear source folds its rows and bias (``SourceKind.LINEAR``).

``layer_mappings`` returns the mappings in the order their sources ran (the order the folds are
applied in: an up_proj folded before the norm feeding it would change the weights that norm's
scales are computed from), targets in the order they ran, and, for each source seen
that cannot be folded, why (what the calibration report says for that layer).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lowbit.algorithms.smoothquant.mappings import SmoothMapping, SourceKind
from lowbit.tensor_tags import Tags, tensors

_T = torch.Tensor
_VIEWS = frozenset({_T.view, _T.reshape, torch.reshape, torch.flatten, _T.flatten, _T.contiguous, _T.to, _T.float,
                    _T.type, _T.type_as, _T.__getitem__, torch.index_select, _T.index_select, _T.view_as,
                    _T.reshape_as, _T.repeat, _T.expand, _T.expand_as, _T.unsqueeze, F.dropout})
_METADATA = frozenset({torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, _T.new_zeros, _T.new_ones,
                       _T.new_empty, _T.new_full})  # shape, dtype and device only
_HOMOGENEOUS = frozenset({F.relu, torch.relu, _T.relu})  # relu(x / s) = relu(x) / s for s > 0
_MULS = frozenset({torch.mul, _T.mul, _T.__mul__, _T.__rmul__})
_DIVS = frozenset({torch.div, _T.div, _T.__truediv__})  # the tagged tensor divided by another
_MATMUL = frozenset({F.linear, torch.matmul, _T.matmul, _T.__matmul__, torch.mm, torch.bmm})


@dataclass
class _Source:
    name: str
    linear: bool
    targets: list[str] = field(default_factory=list)
    float_targets: list[str] = field(default_factory=list)
    other: str | None = None  # the first use that forbids folding


class _Flow(TorchFunctionMode):
    def __init__(self, weights: dict[int, str]) -> None:
        super().__init__()
        self.tags = Tags()
        self.sources: dict[str, _Source] = {}
        self.weights = weights  # id(weight parameter) -> its module's name
        self.inside: list[str] = []  # the target linears whose forward is running

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.inside or func in _METADATA:  # a target linear's own product (recorded by its pre-hook),
            return out                        # or zeros_like and kin: shape, dtype and device only
        tagged = [(t, n) for t in tensors((args, kwargs)) if (n := self.tags.of(t)) is not None]
        outs = list(tensors(out))
        if not tagged or not outs:  # .shape, .size(): metadata, not a use of the values
            return out
        for t, n in tagged:
            src = self.sources[n]
            if func in _VIEWS and args and args[0] is t:
                for o in outs:
                    self.tags.tag(o, n)
            elif func in _MATMUL and args and args[0] is t and len(args) > 1 and id(args[1]) in self.weights:
                owner = self.weights[id(args[1])]
                if owner not in src.float_targets:
                    src.float_targets.append(owner)
            elif func in _HOMOGENEOUS or len(tagged) == 1 and (func in _MULS or func in _DIVS and args[0] is t):
                for o in outs:  # (x / s) * g = (x * g) / s for g not derived from x; relu likewise
                    self.tags.tag(o, n)
            elif src.other is None:
                src.other = getattr(func, "__name__", str(func))
        return out


def _norm_kind(norm: nn.Module, width: int) -> SourceKind | None:
    """The fold under which ``norm`` computes its output / s (module docstring), or None."""
    g = torch.Generator().manual_seed(0)
    w = norm.weight
    x = torch.randn(4, width, generator=g).to(w.device, w.dtype)
    s = (torch.rand(width, generator=g) + 0.5).to(w.device)
    with torch.no_grad():
        ref = norm(x)
        if not isinstance(ref, torch.Tensor):
            return None
        kinds = [SourceKind.LAYERNORM] if getattr(norm, "bias", None) is not None else [SourceKind.RMS]
        for kind in kinds + [SourceKind.RMS_ONE_PLUS]:
            trial = copy.deepcopy(norm)
            tw = trial.weight
            if kind is SourceKind.RMS_ONE_PLUS:
                tw.data.copy_(((1.0 + tw.data.float()) / s - 1.0).to(tw.dtype))
            else:
                tw.data.copy_((tw.data.float() / s).to(tw.dtype))
                if kind is SourceKind.LAYERNORM:
                    trial.bias.data.copy_((trial.bias.data.float() / s).to(trial.bias.dtype))
            if torch.allclose(trial(x).float(), ref.float() / s, rtol=1e-3, atol=1e-5):
                return kind
    return None


def norm_fold_kind(norm: nn.Module, width: int) -> SourceKind | None:
    """The fold under which ``norm`` (a module with a 1-D weight) computes its output / s, checked on a
    copy (module docstring); None when no fold does or the norm cannot be called on one tensor."""
    try:
        return _norm_kind(norm, width)
    except (TypeError, RuntimeError, ValueError):  # a norm of more inputs (gated RMSNorm): not checked
        return None


def _is_norm(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return isinstance(w, torch.Tensor) and w.dim() == 1 and not isinstance(module, nn.Linear)


@torch.no_grad()
def layer_mappings(layer: nn.Module, call: tuple[tuple, dict], targets: list[str]
                   ) -> tuple[tuple[SmoothMapping, ...], dict[str, str]]:
    """The mappings of ``layer`` onto the linears ``targets`` (paths relative to the layer), read
    from one call (module docstring), and name -> why for the sources seen that cannot be folded."""
    target_set = set(targets)
    mods = dict(layer.named_modules())
    weights = {id(m.weight): n for n, m in mods.items() if isinstance(getattr(m, "weight", None), torch.Tensor)}
    flow = _Flow(weights)
    handles = []

    def post(name, linear):
        def hook(_m, _a, out):
            if name in target_set:
                flow.inside.pop()
            if isinstance(out, torch.Tensor) and out.dim() >= 1 and (linear or _is_norm(_m)) \
                    and (linear or out.shape[-1] == _m.weight.shape[0]):
                flow.sources.setdefault(name, _Source(name, linear))
                flow.tags.tag(out, name)
        return hook

    def pre(name):
        def hook(_m, args, kwargs):
            x = args[0] if args else next(iter(kwargs.values()), None)
            src = flow.tags.of(x)
            if src is not None and name not in flow.sources[src].targets:
                flow.sources[src].targets.append(name)
            flow.inside.append(name)
        return hook

    for n, m in mods.items():
        if not n:
            continue
        linear = isinstance(m, nn.Linear)
        if n in target_set:
            handles.append(m.register_forward_pre_hook(pre(n), with_kwargs=True))
        if linear or _is_norm(m):
            handles.append(m.register_forward_hook(post(n, linear)))
    try:
        with flow:
            layer(*call[0], **call[1])
    finally:
        for h in handles:
            h.remove()
    maps: list[SmoothMapping] = []
    skipped: dict[str, str] = {}
    for src in flow.sources.values():  # in the order the sources ran: each fold sees the ones before it
        if not src.targets:
            continue
        if src.other is not None:
            skipped[src.name] = f"its output also feeds {src.other}"
            continue
        if src.linear:
            kind = SourceKind.LINEAR
        else:
            kind = norm_fold_kind(mods[src.name], mods[src.name].weight.shape[0])
            if kind is None:
                skipped[src.name] = "no fold of its weight divides its output by s"
                continue
        ft = tuple(f for f in src.float_targets if f not in target_set)
        maps.append(SmoothMapping(src.name, tuple(src.targets), kind, float_targets=ft))
    return tuple(maps), skipped
