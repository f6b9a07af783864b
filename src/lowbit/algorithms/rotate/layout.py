"""Where the residual stream of a causal LM is read and written, for a fused rotation.

``residual_layout(model)`` reads it from the model's data flow (``lowbit.algorithms.rotate.stream``:
one forward on 8 tokens, every expert on every token), not from a table of families: the input
embedding and any embedding added to the stream; every norm that reads the stream, with the linears
and routers it feeds (the final norm's reader is the output embedding); the linears that read the
stream without a norm; the linears that write it (o_proj, down_proj, every expert's down_proj, ...);
and per attention layer the pair v -> o (a linear whose whole output, mixed across tokens by
attention, is the only input of another), with the head width attention saw. A layer without such a
pair (linear attention, Mamba, MLA's kv_b_proj, a fused qkv, a gated attention output) gets no R2.

How each norm folds its gain (``SourceKind.RMS``: w; ``RMS_ONE_PLUS``: Gemma's 1 + w) is checked on a
copy (``lowbit.algorithms.smoothquant.dataflow.norm_fold_kind``), and so is that it commutes with the
rotation once its gain is the identity (LayerNorm's mean subtraction does not).

A fused rotation is exact only when nothing else touches the stream, so anything else is a
QuantizationError naming the model class and the module, before any weight changes: the stream or
a stream norm's output used otherwise (a per-channel product, a channel slice, a nonlinearity); a
norm of a kind that does not commute (OPT's and GPT-2's LayerNorms); something other than a linear
or embedding added into the stream (Gemma 2/3's norms after o_proj/down_proj); a weight matrix the
forward did not reach (whether it reads or writes the stream is unknown); widths that do not match.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn

from lowbit.errors import QuantizationError
from lowbit.algorithms.rotate.stream import Event, StreamFlow, trace_stream
from lowbit.algorithms.smoothquant.mappings import SourceKind

FOLDABLE = (SourceKind.RMS, SourceKind.RMS_ONE_PLUS)


@dataclass(frozen=True)
class NormReaders:
    norm: str                  # full module name
    kind: SourceKind           # RMS (y = rms(x) g) or RMS_ONE_PLUS (y = rms(x) (1 + g))
    readers: tuple[str, ...]   # modules with a weight [out, hidden] fed by the norm (linears, routers)


@dataclass(frozen=True)
class AttentionPair:
    v_proj: str     # its output rows, per head, are rotated by R2
    o_proj: str     # its input columns, per head, likewise
    head_dim: int   # the head width attention saw


@dataclass(frozen=True)
class ResidualLayout:
    embeddings: tuple[str, ...]   # the input embedding first, then embeddings added to the stream
    norms: tuple[NormReaders, ...]  # in the order they ran; the final norm's reader is ``head``
    readers: tuple[str, ...]      # linears reading the stream without a norm
    writers: tuple[str, ...]      # linears whose outputs are added to the stream
    pairs: tuple[AttentionPair, ...]
    head: str
    hidden: int
    layers: int                   # decoder layers (the module list holding the most writers)


def _fail(model: nn.Module, module: str, why: str) -> QuantizationError:
    return QuantizationError(f"rotation cannot be fused into {type(model).__name__}: {module} {why}")


def _commutes(norm: nn.Module, kind: SourceKind, q: torch.Tensor) -> bool:
    """Whether ``norm`` with its gain at the identity computes norm(x) Q from x Q."""
    unit = copy.deepcopy(norm)
    with torch.no_grad():
        unit.weight.fill_(0.0 if kind is SourceKind.RMS_ONE_PLUS else 1.0)
        x = torch.randn(4, q.shape[0], generator=torch.Generator().manual_seed(0)).to(norm.weight)
        q = q.to(norm.weight)
        return torch.allclose(unit(x @ q).float(), (unit(x) @ q).float(), rtol=1e-3, atol=1e-4)


def _norm(model: nn.Module, name: str, readers: list[str], hidden: int) -> NormReaders:
    from lowbit.algorithms.rotate.hadamard import block_hadamard
    from lowbit.algorithms.smoothquant.dataflow import norm_fold_kind

    norm = model.get_submodule(name)
    if getattr(norm, "bias", None) is not None:
        raise _fail(model, name, "is a layernorm norm (it has a bias), which does not commute with a rotation")
    if norm.weight.shape != (hidden,):
        raise _fail(model, name, f"reads the residual stream but its weight is not {hidden} wide")
    wide = copy.deepcopy(norm).float()  # checked in float32: bfloat16 rounding is not a different kind
    kind = norm_fold_kind(wide, hidden)
    if kind not in FOLDABLE:
        raise _fail(model, name, "is a norm whose gain no fold takes out (a rotation needs it folded into the "
                                 "linears it feeds)")
    if not _commutes(wide, kind, block_hadamard(hidden)):
        raise _fail(model, name, "is a norm that does not commute with a rotation (e.g. LayerNorm's mean "
                                 "subtraction)")
    return NormReaders(name, kind, tuple(readers))


def _weight(model: nn.Module, name: str) -> torch.Tensor:
    return model.get_submodule(name).weight


def _layers(model: nn.Module, writers: tuple[str, ...]) -> int:
    """The length of the module list holding the most writers (the decoder layers)."""
    lists = [(sum(w.startswith(f"{n}.") for w in writers), len(m)) for n, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m)]
    return max(lists, default=(0, 0))[1] if any(c for c, _ in lists) else 0


def _check(model: nn.Module, flow: StreamFlow, hidden: int) -> tuple[NormReaders, ...]:
    """The stream norms that feed something; raises the first problem of the trace or of a stream
    norm's kind, in the order they happened, then a weight matrix the forward did not reach."""
    norms = []
    for event, module, why in flow.events:
        if event is Event.PROBLEM:
            raise _fail(model, module, why)
        nr = _norm(model, module, flow.norms[module], hidden)
        if nr.readers:
            norms.append(nr)
    for n, m in model.named_modules():
        w = getattr(m, "weight", None)
        if not m._modules and isinstance(w, torch.Tensor) and w.dim() == 2 and not isinstance(m, nn.Embedding) \
                and n not in flow.used:
            raise _fail(model, n, "is not reached by a forward on 8 tokens: whether it reads or writes the residual "
                                  "stream is unknown")
    for r in [r for rs in flow.norms.values() for r in rs] + flow.direct:
        if _weight(model, r).shape[-1] != hidden:
            raise _fail(model, r, f"reads the residual stream but its weight is not {hidden} columns wide")
    for w in flow.writers:
        if _weight(model, w).shape[0] != hidden:
            raise _fail(model, w, f"writes the residual stream but its weight is not {hidden} rows")
    return tuple(norms)


def residual_layout(model: nn.Module) -> ResidualLayout:
    """The layout of ``model`` (module docstring), or a QuantizationError naming what stops a fused
    rotation."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(emb, nn.Embedding) or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise _fail(model, "the input/output embedding", "is not an nn.Embedding / a module with a weight")
    names = {m: n for n, m in model.named_modules()}
    hidden = emb.weight.shape[1]
    try:
        flow = trace_stream(model)
    except Exception as e:  # noqa: BLE001 - the forward that the layout is read from failed
        raise _fail(model, "the model", f"cannot run a forward on 8 tokens ({type(e).__name__}: "
                                        f"{str(e).splitlines()[0] if str(e) else ''})") from None
    norms = _check(model, flow, hidden)
    if names[head] not in {r for n in norms for r in n.readers} | set(flow.direct):
        raise _fail(model, names[head], "does not read the residual stream")
    pairs = tuple(AttentionPair(v, o, d) for v, o, d in flow.pairs
                  if _weight(model, v).shape[0] % d == 0 and _weight(model, o).shape[1] % d == 0)
    writers = tuple(flow.writers)
    return ResidualLayout((names[emb], *flow.embeddings), norms, tuple(flow.direct), writers, pairs, names[head],
                          hidden, _layers(model, writers))
