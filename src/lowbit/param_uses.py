"""What each weight of a model is for, read from its forward: a matmul operand or something else.

A scheme targets matmul weights. ``nn.Linear`` says so by its type; a parameter held elsewhere
(Mamba's ``A_log``, a depthwise ``conv1d``, a router's score-correction bias, RWKV's time-mix
vectors, fused experts of an unknown layout) says so only by what the forward does with it.
``trace_model`` runs the model once on a few tokens under a ``TorchFunctionMode`` that follows
each asked-for parameter through the ops it flows into:

- a tensor derived from a parameter (by indexing, slicing, a view, a cast, or an op whose output
  has the parameter's element count, e.g. ``w * scale``) stays that parameter's;
- a linear's output stays that linear's through the same ops, and through a product with another
  activation (not a weight): a score multiplied by scores is still a score (DeepSeek-V3.2's and
  GLM-MoE-DSA's indexer: ``weights_proj``'s per-head weights times the heads' q.k scores, then top-k);
- an operand of a matmul (``F.linear``, ``matmul``/``@``, ``mm``, ``bmm``, ``addmm``,
  ``baddbmm``, ``einsum``, grouped matmuls, a convolution with ``groups == 1``) makes it a
  ``ParamKind.MATMUL`` weight;
- otherwise a convolution with groups (``DEPTHWISE_CONV``), a table read by ``F.embedding``
  (``LOOKUP``), any other op (``ELEMENTWISE``), or no op at all on those tokens (``UNUSED``).

Linears are followed too (their outputs tagged ``out:NAME``): one whose output reaches a top-k is a
router; one whose output multiplies hidden vectors as per-token coefficients (in a product of two
activations, broadcast along an axis of the model's hidden width: a ``[..., 1]`` factor of a
``[..., H]`` tensor, or the right operand ``[..., k, n]`` of a matmul whose rows are the H hidden
features, k and n not H (attention's k^T and v are not, on as many tokens as H), as
Gemma 3n's AltUp ``correction_coefs`` / ``prediction_coefs`` mix its four residual streams and an
MoE router's weights mix the experts' outputs) is a *coefficient* linear: like a router it decides
how much of each hidden vector passes, not what the vector holds, and stays in float. Linears whose
outputs are the hidden vectors' values (q/k/v, gates of the same width, MLP, experts) are not.

A matmul weight outside a linear whose products are such coefficients (DeepSeek-V4's and
Hunyuan-V4's hyper-connection ``fn``: the pre/post/comb weights that mix the residual streams) is
``ParamKind.COEFFICIENT``. Only ``MATMUL`` weights are targets; the others stay in float and are
listed by kind. When the
forward cannot run (a model on the meta device, a forward that needs more than token ids),
``structural_kind`` decides from types and shapes alone: a grouped ``nn.Conv*`` with one input
channel per group is a depthwise convolution, a tensor with a dimension of size 1 is a vector
(``ELEMENTWISE``), anything else ``MATMUL`` (an error naming it, never a guess that skips it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lowbit.tensor_tags import Tags, tensors


class ParamKind(str, Enum):
    MATMUL = "matmul weight"
    COEFFICIENT = "matmul weight whose outputs weight hidden vectors (mixing coefficients)"
    DEPTHWISE_CONV = "depthwise convolution"
    LOOKUP = "lookup table"
    ELEMENTWISE = "elementwise parameter"
    UNUSED = "not used by the forward"

    def __str__(self) -> str:
        return self.value


def _ops(*fns) -> frozenset:
    return frozenset(f for f in fns if f is not None)


_T = torch.Tensor
_MATMUL = _ops(F.linear, torch.matmul, _T.matmul, _T.__matmul__, _T.__rmatmul__, torch.mm, _T.mm, torch.bmm, _T.bmm,
               torch.addmm, _T.addmm, torch.baddbmm, _T.baddbmm, torch.addbmm, torch.einsum, torch.tensordot,
               getattr(torch, "_grouped_mm", None), getattr(F, "grouped_mm", None))
_ADDED_FIRST = _ops(torch.addmm, _T.addmm, torch.baddbmm, _T.baddbmm, torch.addbmm)  # args[0] is added, not multiplied
_TOPK = _ops(torch.topk, _T.topk, torch.argsort, _T.argsort, torch.sort, _T.sort, torch.argmax, _T.argmax)
_CONV = _ops(F.conv1d, F.conv2d, F.conv3d)
_MUL = _ops(torch.mul, _T.mul, _T.__mul__, _T.__rmul__)
_PRODUCT = _ops(torch.matmul, _T.matmul, _T.__matmul__)
_LOOKUP = _ops(F.embedding)
_SELECT = _ops(_T.__getitem__, torch.index_select, _T.index_select, torch.narrow, _T.narrow, torch.select,
               _T.select, torch.chunk, _T.chunk, torch.split, _T.split, torch.unbind, _T.unbind,
               torch.tensor_split, _T.tensor_split)


class _Follow(TorchFunctionMode):
    """Follows the tracked tensors through the ops of a forward (module docstring)."""

    def __init__(self, params: dict[str, torch.Tensor], hidden: int | None = None) -> None:
        super().__init__()
        self.tags = Tags()
        self.uses: dict[str, set[ParamKind]] = {n: set() for n in params}
        self.selected: set[str] = set()  # tracked names whose values reach a top-k selection
        self.hidden = hidden  # the model's hidden width (None: no coefficient is looked for)
        self.coefficients: set[str] = set()  # tracked names whose values weight hidden vectors
        for n, p in params.items():
            self.tags.tag(p, n)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tracked = [(t, n) for t in tensors((args, kwargs)) if (n := self.tags.of(t)) is not None]
        if not tracked:
            return out
        if func in _TOPK:
            for _, n in tracked:
                self.selected.add(n)
            return out
        if (func in _MUL or func in _PRODUCT) and self.hidden and isinstance(out, torch.Tensor):
            self._coefficients(func, args, out, tracked)
        if func in _MATMUL:
            kind = ParamKind.MATMUL
            skip = {id(t) for t in tensors(args[0] if func in _ADDED_FIRST and args else None)}
            skip |= {id(t) for t in tensors(args[2] if func is F.linear and len(args) > 2 else kwargs.get("bias"))}
            for t, n in tracked:
                if id(t) in skip and n in self.uses:  # an added term (a bias), not a matrix operand
                    self.uses[n].add(ParamKind.ELEMENTWISE)
            tracked = [(t, n) for t, n in tracked if id(t) not in skip]
            for _, n in tracked:  # a weight's product is followed as a linear's output is
                if n in self.uses:
                    for o in tensors(out):
                        self.tags.tag(o, f"out:{n}")
            if not any(isinstance(t, nn.Parameter) or n in self.uses for t, n in tracked) \
                    and not any(isinstance(t, nn.Parameter) for t in tensors((args, kwargs))):
                for _, n in tracked:  # scores times scores (an indexer's head weights x its q.k scores):
                    for o in tensors(out):  # still a score, followed to a top-k
                        self.tags.tag(o, n)
        elif func in _CONV:
            groups = args[6] if len(args) > 6 else kwargs.get("groups", 1)
            kind = ParamKind.MATMUL if groups == 1 else ParamKind.DEPTHWISE_CONV
        elif func in _LOOKUP:
            kind = ParamKind.LOOKUP
        else:
            kind = None
            for t, n in tracked:  # a derived tensor stays its parameter's
                for o in tensors(out):
                    if func in _SELECT or o.numel() == t.numel():
                        self.tags.tag(o, n)
        for _, n in tracked:
            if n not in self.uses:
                continue
            if kind is not None:
                self.uses[n].add(kind)
            elif not any(self.tags.of(o) == n for o in tensors(out)):
                self.uses[n].add(ParamKind.ELEMENTWISE)
        return out


    def _coefficients(self, func, args, out: torch.Tensor, tracked) -> None:
        """Mark the tracked operands of a product of two activations that are broadcast along an
        axis of the hidden width (module docstring)."""
        if len(args) < 2 or not all(isinstance(a, torch.Tensor) and not isinstance(a, nn.Parameter)
                                    and self.tags.of(a) not in self.uses for a in args[:2]):
            return  # a weight (or a tensor derived from one: ``x @ w.T``) is not a coefficient's partner
        h = self.hidden
        for t, n in tracked:
            if func in _PRODUCT:  # the right operand [.., k, n], the output's rows the left's hidden features;
                #                   not when its own axes could be those (attention's k^T [.., d, T], v [.., T, d]
                #                   on as many tokens as the hidden width)
                hit = t is args[1] and t.dim() >= 2 and out.dim() >= 2 and out.shape[-2] == h and h not in t.shape[-2:]
            else:  # elementwise: a size-1 (or missing) axis where the product has the hidden width
                pad = (1,) * (out.dim() - t.dim()) + tuple(t.shape)
                hit = any(o == h and s == 1 for o, s in zip(out.shape, pad))
            if hit:
                self.coefficients.add(n)


def _verdict(uses: set[ParamKind], coefficient: bool = False) -> ParamKind:
    if ParamKind.MATMUL in uses and coefficient:
        return ParamKind.COEFFICIENT
    for kind in (ParamKind.MATMUL, ParamKind.DEPTHWISE_CONV, ParamKind.LOOKUP, ParamKind.ELEMENTWISE):
        if kind in uses:
            return kind
    return ParamKind.UNUSED


def structural_kind(module: nn.Module, param: torch.Tensor) -> ParamKind:
    """The kind from types and shapes alone (module docstring)."""
    if isinstance(module, nn.modules.conv._ConvNd) and module.groups > 1 and param is module.weight \
            and param.shape[1] == 1:
        return ParamKind.DEPTHWISE_CONV
    if any(d == 1 for d in param.shape):
        return ParamKind.ELEMENTWISE
    return ParamKind.MATMUL


@dataclass
class Trace:
    """What one forward showed (module docstring): ``kinds``, the asked-for parameters' kinds;
    ``read_directly``, linears whose weight the forward uses without calling the module (Mamba's
    ``dt_proj``: a ``QuantLinear`` in its place would not be used as one); ``routers``, linears
    whose output reaches a top-k selection (MoE routers, whatever their name); ``coefficients``,
    the other linears whose output weights hidden vectors (module docstring)."""

    kinds: dict[str, ParamKind]
    read_directly: list[str]
    routers: list[str]
    traced: bool = True  # False: the kinds come from ``structural_kind`` (the forward could not run)
    coefficients: list[str] = field(default_factory=list)


@torch.no_grad()
def trace_model(model: nn.Module, params: dict[str, torch.Tensor], tokens: int = 8) -> Trace | None:
    """One forward of ``model`` on ``tokens`` token ids, followed (module docstring); None when the
    forward cannot run."""
    try:
        first = next(model.parameters())
    except StopIteration:
        return None
    if first.device.type == "meta":
        return None
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 32
    ids = (torch.arange(tokens) % max(int(vocab) - 1, 1) + 1).reshape(1, -1).to(first.device)
    emb = getattr(model, "get_input_embeddings", lambda: None)()
    hidden = getattr(emb, "embedding_dim", None) if isinstance(emb, nn.Embedding) else None
    return trace_call(model, params, lambda: model(input_ids=ids, use_cache=False), hidden)


@torch.no_grad()
def trace_call(root: nn.Module, params: dict[str, torch.Tensor], run, hidden: int | None = None) -> Trace | None:
    """``run()`` (a forward through ``root``: the model, or one decoder layer on its own call),
    followed (module docstring); names relative to ``root``; None when it raises. ``hidden``: the
    model's hidden width (the input embedding's; None: no coefficient linear is looked for)."""
    linears = {n: m for n, m in root.named_modules() if isinstance(m, nn.Linear)}
    weights = {f"{n}.weight": m.weight for n, m in linears.items()}
    follow = _Follow({**weights, **params}, hidden)
    called: set[str] = set()

    def pre(name):
        def hook(_m, _a):
            called.add(name)
        return hook

    def post(name):
        def hook(_m, _a, out):
            if isinstance(out, torch.Tensor):
                follow.tags.tag(out, f"out:{name}")
        return hook

    handles = [h for n, m in linears.items() for h in (m.register_forward_pre_hook(pre(n)),
                                                      m.register_forward_hook(post(n)))]
    try:
        with follow:
            run()
    except Exception:  # noqa: BLE001 - any failure of the forward falls back to the structural rule
        return None
    finally:
        for h in handles:
            h.remove()
    direct = [n for n in linears if n not in called and follow.uses[f"{n}.weight"]]
    routers = [n for n in linears if f"out:{n}" in follow.selected]
    coefficients = [n for n in linears if f"out:{n}" in follow.coefficients and n not in routers and n not in direct]
    return Trace({n: _verdict(follow.uses[n], f"out:{n}" in follow.coefficients) for n in params}, direct, routers,
                 coefficients=coefficients)
