"""ModuleCache: what a backend derives from a layer's weight (a dequantized copy, decoded
values, a packed layout), kept per layer and rebuilt when the weight changes.

One rule for every backend: an entry is keyed weakly on the module (it never keeps a layer
alive) and is valid while ``weight_stamp(module)`` is unchanged: the storage pointer and version
counter of each weight buffer (``load_state_dict``, ``copy_`` or a new tensor all change it).
``release(module)`` drops an entry. A deep copy of a cache is empty: a copied model rebuilds what
it needs from its own weights.
"""

from __future__ import annotations

import weakref
from typing import Callable, TypeVar

T = TypeVar("T")

WEIGHT_BUFFERS = ("weight_codes", "weight_scale", "weight_zero_point", "weight_global_scale")


def weight_stamp(module) -> tuple:
    """What a derived weight depends on: (data_ptr, _version) of each weight buffer (None if absent)."""
    out = []
    for name in WEIGHT_BUFFERS:
        t = getattr(module, name, None)
        out.append(None if t is None else (t.data_ptr(), t._version))
    return tuple(out)


class ModuleCache:
    def __init__(self) -> None:
        self._entries: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get(self, module, build: Callable[[object], T]) -> T:
        """``build(module)``, computed once per weight state of ``module``."""
        stamp = weight_stamp(module)
        hit = self._entries.get(module)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        value = build(module)
        self._entries[module] = (stamp, value)
        return value

    def __contains__(self, module) -> bool:
        return module in self._entries

    def release(self, module) -> None:
        self._entries.pop(module, None)

    def __len__(self) -> int:
        return len(self._entries)

    def __deepcopy__(self, memo) -> "ModuleCache":
        return ModuleCache()
