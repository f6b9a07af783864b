"""Schemes: typed, serialisable descriptions of how weights and activations are quantized."""

from lowbit.schemes.presets import PRESETS, get_scheme
from lowbit.schemes.spec import Dynamic, Granularity, QuantSpec, Scheme, WeightObserver

__all__ = ["PRESETS", "get_scheme", "Dynamic", "Granularity", "QuantSpec", "Scheme", "WeightObserver"]
