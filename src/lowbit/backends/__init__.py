"""Backends that run QuantLinear, in a declarative registry.

    lowbit.use_backend(model, "reference" | "cpu-int8" | ... | "auto")
"""

from __future__ import annotations

from lowbit.backends.reference import ReferenceBackend, qdq_input, quantize_input
from lowbit.backends.registry import Backend, BackendRegistry, BackendSpec

REGISTRY = BackendRegistry()
REGISTRY.register(BackendSpec(
    name="reference", factory=ReferenceBackend, devices=frozenset({"cpu", "cuda"}),
    supports_scheme=lambda s: True, priority=0,
    description="exact emulation in float32 (QDQ input, dequantize weight, F.linear)",
))


def select_backend(module) -> Backend:
    return REGISTRY.select(module)


def use_backend(model, name: str = "auto") -> dict[str, int]:
    return REGISTRY.use(model, name)


__all__ = ["REGISTRY", "Backend", "BackendSpec", "BackendRegistry", "ReferenceBackend", "select_backend",
           "use_backend", "quantize_input", "qdq_input"]
