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

A stand-in returns the hidden states it got: as a tensor, or as a 1-tuple for loops that index
the layer's output. A loop that takes more from a layer's output (Hunyuan-V4's
``hidden_states, topk_indices = layer(...)``, the next layer's ``prev_topk_indices``) runs the real
layers instead (the last one excepted): each layer then gets what the model gives it, computed by
the float layers before it (Bamba's ``hidden_states, attn_weights = layer(...)`` too: a stand-in
2-tuple ``(h, None)`` would pass there, but would hand Hunyuan-V4's layers ``None`` indices). A
capture counts only where every layer's hidden input has the shape of the first layer's (a tensor
unpacked along its batch axis by such a loop does not).

Each layer's ``CallLayout`` (``lowbit.call_layout``: along which axis each tensor of its call
holds the windows of a batch) is read from two more captures, of the same loop on the first
window alone and on a batch of two copies of it, whose calls are compared (``LayerCalls.layout``).
Nothing runs in a layer; they cost two embedding forwards of one and two windows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
import torch.nn as nn

from lowbit.call_layout import CallLayout
from lowbit.calibration.capture import Stop, capture_layer_inputs, run_batches
from lowbit.calls import move_call

Call = tuple[tuple, dict]
_ABSENT = object()  # an argument a layer's call does not have


class StandIn(Enum):
    """What a ``_Recorder`` returns (module docstring), in the order they are tried."""

    TENSOR = "the hidden states it got"
    TUPLE = "a 1-tuple of the hidden states it got"
    REAL = "the real layer's output"


class RealAttributes(nn.Module):
    """A stand-in for a decoder layer whose other attributes are the real layer's (loops that read
    ``layer.attention_type`` and the like see the real values); the real layer is not a child, so
    its parameters stay out of the stand-in."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_real", layer)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_real"), name)


class _Recorder(RealAttributes):
    """Stands in for one decoder layer during the capture: records each call, returns ``mode``'s
    output (``StandIn``), and stops the forward at the last layer."""

    def __init__(self, layer: nn.Module, calls: list[Call], last: bool, mode: StandIn) -> None:
        super().__init__(layer)
        self.calls, self.last, self.mode = calls, last, mode

    def forward(self, *args, **kwargs):
        self.calls.append((tuple(args), dict(kwargs)))
        if self.last:
            raise Stop
        if self.mode is StandIn.REAL:
            return object.__getattribute__(self, "_real")(*args, **kwargs)
        h = _hidden((args, kwargs))
        return (h,) if self.mode is StandIn.TUPLE else h


def _hidden(call: Call) -> Any:
    args, kwargs = call
    return args[0] if args else kwargs.get("hidden_states")


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
            device: torch.device, mode: StandIn) -> list[list[Call]]:
    n = len(layers)
    per_layer: list[list[Call]] = [[] for _ in range(n)]
    real = list(layers)
    try:
        for i in range(n):
            layers[i] = _Recorder(real[i], per_layer[i], i == n - 1, mode)
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
    the first layer is not called once per batch."""
    for mode in StandIn:  # loops that take the layer's output whole, that index it, that take more
        try:
            per_layer = _record(model, layers, tokens, batch_size, device, mode)
        except (TypeError, IndexError, AttributeError, RuntimeError, ValueError):
            continue
        if not _passed_on(per_layer):
            continue
        return per_layer if len(per_layer[0]) == -(-tokens.shape[0] // batch_size) else None
    return None


def _passed_on(per_layer: list[list[Call]]) -> bool:
    """Whether every layer's hidden input, batch by batch, has the shape of the first layer's."""
    first = [getattr(_hidden(c), "shape", None) for c in per_layer[0]]
    return all(getattr(_hidden(c), "shape", None) == first[b]
               for calls in per_layer[1:] for b, c in enumerate(calls) if b < len(first))


def _layouts(one: list[list[Call]], two: list[list[Call]]) -> list[CallLayout]:
    """Each listed layer's layout, from its call on one window and on two."""
    return [CallLayout.compare(a[0], b[0], 2) for a, b in zip(one, two)]
