"""Quantized modules: ``QuantLinear`` (codes and scales, run by a backend) and ``FakeQuantLinear``
(dequantized weights from a ``fake`` checkpoint), with the one rule for quantizing their inputs
(``lowbit.modules.inputs``)."""

from lowbit.modules.fake_linear import FakeQuantLinear
from lowbit.modules.qlinear import QuantLinear

__all__ = ["QuantLinear", "FakeQuantLinear"]
