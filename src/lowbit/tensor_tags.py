"""Names attached to live tensors while a forward is followed (``lowbit.param_uses``,
``lowbit.algorithms.smoothquant.dataflow``): a tensor's tag is found by identity and only while
that very tensor is alive (a weak reference guards against a reused ``id``)."""

from __future__ import annotations

import weakref
from typing import Generic, Iterator, TypeVar

import torch


def tensors(x) -> Iterator[torch.Tensor]:
    """The tensors in ``x``, inside tuples, lists and dicts too."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from tensors(v)


V = TypeVar("V")


class Tags(Generic[V]):
    """tensor -> a name (or any value), by identity."""

    def __init__(self) -> None:
        self._tags: dict[int, tuple[V, weakref.ref]] = {}

    def tag(self, t: torch.Tensor, name: V) -> None:
        self._tags[id(t)] = (name, weakref.ref(t))

    def of(self, t) -> V | None:
        if not isinstance(t, torch.Tensor):
            return None
        ent = self._tags.get(id(t))
        return ent[0] if ent is not None and ent[1]() is t else None
