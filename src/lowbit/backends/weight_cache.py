"""weight-cache: dequantize the weight once, keep it, and run F.linear (CPU, opt-in).

For weight-only schemes (w4a16, w8a16, nvfp4a16) and FP schemes (w8a8-fp8, nvfp4, mxfp...),
whose weights the reference backend dequantizes again on every call. The result equals the
reference backend's exactly (same dequantized weight, same input QDQ, same F.linear); the
price is a float32 copy of every weight in memory, which is why it is opt-in
(``use_backend(model, "weight-cache")``), never chosen automatically.

The cache is keyed on the weight buffers' identity and version: loading new weights into
the module invalidates it. ``release`` drops it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lowbit.backends.reference import qdq_input, row_input_scale
from lowbit.numerics import E4M3, FormatName
from lowbit.schemes import Granularity, Scheme

_KEY = "_lowbit_weight_cache"


def supports_scheme(s: Scheme) -> bool:
    return s.weight_only or not s.weights.is_integer


def _buffers(module) -> tuple:
    return tuple((t.data_ptr(), t._version) if t is not None else None
                 for t in (module.weight_codes, module.weight_scale, module.weight_zero_point,
                           module.weight_global_scale))


def _fp8_fast_path(spec) -> bool:
    return (spec is not None and spec.format is FormatName.E4M3 and spec.scale_format is FormatName.FP32
            and spec.granularity in (Granularity.TENSOR, Granularity.TOKEN))


def qdq_input_fp8(module, x: torch.Tensor) -> torch.Tensor:
    """E4M3 per-tensor/per-token input QDQ through torch's float8_e4m3fn cast (round to nearest
    even, after clamping to +-448 so that it saturates as E4M3.encode does): bit-identical to
    the reference's ``dequantize(quantize_input(...))`` and about 10x faster than the generic
    encoder (tests/test_weight_cache.py checks equality on adversarial inputs)."""
    x32 = x.to(torch.float32)
    scale, safe, nonzero = row_input_scale(module, x32)
    m = E4M3.max_finite
    q = (x32 / safe).clamp_(-m, m).to(torch.float8_e4m3fn).to(torch.float32)
    out = q.mul_(scale)
    if not bool(nonzero.all()):
        out = torch.where(nonzero, out, torch.zeros_like(out))
    return out


class WeightCacheBackend:
    name = "weight-cache"

    def weight(self, module) -> torch.Tensor:
        key = _buffers(module)
        st = module.__dict__.get(_KEY)
        if st is None or st[0] != key:
            st = (key, module.dequantized_weight(torch.float32))
            module.__dict__[_KEY] = st
        return st[1]

    def forward(self, module, x: torch.Tensor) -> torch.Tensor:
        spec = module.scheme.input_activations
        xq = qdq_input_fp8(module, x) if _fp8_fast_path(spec) else qdq_input(module, x)
        b = None if module.bias is None else module.bias.to(torch.float32)
        return F.linear(xq, self.weight(module), b).to(x.dtype)

    def release(self, module) -> None:
        module.__dict__.pop(_KEY, None)
