"""The reference backend: exact emulation in float32.

QDQ the input under the activation spec (static scales from the module), dequantize the
weight, F.linear in float32, add the bias, cast to the module's dtype. Every other backend
must match it: bit for bit on quantized values and scales, and within float rounding on the
matmul output (exactly where its accumulation is exact).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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


class ReferenceBackend:
    name = "reference"

    def forward(self, module, x: torch.Tensor) -> torch.Tensor:
        xq = qdq_input(module, x)
        w = module.dequantized_weight(torch.float32)
        b = None if module.bias is None else module.bias.to(torch.float32)
        return F.linear(xq, w, b).to(x.dtype)
