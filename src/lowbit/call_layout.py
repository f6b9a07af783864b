"""Where each tensor of a decoder layer's call holds its calibration windows, read from the data.

A calibration batch of n windows reaches a layer as one call (args, kwargs). Its tensors hold the
windows along different axes, or not at all: most families' hidden states are [n, T, H] (axis 0),
Gemma 3n's are [altup 4, n, T, H] (axis 1), BLOOM's ALiBi bias is [n * heads, 1, T] (axis 0, heads
rows a window), and a RoPE table computed from unexpanded position ids is [1, T, D] (shared by every
window). No position or size rule tells these apart (Gemma 3n with 4 windows a batch has two axes
of size 4), so the layout is read by comparison: the layer's call for a batch of n > 1 windows
against its call for one window (the same model's forward on the batch's first window alone,
``CallLayout.compare``). A tensor whose shape is the same in both is shared (kept whole when a call
is cut); one whose shape differs in exactly one axis, by the factor n, holds ``rows`` = (its size
for one window) rows a window there; any other difference is recorded with the two shapes and
raises a ``QuantizationError`` naming the argument when a call must be cut (never a guess).

Tensors are found at any depth of tuples and lists (RoPE's (cos, sin)) and named by their path
(``hidden_states``, ``position_embeddings[0]``, ``args[2]``); a layer whose own arguments replace
the first layer's (``lowbit.calibration.layer_calls``) has a layout of its own. The layer's output
(the next layer's hidden states) holds its windows as its input hidden states do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from lowbit.errors import QuantizationError

Call = tuple[tuple, dict]
Path = tuple  # ("args", i, ...) or ("kwargs", name, ...), then indices into tuples and lists


def leaves(call: Call) -> Iterator[tuple[Path, torch.Tensor]]:
    """(path, tensor) of every tensor of a call, in order (also inside tuples and lists)."""

    def walk(v, path):
        if isinstance(v, torch.Tensor):
            yield path, v
        elif isinstance(v, (tuple, list)):
            for i, x in enumerate(v):
                yield from walk(x, path + (i,))

    args, kwargs = call
    for i, a in enumerate(args):
        yield from walk(a, ("args", i))
    for k, v in kwargs.items():
        yield from walk(v, ("kwargs", k))


def map_paths(call: Call, fn: Callable[[Path, torch.Tensor], torch.Tensor]) -> Call:
    """``call`` with ``fn(path, tensor)`` in place of every tensor; everything else kept."""

    def mp(v, path):
        if isinstance(v, torch.Tensor):
            return fn(path, v)
        if isinstance(v, (tuple, list)):
            return type(v)(mp(x, path + (i,)) for i, x in enumerate(v))
        return v

    args, kwargs = call
    return tuple(mp(a, ("args", i)) for i, a in enumerate(args)), {k: mp(v, ("kwargs", k)) for k, v in kwargs.items()}


def path_name(path: Path) -> str:
    """``hidden_states``, ``position_embeddings[0]``, ``args[2]``."""
    head = f"args[{path[1]}]" if path[0] == "args" else str(path[1])
    return head + "".join(f"[{i}]" for i in path[2:])


def hidden_path(call: Call) -> Path:
    """The path of the hidden states: the first positional argument, else ``hidden_states``."""
    return ("args", 0) if call[0] else ("kwargs", "hidden_states")


@dataclass(frozen=True)
class Axis:
    """Windows along ``dim``, ``rows`` entries of it per window."""

    dim: int
    rows: int = 1


@dataclass
class CallLayout:
    """The window axis of each tensor of a layer's call (module docstring): ``axes`` path -> Axis;
    ``uncut`` path -> why it cannot be cut (the two shapes); every other tensor is shared."""

    axes: dict = field(default_factory=dict)
    uncut: dict = field(default_factory=dict)
    hidden: Path = ("args", 0)

    @classmethod
    def compare(cls, one: Call, many: Call, n: int) -> "CallLayout":
        """The layout read from a layer's call on one window (``one``) and on ``n`` > 1 windows
        (``many``), whose first is that window."""
        small = dict(leaves(one))
        out = cls(hidden=hidden_path(many))
        for path, t in leaves(many):
            s = small.get(path)
            if s is None:
                out.uncut[path] = "not in the call for one window"
                continue
            if s.shape == t.shape:
                continue
            diff = [d for d in range(t.dim()) if s.dim() != t.dim() or s.shape[d] != t.shape[d]]
            if s.dim() == t.dim() and len(diff) == 1 and t.shape[diff[0]] == n * s.shape[diff[0]]:
                out.axes[path] = Axis(diff[0], s.shape[diff[0]])
            else:
                out.uncut[path] = f"{list(s.shape)} for one window, {list(t.shape)} for {n}"
        return out

    @property
    def output(self) -> Axis:
        """The window axis of the layer's output (its input hidden states')."""
        return self.axes.get(self.hidden, Axis(0))

    def windows(self, call: Call) -> int:
        """How many windows ``call`` holds (along its hidden states' axis)."""
        h = dict(leaves(call))[self.hidden]
        a = self.output
        return h.shape[a.dim] // a.rows if h.dim() > a.dim else 1

    def cut(self, call: Call, start: int, stop: int) -> Call:
        """The windows ``start:stop`` of ``call``: each windowed tensor narrowed along its axis,
        the shared ones kept (the same objects)."""

        def one(path: Path, t: torch.Tensor) -> torch.Tensor:
            if path in self.uncut:
                raise QuantizationError(
                    f"the layer's call argument {path_name(path)} cannot be cut into calibration windows: its "
                    f"shape changes with the number of windows otherwise than along one axis "
                    f"({self.uncut[path]}); calibrate with batch_size=1")
            a = self.axes.get(path)
            return t if a is None else t.narrow(a.dim, start * a.rows, (stop - start) * a.rows)

        return map_paths(call, one)

    def cut_output(self, t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """The windows ``start:stop`` of a layer output (or of a tensor shaped like one)."""
        a = self.output
        return t.narrow(a.dim, start * a.rows, (stop - start) * a.rows)

    def token_mask(self, mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """A [n, T] mask of positions arranged to broadcast over ``like`` (a layer output's per-token
        values [..., 1]): n along the output's window axis, T right after it."""
        lead = like.shape[:-1]
        if lead.numel() == mask.numel() and self.output.dim == 0:
            return mask.reshape(lead).unsqueeze(-1)
        d = self.output.dim
        shape = [1] * d + list(mask.shape) + [1] * (like.dim() - d - 2)
        if like.dim() < d + 3 or tuple(like.shape[d:d + 2]) != tuple(mask.shape):
            raise QuantizationError(f"a mask of positions {list(mask.shape)} does not match the layer's output "
                                    f"{list(like.shape)} along its window axis {d}")
        return mask.reshape(shape)
