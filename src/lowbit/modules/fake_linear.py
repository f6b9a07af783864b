"""FakeQuantLinear: what ``lowbit.load`` builds from a ``fake`` checkpoint.

It holds the stored (already quantized-dequantized) float weight and QDQs its input at run time
exactly as the reference backend does (same activation spec, same static scales), then runs
F.linear in float32 and casts to the input dtype. With a float32 model this equals the reference
backend's output bit for bit; with bf16/fp16 the stored weight is the dequantized weight rounded
to that dtype.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lowbit.modules.inputs import qdq_input
from lowbit.errors import QuantizationError
from lowbit.schemes import Dynamic, Scheme


class FakeQuantLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, scheme: Scheme, *, name: str = "",
                 input_scale: torch.Tensor | None = None, input_global_scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.scheme = scheme
        self.name = name
        self.dtype = weight.dtype
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.register_buffer("input_scale", None if input_scale is None else input_scale.to(torch.float32).reshape(1))
        self.register_buffer("input_global_scale",
                             None if input_global_scale is None else input_global_scale.to(torch.float32).reshape(1))

    def check_ready(self) -> None:
        a = self.scheme.input_activations
        if a is None:
            return
        if a.dynamic is Dynamic.STATIC and self.input_scale is None:
            raise QuantizationError(f"layer {self.name!r}: scheme {self.scheme.name} needs a static input scale")
        if a.global_scale and self.input_global_scale is None:
            raise QuantizationError(f"layer {self.name!r}: scheme {self.scheme.name} needs an input global scale")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq = qdq_input(self, x)
        b = None if self.bias is None else self.bias.to(torch.float32)
        return F.linear(xq, self.weight.to(torch.float32), b).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, scheme={self.scheme.name}, fake-quantized weights"
