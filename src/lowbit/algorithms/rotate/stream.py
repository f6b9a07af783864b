"""Where a causal LM's residual stream is read and written, read from one forward of the model.

``trace_stream(model)`` runs the model once on a few token ids (every expert on every token,
``lowbit.moe.all_tokens``) under a ``TorchFunctionMode`` with hooks on its modules, and tags
tensors by where their values come from (``Origin``): the residual stream (the input embedding's
output on), a norm called on the stream, the whole output of a linear, a slice of one, a linear's
output mixed across tokens by attention (the value of ``scaled_dot_product_attention``, or the
right operand of a matmul with attention probabilities), another embedding, or anything else
derived from those (named by the module or op that made it). Linears, norms (leaf modules with a
1-D weight) and embeddings are followed as wholes, not through their own ops.

A block of split experts (``lowbit.moe.SplitExperts``) returns the sum of its experts' outputs
weighted by the routing, so its output carries every expert's output, routed on these tokens or
not.

Tags pass through reshapes, casts and views; through row selections (a slice that keeps the last
dimension); through sums of tagged tensors; and through a product or quotient with a tensor that
is constant over the last dimension (a scalar, a router's per-token weight), all of which commute
with a rotation of the last dimension. What the trace records (``StreamFlow``):

- readers: a linear called on the stream or on a stream norm's output, or whose weight multiplies
  one (a router called as ``F.linear(x, router.weight)``);
- writers: linears and embeddings whose output is added into the stream;
- attention pairs: a linear (o) whose input is exactly one linear's (v) attention-mixed output,
  with the head width attention saw;
- events in the order they happened: the stream norms found (their kind is checked afterwards,
  on a copy, by ``layout``) and the problems: the stream or a stream norm's output used any other
  way (a channel slice, a per-channel product, a nonlinearity), or something other than a writer
  added into the stream (a norm after o_proj, a scaled or biased output).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lowbit.tensor_tags import Tags, tensors


class Origin(str, Enum):
    STREAM = "stream"
    NORM = "norm"            # a norm called on the stream
    LINEAR = "linear"        # a linear's whole output
    PART = "part"            # a slice of a linear's output channels
    VALUE = "value"          # a linear's whole output mixed across tokens by attention
    EMBEDDING = "embedding"  # an embedding other than the input embedding
    OTHER = "other"


@dataclass(frozen=True)
class Tag:
    origin: Origin
    name: str = ""  # the module (OTHER: the module or op that made the tensor)
    width: int = 0  # VALUE: the head width attention saw


class Event(str, Enum):
    NORM = "norm"        # a norm read the stream (its kind is checked after the trace)
    PROBLEM = "problem"  # a use that a fused rotation cannot follow


@dataclass
class StreamFlow:
    """What one forward showed (module docstring); module names are full names in the model."""

    norms: dict[str, list[str]] = field(default_factory=dict)  # stream norm -> readers, in order
    direct: list[str] = field(default_factory=list)            # linears reading the stream itself
    writers: list[str] = field(default_factory=list)           # linears added into the stream
    embeddings: list[str] = field(default_factory=list)        # embeddings added into the stream
    pairs: list[tuple[str, str, int]] = field(default_factory=list)  # (v, o, head width)
    events: list[tuple[Event, str, str]] = field(default_factory=list)  # (event, module, why)
    used: set[str] = field(default_factory=set)                # modules called or whose weight was used


_T = torch.Tensor
_STREAM = frozenset({Tag(Origin.STREAM)})
_WATCHED = (Origin.STREAM, Origin.NORM)
_RESHAPES = frozenset({_T.view, _T.reshape, torch.reshape, torch.flatten, _T.flatten, _T.contiguous, _T.to, _T.float,
                       _T.type, _T.type_as, _T.view_as, _T.reshape_as, _T.expand, _T.expand_as, _T.unsqueeze,
                       torch.unsqueeze, _T.squeeze, torch.squeeze, _T.transpose, torch.transpose, _T.permute,
                       torch.permute, _T.t, _T.clone, torch.clone, _T.detach, F.dropout})
_SELECTS = frozenset({_T.__getitem__, torch.index_select, _T.index_select, torch.narrow, _T.narrow, torch.split,
                      _T.split, torch.chunk, _T.chunk, torch.unbind, _T.unbind, _T.repeat, _T.repeat_interleave,
                      torch.repeat_interleave})  # the last dimension kept: rows; else: channels
_ADDS = frozenset({torch.add, _T.add, _T.__add__, _T.__radd__, _T.add_, _T.__iadd__, torch.sub, _T.sub, _T.__sub__,
                   _T.__rsub__, _T.sub_, _T.__isub__})
_ACCUMULATE = {_T.index_add_: 3, _T.index_add: 3, torch.index_add: 3, _T.__setitem__: 2, _T.index_put_: 2,
               _T.index_put: 2, torch.index_put: 2}  # -> the position of the added values
_MULS = frozenset({torch.mul, _T.mul, _T.__mul__, _T.__rmul__, _T.mul_, _T.__imul__})
_DIVS = frozenset({torch.div, _T.div, _T.__truediv__, _T.div_, _T.__itruediv__})
_SUMS = frozenset({torch.sum, _T.sum})
_JOINS = frozenset({torch.stack, torch.cat, torch.concat, torch.concatenate})
_MATMUL = frozenset({F.linear, torch.matmul, _T.matmul, _T.__matmul__, torch.mm, _T.mm, torch.bmm, _T.bmm})
_FRESH = frozenset({torch.zeros_like, torch.empty_like, _T.new_zeros, _T.new_empty, torch.zeros, torch.empty})
_SDPA = F.scaled_dot_product_attention


def _per_token(x) -> bool:
    """A number, or a tensor constant over the last dimension (it scales every channel alike)."""
    return not isinstance(x, torch.Tensor) or x.numel() == 1 or (x.dim() >= 1 and x.shape[-1] == 1)


def is_norm(module: nn.Module) -> bool:
    """A leaf module with a 1-D weight that is not a linear: what the trace treats as a norm."""
    w = getattr(module, "weight", None)
    return isinstance(w, torch.Tensor) and w.dim() == 1 and not module._modules and not isinstance(module, nn.Linear)


class _Trace(TorchFunctionMode):
    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.tags: Tags[frozenset] = Tags()
        self.weights: Tags[str] = Tags()  # a module's weight (or a cast or view of it) -> the module
        for n, w in weights.items():
            self.weights.tag(w, n)
        self.flow = StreamFlow()
        self.where: list[str] = [""]  # the modules running, innermost last
        self.opaque = 0               # > 0 inside a linear, norm or embedding
        self.on_stream = False        # the norm running was called on the stream
        self.experts: dict[str, frozenset] = {}  # an expert's output tags, until its block returns

    def problem(self, module: str, why: str) -> None:
        self.flow.events.append((Event.PROBLEM, module, why))

    def watch(self, tags, what: str) -> None:
        """The stream or a stream norm's output used by ``what``, which a rotation cannot follow."""
        for t in tags or ():
            if t.origin is Origin.STREAM:
                self.problem(self.where[-1] or "the model", f"uses the residual stream in {what}")
            elif t.origin is Origin.NORM:
                self.problem(t.name, f"reads the residual stream and its output also feeds {what} in "
                                     f"{self.where[-1] or 'the model'}")

    def read(self, reader: str, tags) -> None:
        for t in tags or ():
            if t.origin is Origin.STREAM and reader not in self.flow.direct:
                self.flow.direct.append(reader)
            elif t.origin is Origin.NORM and reader not in self.flow.norms[t.name]:
                self.flow.norms[t.name].append(reader)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.opaque:
            return out
        outs = list(tensors(out)) if func not in _ACCUMULATE else [args[0]]
        if func in _FRESH:  # zeros, or storage every element of which is written before use
            for o in outs:
                self.tags.tag(o, frozenset())
            return out
        ins = list(tensors((args, kwargs)))
        for t in ins:
            if (w := self.weights.of(t)) is not None:
                self.flow.used.add(w)
                if func in _RESHAPES and t is args[0]:
                    for o in outs:
                        self.weights.tag(o, w)
        if outs and any(self.tags.of(t) for t in ins):
            self.follow(func, args, kwargs, outs)
        return out

    def set(self, outs, tags) -> None:
        for o in outs:
            self.tags.tag(o, frozenset(tags))

    def follow(self, func, args, kwargs, outs) -> None:
        of, here = self.tags.of, self.where[-1]
        what = f"{getattr(func, '__name__', str(func))}"
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if first is not None and of(first) and (func in _RESHAPES or func in _SELECTS):
            return self.reshape(func, first, outs, what)
        if func in _ADDS or func in _ACCUMULATE:
            k = _ACCUMULATE.get(func, 1)
            parts = list(args[:2]) if func in _ADDS else [args[0], args[k] if len(args) > k else kwargs.get("source",
                                                                                                    kwargs.get("values"))]
            return self.add(parts, outs, what)
        if func in _MULS or func in _DIVS or func in _SUMS:
            return self.scale(func, args, kwargs, outs, what)
        if func in _JOINS and args and isinstance(args[0], (list, tuple)):
            return self.join(func, args, kwargs, outs, what)
        if func in _MATMUL and len(args) > 1:
            return self.matmul(args[0], args[1], outs, what)
        if func is _SDPA:
            value = args[2] if len(args) > 2 else kwargs.get("value")
            for t in (args[:2] + (value,)):
                self.watch(of(t), what)
            tv = of(value) or frozenset()
            if tv and all(t.origin is Origin.LINEAR for t in tv):
                return self.set(outs, {Tag(Origin.VALUE, t.name, value.shape[-1]) for t in tv})
        for t in tensors((args, kwargs)):
            self.watch(of(t), what)
        self.set(outs, {Tag(Origin.OTHER, f"{what} in {here or 'the model'}")})

    def reshape(self, func, first, outs, what) -> None:
        tags = self.tags.of(first)
        for o in outs:
            keeps = o.dim() >= 1 and first.dim() >= 1 and o.shape[-1] == first.shape[-1]
            if keeps or (func in _RESHAPES and not any(t.origin in _WATCHED for t in tags)):
                self.set([o], tags)
                continue
            self.watch(tags, f"{what} across its channels")
            self.set([o], {Tag(Origin.PART, t.name) if t.origin is Origin.LINEAR else
                           Tag(Origin.OTHER, f"{what} in {self.where[-1]}") for t in tags})

    def add(self, parts, outs, what) -> None:
        sets = [self.tags.of(p) if isinstance(p, torch.Tensor) else (None if p else frozenset()) for p in parts]
        union = frozenset().union(*(s for s in sets if s))
        for t in union:
            if t.origin is Origin.NORM:
                self.watch({t}, what)
        if Tag(Origin.STREAM) not in union:
            return self.set(outs, union if all(s is not None for s in sets) else
                            union | {Tag(Origin.OTHER, f"{what} in {self.where[-1]}")})
        if any(s is None for s in sets):
            self.problem(self.where[-1] or "the model", f"adds to the residual stream (by {what}) a tensor that "
                                                         "no linear or embedding computed")
        for t in union:
            if t.origin is Origin.LINEAR and t.name not in self.flow.writers:
                self.flow.writers.append(t.name)
            elif t.origin is Origin.EMBEDDING and t.name not in self.flow.embeddings:
                self.flow.embeddings.append(t.name)
            elif t.origin is Origin.PART:
                self.problem(t.name, "writes part of its output into the residual stream")
            elif t.origin in (Origin.VALUE, Origin.OTHER):
                self.problem(t.name, "writes the residual stream, and is not a linear (e.g. a norm after "
                                     "o_proj/down_proj, before the residual add): the residual stream cannot be "
                                     "rotated by fusion")
        self.set(outs, _STREAM)

    def scale(self, func, args, kwargs, outs, what) -> None:
        of = self.tags.of
        if func in _SUMS:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            x = args[0]
            last = {-1, x.dim() - 1}
            dims = set(dim) if isinstance(dim, (tuple, list)) else {dim}
            if dim is not None and not dims & last:
                return self.set(outs, of(x))
            return self.other(args, kwargs, outs, what)
        a, b = args[0], args[1] if len(args) > 1 else kwargs.get("other")
        if _per_token(b) and isinstance(a, torch.Tensor) and not _per_token(a):
            return self.set(outs, of(a) or {Tag(Origin.OTHER, f"{what} in {self.where[-1]}")})
        if func in _MULS and _per_token(a) and isinstance(b, torch.Tensor) and not _per_token(b):
            return self.set(outs, of(b) or {Tag(Origin.OTHER, f"{what} in {self.where[-1]}")})
        self.other(args, kwargs, outs, f"{what} (per channel)")

    def join(self, func, args, kwargs, outs, what) -> None:
        """Stacked or concatenated along a dimension other than the last: rows, every part's tags."""
        parts = list(args[0])
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        ndim = parts[0].dim() + (1 if func is torch.stack else 0)
        sets = [self.tags.of(p) for p in parts]
        if dim % ndim == ndim - 1 or any(s is None for s in sets):
            return self.other(args, kwargs, outs, what)
        self.set(outs, frozenset().union(*sets))

    def other(self, args, kwargs, outs, what) -> None:
        for t in tensors((args, kwargs)):
            self.watch(self.tags.of(t), what)
        self.set(outs, {Tag(Origin.OTHER, f"{what} in {self.where[-1]}")})

    def matmul(self, a, b, outs, what) -> None:
        of = self.tags.of
        w = self.weights.of(b) or self.weights.of(a)
        if w is not None:  # a weight used without calling its module (a router's F.linear)
            self.read(w, of(a) if self.weights.of(b) else of(b))
            return self.set(outs, {Tag(Origin.LINEAR, w)})
        ta, tb = of(a) or frozenset(), of(b) or frozenset()
        if tb and all(t.origin is Origin.LINEAR for t in tb) and not any(t.origin is Origin.LINEAR for t in ta):
            self.watch(ta, what)  # attention probabilities times a linear's output: mixed across tokens
            return self.set(outs, {Tag(Origin.VALUE, t.name, b.shape[-1]) for t in tb})
        self.other((a, b), {}, outs, what)


