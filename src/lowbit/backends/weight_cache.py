"""weight-cache: dequantize the weight once, keep it, and run F.linear (CPU).

For weight-only schemes (w4a16, w8a16, nvfp4a16), FP schemes (w8a8-fp8, nvfp4, mxfp...) and
INT4 weights with quantized inputs (w4a8-int8, w4a8-fp8),
whose weights the reference backend dequantizes again on every call. The result equals the
reference backend's exactly (same dequantized weight, same input QDQ, same F.linear; sibling
linears reading one input share its QDQ, see ``lowbit.backends.shared_input``). The automatic
choice on the CPU for these schemes (above ``reference``, below ``cpu-int8``): without it a
one-token decode step dequantizes every weight of the model. The price is a float32 copy of
every weight in memory; ``use_backend(model, "reference")`` saves it.

The cache (``lowbit.backends.cache.ModuleCache``) is rebuilt when the weight buffers change;
``release`` drops a layer's entry.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lowbit.backends.cache import ModuleCache
from lowbit.modules.inputs import qdq_input
from lowbit.backends.shared_input import SharedInput, input_key
from lowbit.numerics import FormatName
from lowbit.schemes import Scheme


def supports_scheme(s: Scheme) -> bool:
    """Weight-only, FP-weight and sub-8-bit INT-weight schemes (w4a8-*); INT8 weights with quantized
    inputs belong to cpu-int8's integer matmul."""
    return s.weight_only or not s.weights.is_integer or s.weights.format is not FormatName.INT8


class WeightCacheBackend:
    name = "weight-cache"

    def __init__(self) -> None:
        self.shared = SharedInput()  # q/k/v and gate/up QDQ their common input once
        self.cache = ModuleCache()

    def weight(self, module) -> torch.Tensor:
        return self.cache.get(module, lambda m: m.dequantized_weight(torch.float32))

    def forward(self, module, x: torch.Tensor) -> torch.Tensor:
        if module.scheme.input_activations is None:
            xq = x.to(torch.float32)
        else:
            xq = self.shared.get(x, input_key(module, "qdq"), lambda: qdq_input(module, x))
        b = None if module.bias is None else module.bias.to(torch.float32)
        return F.linear(xq, self.weight(module), b).to(x.dtype)

    def release(self, module) -> None:
        self.cache.release(module)
