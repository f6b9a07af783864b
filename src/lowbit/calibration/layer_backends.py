"""The backends a freshly quantized layer runs on during calibration."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch.nn as nn

from lowbit.modules import QuantLinear


@contextmanager
def fast_backends(layer: nn.Module) -> Iterator[None]:
    """Run a freshly quantized layer on the automatic (fastest exact) backends; their caches are
    dropped afterwards and the backends left unset."""
    from lowbit.backends import REGISTRY

    mods = [m for m in layer.modules() if isinstance(m, QuantLinear) and m.backend is None]
    for m in mods:
        m.backend = REGISTRY.select(m)
    try:
        yield
    finally:
        for m in mods:
            if hasattr(m.backend, "release"):
                m.backend.release(m)
            m.backend = None


def runs_as_reference(layer: nn.Module) -> bool:
    """Whether every QuantLinear of ``layer`` runs on an automatic backend whose outputs are the
    reference backend's bit for bit (the outputs reconstruction computed are then the ones the
    layer gives)."""
    from lowbit.backends import REGISTRY

    return all(REGISTRY.best(m).matches_reference for m in layer.modules() if isinstance(m, QuantLinear))
