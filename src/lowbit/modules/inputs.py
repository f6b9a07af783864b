"""How a lowbit layer's input is quantized: the contract every backend and module meets.

``quantize_input`` gives the codes and scales of the input activation under the layer's spec
(static scales from the layer); ``qdq_input`` their dequantized values, computed without
building codes (``fake_quantize``: the kernel setting chooses its implementation, all
bit-identical). Used by the backends of ``QuantLinear`` and by ``FakeQuantLinear``.
"""

from __future__ import annotations

import torch

from lowbit.quant import QuantizedTensor, fake_quantize, quantize
from lowbit.schemes import Dynamic


def input_args(module) -> dict:
    spec = module.scheme.input_activations
    module.check_ready()
    return {"scale": module.input_scale if spec.dynamic is Dynamic.STATIC else None,
            "global_scale": module.input_global_scale,
            "name": f"{module.name}.input" if module.name else "input"}


def quantize_input(module, x: torch.Tensor) -> QuantizedTensor:
    """The input activation quantized exactly as every backend must (codes and scales)."""
    return quantize(x, module.scheme.input_activations, **input_args(module))


def qdq_input(module, x: torch.Tensor) -> torch.Tensor:
    """``dequantize(quantize_input(module, x))``, computed without building codes
    (``fake_quantize``: the kernel setting chooses its implementation, all bit-identical)."""
    if module.scheme.input_activations is None:
        return x.to(torch.float32)
    return fake_quantize(x, module.scheme.input_activations, **input_args(module))
