"""Backend specs and the lookups over them.

Each backend declares what it supports (a predicate on the scheme, the devices, a predicate on
the layer shape) and a priority; ``select_backend`` picks the highest-priority backend that
supports a layer, and ``use_backend`` sets one by name (or "auto") on every QuantLinear of a
model. A backend is an object with ``name`` and ``forward(module, x)``; it may keep per-module
state (caches) in the module's ``__dict__`` under its own key, and should implement
``release(module)`` to drop it. ``use_backend`` gives every layer of a model that runs on one
backend the same instance (state shared across layers, such as a quantized input that sibling
layers reuse, lives on the instance).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn as nn

from lowbit.errors import LowbitError
from lowbit.schemes import Scheme


class Backend(Protocol):
    name: str

    def forward(self, module, x: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class BackendSpec:
    name: str
    factory: Callable[[], Backend]
    devices: frozenset[str]
    supports_scheme: Callable[[Scheme], bool]
    supports_shape: Callable[[int, int], bool] = lambda in_f, out_f: True
    priority: int = 0
    available: Callable[[], bool] = lambda: True
    description: str = ""
    auto: bool = True  # eligible for automatic selection
    matches_reference: bool = False  # outputs equal the reference backend's bit for bit (tested)

    def instance(self) -> Backend:
        return self.factory()

    def accepts(self, module) -> bool:
        device = module.weight_codes.device.type
        return (device in self.devices and self.available() and self.supports_scheme(module.scheme)
                and self.supports_shape(module.in_features, module.out_features))


class BackendRegistry:
    """Lookups over a fixed collection of backend specs (names unique)."""

    def __init__(self, specs: tuple[BackendSpec, ...]) -> None:
        self._specs: dict[str, BackendSpec] = {}
        for spec in specs:
            if spec.name in self._specs:
                raise ValueError(f"backend {spec.name!r} listed twice")
            self._specs[spec.name] = spec

    def names(self) -> list[str]:
        return list(self._specs)

    def get(self, name: str) -> BackendSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise LowbitError(f"unknown backend {name!r}; known: {', '.join(self._specs)} or 'auto'") from None

    def best(self, module) -> BackendSpec:
        """The highest-priority automatic backend that supports ``module``."""
        cands = [s for s in self._specs.values() if s.auto and s.accepts(module)]
        if not cands:
            raise LowbitError(f"no backend supports layer {module.name!r} ({module.scheme.name})")
        return max(cands, key=lambda s: s.priority)

    def select(self, module) -> Backend:
        return self.best(module).instance()

    def use(self, model: nn.Module, name: str | tuple[str, ...] = "auto") -> dict[str, int]:
        """Set ``name`` (or the best automatic choice) on every QuantLinear; returns counts per backend.
        A tuple of names gives each layer the first of them that supports it (an error if none does).

        All the layers of ``model`` that get one backend share one instance of it, so that its
        per-model state (the quantized input sibling linears share) is shared among them."""
        from lowbit.modules import QuantLinear

        counts: dict[str, int] = {}
        instances: dict[str, Backend] = {}
        for mod in model.modules():
            if not isinstance(mod, QuantLinear):
                continue
            old = mod.backend
            if old is not None and hasattr(old, "release"):
                old.release(mod)
            if name == "auto":
                spec = self.best(mod)
            elif isinstance(name, tuple):
                spec = next((self.get(n) for n in name if self.get(n).accepts(mod)), None)
                if spec is None:
                    raise LowbitError(f"none of the backends {', '.join(name)} supports layer {mod.name!r} "
                                      f"(scheme {mod.scheme.name})")
            else:
                spec = self.get(name)
                if not spec.accepts(mod):
                    raise LowbitError(
                        f"backend {name!r} does not support layer {mod.name!r} "
                        f"(scheme {mod.scheme.name}, device {mod.weight_codes.device.type}, "
                        f"shape {mod.out_features}x{mod.in_features})"
                    )
            be = instances.get(spec.name)
            if be is None:
                be = instances[spec.name] = spec.instance()
            mod.backend = be
            counts[be.name] = counts.get(be.name, 0) + 1
        return counts
