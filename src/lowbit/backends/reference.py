"""The reference backend: exact emulation in float32.

QDQ the input under the activation spec (static scales from the module), dequantize the
weight, F.linear in float32, add the bias, cast to the module's dtype. Every other backend
must match it: bit for bit on quantized values and scales, and within float rounding on the
matmul output (exactly where its accumulation is exact).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lowbit.modules.inputs import qdq_input


class ReferenceBackend:
    name = "reference"

    def forward(self, module, x: torch.Tensor) -> torch.Tensor:
        xq = qdq_input(module, x)
        w = module.dequantized_weight(torch.float32)
        b = None if module.bias is None else module.bias.to(torch.float32)
        return F.linear(xq, w, b).to(x.dtype)
