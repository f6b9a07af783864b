"""Each decoder layer's own call arguments, captured without running a layer.

Layer-by-layer calibration replays the first layer's call (hidden states, masks, position
embeddings, ...) for every layer, carrying only the hidden states forward. That is right when the
model's loop gives every layer the same objects, and wrong when it gives layers of different kinds
different ones: Gemma 4's sliding and full attention layers get RoPE tables of other head widths,
hybrid models give linear-attention or Mamba layers another mask than attention layers.

``capture_calls`` runs the model's embedding and its layer loop once per calibration batch with
every decoder layer replaced by a ``_Recorder`` (a stand-in that records its call and passes the
hidden states on, computing nothing; the real layers are put back afterwards, also on error), so
what each layer receives is read from the model's own forward, not from a table of families. The
arguments are compared by identity with the first layer's: the ones that differ for some layer
(``LayerCalls.keys``) are kept per layer and batch (references to the objects the model built, so
the memory is that of one set per layer kind), and ``LayerCalls.for_layer`` puts layer ``i``'s into
a carried call. When no layer differs, ``keys`` is empty and the calls are the first layer's, as
before.

Each layer's ``CallLayout`` (``lowbit.call_layout``: along which axis each tensor of its call
holds the windows of a batch) is read from two more captures, of the same loop on the first
window alone and on a batch of two copies of it, whose calls are compared (``LayerCalls.layout``).
Nothing runs in a layer; they cost two embedding forwards of one and two windows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from lowbit.call_layout import CallLayout
from lowbit.calibration.capture import Stop, capture_layer_inputs, run_batches
from lowbit.calls import move_call

Call = tuple[tuple, dict]
_ABSENT = object()  # an argument a layer's call does not have


class _Recorder(nn.Module):
    """Stands in for one decoder layer during the capture: records each call, returns its hidden
    states unchanged (a tensor for ``arity`` 0, else an ``arity``-tuple ``(h, None, ...)`` for loops
    that index or unpack the layer's output, as Bamba's ``hidden_states, attn_weights = layer(...)``),
    and stops the forward at the last layer. Other attributes are the real layer's (loops that read
    ``layer.attention_type`` and the like see the real values)."""

    def __init__(self, layer: nn.Module, calls: list[Call], last: bool, arity: int) -> None:
        super().__init__()
        object.__setattr__(self, "_real", layer)  # not a child: its parameters stay out of this module
        self.calls, self.last, self.arity = calls, last, arity

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_real"), name)

    def forward(self, *args, **kwargs):
        self.calls.append((tuple(args), dict(kwargs)))
        if self.last:
            raise Stop
        h = args[0] if args else kwargs["hidden_states"]
        return (h,) + (None,) * (self.arity - 1) if self.arity else h


def _keys(call: Call) -> set:
    args, kwargs = call
    return set(range(1, len(args))) | set(kwargs)


def _get(call: Call, key) -> Any:
    args, kwargs = call
    if isinstance(key, int):
        return args[key] if key < len(args) else _ABSENT
    return kwargs.get(key, _ABSENT)


def with_arguments(call: Call, values: dict) -> Call:
    """``call`` with the arguments ``values`` (positional index or keyword -> value) put in; a value
    of ``_ABSENT`` removes a keyword."""
    if not values:
        return call
    args, kwargs = list(call[0]), dict(call[1])
    for k, v in values.items():
        if isinstance(k, int):
            args[k] = v
        elif v is _ABSENT:
            kwargs.pop(k, None)
        else:
            kwargs[k] = v
    return tuple(args), kwargs


@dataclass
class LayerCalls:
    """The first layer's call per batch (``first``) and, per layer and batch, the arguments in
    ``keys`` where some layer's call differs from the first's (``own[i][b]``; empty ``keys``: every
    layer gets the first layer's arguments)."""

    first: list[Call]
    keys: tuple = ()
    own: list[list[dict]] = field(default_factory=list)
    layouts: list[CallLayout] = field(default_factory=list)  # per layer (one: every layer's)

    def layout(self, i: int) -> CallLayout | None:
        """Layer ``i``'s call layout (None: none was read)."""
        if not self.layouts:
            return None
        return self.layouts[i] if i < len(self.layouts) else self.layouts[0]

    def for_layer(self, i: int, calls: list[Call], device: torch.device | None = None) -> list[Call]:
        """``calls`` (one per batch, carrying the hidden states) with layer ``i``'s own arguments
        (moved to ``device`` when given)."""
        if not self.keys or i >= len(self.own):
            return calls
        return [with_arguments(c, move_call(((), v), device)[1]) for c, v in zip(calls, self.own[i])]

    @property
    def kinds(self) -> int:
        """How many distinct argument sets the layers get (1: all the same)."""
        if not self.keys:
            return 1
        return len({tuple(id(v[k]) for k in self.keys) for v in (o[0] for o in self.own)})


def _differing(per_layer: list[list[Call]]) -> tuple:
    """The argument keys whose object differs, in some batch, between a layer's call and the first's."""
    keys: set = set()
    for calls in per_layer[1:]:
        for b, call in enumerate(calls):
            ref = per_layer[0][b]
            for k in _keys(call) | _keys(ref):
                if _get(call, k) is not _get(ref, k):
                    keys.add(k)
    return tuple(sorted(keys, key=lambda k: (isinstance(k, str), str(k))))


@torch.no_grad()
def _record(model: nn.Module, layers: nn.ModuleList, tokens: torch.Tensor, batch_size: int,
            device: torch.device, arity: int) -> list[list[Call]]:
    n = len(layers)
    per_layer: list[list[Call]] = [[] for _ in range(n)]
    real = list(layers)
    try:
        for i in range(n):
            layers[i] = _Recorder(real[i], per_layer[i], i == n - 1, arity)
        run_batches(model, tokens, batch_size, device)
    finally:
        for i in range(n):
            layers[i] = real[i]
    return per_layer


def capture_calls(model: nn.Module, layers: nn.ModuleList, tokens: torch.Tensor, batch_size: int,
                  device: torch.device | None = None) -> LayerCalls:
    """Every decoder layer's call for each batch of ``tokens`` (module docstring). The model runs
    on ``device`` (default: where its first parameter is). A loop the stand-ins cannot pass
    through, or one that does not call each layer exactly once per batch, gives the first layer's
    calls only (``capture.capture_layer_inputs``; every layer then gets them, as before)."""
    device = device or next(model.parameters()).device
    per_layer = _per_layer(model, layers, tokens, batch_size, device)
    if per_layer is None:
        # a loop that does more with a layer's output than pass its hidden states on (RWKV's
        # state tuples): the first layer's calls only, captured by running up to it
        first = capture_layer_inputs(model, layers[0], tokens, batch_size, device)
        probes = [capture_layer_inputs(model, layers[0], t, len(t), device) for t in _probes(tokens)]
        return LayerCalls(first, layouts=[CallLayout.compare(p[0], q[0], 2) for p, q in [probes] if probes])
    if not tokens.shape[0]:
        return LayerCalls(per_layer[0])
    one, two = (_per_layer(model, layers, t, len(t), device) for t in _probes(tokens))
    if one is None or two is None:
        raise RuntimeError("the decoder layers' calls for one and two calibration windows could not be captured")
    batches = -(-tokens.shape[0] // batch_size)
    if not all(len(c) == batches for c in per_layer):
        # a loop that skips layers or calls one several times: only the first layer's calls are known
        return LayerCalls(per_layer[0], layouts=_layouts(one[:1], two[:1]))
    keys = _differing(per_layer)
    own = [[{k: _get(c, k) for k in keys} for c in calls] for calls in per_layer] if keys else []
    return LayerCalls(per_layer[0], keys, own, _layouts(one, two) if keys else _layouts(one[:1], two[:1]))


def _probes(tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The first window alone, and twice (a batch of two: only the shapes are compared); none
    without a window (a rank that holds no batch)."""
    return (tokens[:1], tokens[:1].repeat(2, 1)) if tokens.shape[0] else ()


def _per_layer(model: nn.Module, layers: nn.ModuleList, tokens: torch.Tensor, batch_size: int,
               device: torch.device) -> list[list[Call]] | None:
    """Every layer's calls (``_record``), or None where the loop cannot run on the stand-ins or
    the first layer is not called once per batch. The stand-ins' output is tried as the tensor,
    a 1-tuple and a 2-tuple; a form whose hidden states reach a later layer in another shape than
    the first layer's is wrong too (a batch of two windows unpacked as ``h, _ = layer(...)``)."""
    for arity in (0, 1, 2):  # the layer's output taken whole, indexed, unpacked in two
        try:
            per_layer = _record(model, layers, tokens, batch_size, device, arity)
        except (TypeError, IndexError, AttributeError, RuntimeError, ValueError):
            continue
        if not _same_shapes(per_layer):
            continue
        return per_layer if len(per_layer[0]) == -(-tokens.shape[0] // batch_size) else None
    return None


def _same_shapes(per_layer: list[list[Call]]) -> bool:
    """Whether every recorded layer got hidden states of the first layer's shape, batch by batch."""
    def shape(call: Call):
        h = call[0][0] if call[0] else call[1].get("hidden_states")
        return tuple(h.shape) if isinstance(h, torch.Tensor) else None

    first = [shape(c) for c in per_layer[0]]
    return all(shape(c) == first[b] for calls in per_layer[1:] for b, c in enumerate(calls) if b < len(first))


def _layouts(one: list[list[Call]], two: list[list[Call]]) -> list[CallLayout]:
    """Each listed layer's layout, from its call on one window and on two."""
    return [CallLayout.compare(a[0], b[0], 2) for a, b in zip(one, two)]
