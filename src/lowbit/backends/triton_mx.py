"""The ``triton`` backend: GPU kernels for microscaled and weight-only schemes.

Schemes: nvfp4, nvfp4a16, nvfp4-e5m3, mxfp4, mxfp8 (E2M1/E4M3 weights with UE4M3/UE5M3/E8M0
block scales) and w4a16 / w8a16 (INT4/INT8 weights). The weight is held packed, as on disk
(nibble-packed E2M1 or one-byte E4M3 codes with uint8 block-scale codes; INT4 in int32
words), and dequantized by a Triton kernel at each call; the input activation is quantized
and dequantized (QDQ) by a Triton kernel; then one matmul (cuBLAS) in float32 for float32
inputs, bfloat16 otherwise. ``fused_max_m`` > 0 sends bfloat16 inputs of at most that many
rows through the fused Triton matmul (lowbit.kernels.gpu.mx_matmul), which reads the packed weight
once; it is off by default because on the H200 it measured slower than dequantize + cuBLAS
(bench/gpu/RESULTS-gpu.md). Weight and QDQ values equal lowbit.quant's bit for bit (in
float32, or that value rounded to bfloat16); the matmul differs from the reference only by
accumulation order (and the bfloat16 rounding of values that are not bf16-exact). The kernels
are reached through their entry points, lowbit.kernels.gpu (which ask lowbit.kernels.select).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lowbit.backends.cache import ModuleCache
from lowbit.kernels import Implementation, gpu
from lowbit.kernels import available as kernel_available
from lowbit.schemes import Scheme


def supports(scheme: Scheme) -> bool:
    from lowbit.kernels.support import supports_block_spec, supports_int_weight, supports_microscaled_weight

    w, a = scheme.weights, scheme.input_activations
    if a is not None and not supports_block_spec(a):
        return False
    if supports_microscaled_weight(w):
        return True
    return a is None and supports_int_weight(w)


def available() -> bool:
    return kernel_available(Implementation.TRITON)


def compute_dtype(x_dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if x_dtype == torch.bfloat16 else torch.float32


def _pack(module):
    """The weight in the layout the Triton kernels read: ("mx", data, scale codes) or ("int", ...)."""
    from lowbit.kernels.support import supports_microscaled_weight

    spec = module.scheme.weights
    codes = module.weight_codes
    if supports_microscaled_weight(spec):
        data, scodes = gpu.pack_microscaled(codes, module.weight_scale, spec, f"{module.name}.weight")
        return ("mx", data, scodes)
    return ("int", gpu.pack_int(codes, spec), module.weight_scale.to(torch.float32).contiguous())


class TritonBackend:
    name = "triton"

    def __init__(self, check_finite: bool = True, fused_max_m: int = 0) -> None:
        self.check_finite = check_finite
        self.fused_max_m = fused_max_m
        self.cache = ModuleCache()

    # ------------------------------------------------------------------ weight
    def _packed(self, module):
        return self.cache.get(module, _pack)

    def release(self, module) -> None:
        self.cache.release(module)

    def dequantized_weight(self, module, dtype: torch.dtype) -> torch.Tensor:
        kind, data, scales = self._packed(module)
        spec = module.scheme.weights
        shape = dict(out_features=module.out_features, in_features=module.in_features, dtype=dtype)
        if kind == "mx":
            return gpu.dequantize_microscaled(data, scales, spec, module.weight_global_scale, **shape)
        return gpu.dequantize_int(data, scales, spec, module.weight_zero_point, **shape)

    # ------------------------------------------------------------------ run
    def qdq_input(self, module, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        spec = module.scheme.input_activations
        if spec is None:
            return x.to(dtype)
        module.check_ready()
        name = f"{module.name}.input" if module.name else "input"
        return gpu.quantize_blocks(x, spec, module.input_global_scale, codes=False, qdq_dtype=dtype,
                               check_finite=self.check_finite, name=name)["qdq"]

    def forward(self, module, x: torch.Tensor) -> torch.Tensor:
        cdt = compute_dtype(x.dtype)
        xq = self.qdq_input(module, x, cdt)
        rows = x.numel() // max(module.in_features, 1)
        if cdt == torch.bfloat16 and rows <= self.fused_max_m:
            kind, data, scales = self._packed(module)
            if kind == "mx":
                return gpu.mx_matmul(xq, data, scales, module.scheme.weights, module.weight_global_scale, module.bias,
                                 out_features=module.out_features, out_dtype=x.dtype)
        w = self.dequantized_weight(module, cdt)
        b = None if module.bias is None else module.bias.to(cdt)
        return F.linear(xq, w, b).to(x.dtype)
