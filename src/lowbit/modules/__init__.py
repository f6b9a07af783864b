"""Quantized modules."""

from lowbit.modules.qlinear import QuantLinear

__all__ = ["QuantLinear"]
