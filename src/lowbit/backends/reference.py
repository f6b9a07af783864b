"""The reference backend: exact emulation in float32.

QDQ the input under the activation spec (static scales from the module), dequantize the
weight, F.linear in float32, add the bias, cast to the module's dtype. Every other backend
must match it: bit for bit on quantized values and scales, and within float rounding on the
matmul output (exactly where its accumulation is exact).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lowbit.quant import QuantizedTensor, check_finite, fake_quantize, quantize, scales_from_amax
from lowbit.schemes import Dynamic


def _input_args(module) -> dict:
    spec = module.scheme.input_activations
    module.check_ready()
    return {"scale": module.input_scale if spec.dynamic is Dynamic.STATIC else None,
            "global_scale": module.input_global_scale,
            "name": f"{module.name}.input" if module.name else "input"}


def quantize_input(module, x: torch.Tensor) -> QuantizedTensor:
    """The input activation quantized exactly as every backend must (codes and scales)."""
    return quantize(x, module.scheme.input_activations, **_input_args(module))


def row_input_scale(module, x32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For a per-tensor static or per-token dynamic input spec with fp32 scales: the scale
    ([1] or [M, 1]), the divisor to use (1 where the scale is 0) and the nonzero mask, exactly
    as ``quantize`` computes them. NaN/Inf in ``x32`` [M, in] (float32) is an error naming the
    layer (one cheap reduction; the exact check only on suspicion)."""
    spec = module.scheme.input_activations
    if not bool(torch.isfinite(x32.sum())):
        check_finite(x32, f"{module.name}.input" if module.name else "input")
    if spec.dynamic is Dynamic.STATIC:
        module.check_ready()
        scale = module.input_scale.to(torch.float32)
    else:
        scale = scales_from_amax(x32.abs().amax(-1, keepdim=True), spec)
    nonzero = scale > 0
    return scale, torch.where(nonzero, scale, torch.ones_like(scale)), nonzero


def qdq_input(module, x: torch.Tensor) -> torch.Tensor:
    """``dequantize(quantize_input(module, x))``, computed without building codes (bit-identical)."""
    if module.scheme.input_activations is None:
        return x.to(torch.float32)
    return fake_quantize(x, module.scheme.input_activations, **_input_args(module))


class ReferenceBackend:
    name = "reference"

    def forward(self, module, x: torch.Tensor) -> torch.Tensor:
        xq = qdq_input(module, x)
        w = module.dequantized_weight(torch.float32)
        b = None if module.bias is None else module.bias.to(torch.float32)
        return F.linear(xq, w, b).to(x.dtype)