def _first_tensor(args, kwargs):
    return next(iter(tensors((args, kwargs))), None)


@torch.no_grad()
def trace_stream(model: nn.Module, tokens: int = 8) -> StreamFlow:
    """One forward of ``model`` on ``tokens`` token ids, followed (module docstring). The forward's
    own exception propagates."""
    from lowbit.moe import all_tokens
    from lowbit.moe.experts import ExpertMLP, SplitExperts

    embedding = model.get_input_embeddings()
    mods = dict(model.named_modules())
    weights = {n: m.weight for n, m in mods.items() if isinstance(getattr(m, "weight", None), torch.Tensor)}
    trace = _Trace(weights)
    flow = trace.flow

    def opaque(m: nn.Module) -> bool:
        return isinstance(m, (nn.Linear, nn.Embedding)) or is_norm(m)

    def pre(name):
        def hook(m, args, kwargs):
            trace.where.append(name)
            if not m._modules:
                flow.used.add(name)
            if opaque(m) and not trace.opaque:
                tags = trace.tags.of(_first_tensor(args, kwargs)) or frozenset()
                if isinstance(m, nn.Linear):
                    trace.read(name, tags)
                    if len(tags) == 1 and next(iter(tags)).origin is Origin.VALUE:
                        v = next(iter(tags))
                        flow.pairs.append((v.name, name, v.width))
                elif is_norm(m):
                    trace.on_stream = Tag(Origin.STREAM) in tags
                    if trace.on_stream and name not in flow.norms:
                        flow.norms[name] = []
                        flow.events.append((Event.NORM, name, ""))
                    trace.watch(tags - _STREAM, name)
            if opaque(m):
                trace.opaque += 1
        return hook

    def post(name):
        def hook(m, args, kwargs, out):
            trace.where.pop()
            if isinstance(m, ExpertMLP):
                trace.experts[name] = trace.tags.of(out) or frozenset()
            elif isinstance(m, SplitExperts) and isinstance(out, torch.Tensor):  # every expert writes its output,
                ran = [trace.experts.pop(f"{name}.{e}", frozenset()) for e in range(len(m))]  # routed or not
                trace.set([out], (trace.tags.of(out) or frozenset()).union(*ran))
            if not opaque(m):
                return
            trace.opaque -= 1
            if trace.opaque or not isinstance(out, torch.Tensor):
                return
            if m is embedding:
                trace.set([out], _STREAM)
            elif isinstance(m, nn.Embedding):
                trace.set([out], {Tag(Origin.EMBEDDING, name)})
            elif isinstance(m, nn.Linear):
                trace.set([out], {Tag(Origin.LINEAR, name)})
            else:
                trace.set([out], {Tag(Origin.NORM, name)} if trace.on_stream else {Tag(Origin.OTHER, name)})
        return hook

    handles = []
    for n, m in mods.items():
        if n:
            handles += [m.register_forward_pre_hook(pre(n), with_kwargs=True),
                        m.register_forward_hook(post(n), with_kwargs=True)]
    first = next(model.parameters())
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 32
    ids = (torch.arange(tokens) % max(int(vocab) - 1, 1) + 1).reshape(1, -1).to(first.device)
    try:
        with all_tokens(model), trace:
            model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return flow
