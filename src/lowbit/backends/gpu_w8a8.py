"""``cuda-int8`` and ``cuda-fp8``: W8A8 on the GPU with exact low-precision products.

The input is quantized by a Triton kernel (per token, dynamic, or per tensor with the static
calibrated scale; codes and scales bit-exact with lowbit.quant), multiplied with the int8 /
E4M3 weight codes by torch._int_mm (int32 accumulation, exact) or torch._scaled_mm (float32
accumulation), then scaled in float32: y = (acc * x_scale) * w_scale + bias (one Triton
epilogue pass). The kernels and matmuls are reached through their entry points,
lowbit.kernels.gpu (which ask lowbit.kernels.select).
"""

from __future__ import annotations

import torch

from lowbit.backends.cache import ModuleCache
from lowbit.kernels import Implementation, gpu
from lowbit.kernels import available as kernel_available
from lowbit.numerics import FormatName
from lowbit.schemes import Granularity, Scheme


def _supports(scheme: Scheme, fmt: FormatName) -> bool:
    from lowbit.kernels.support import supports_row_spec

    w, a = scheme.weights, scheme.input_activations
    return (w.format is fmt and w.granularity is Granularity.CHANNEL and w.symmetric
            and w.scale_format is FormatName.FP32 and a is not None and a.format is fmt and supports_row_spec(a))


def supports_int8(scheme: Scheme) -> bool:
    return _supports(scheme, FormatName.INT8)


def supports_fp8(scheme: Scheme) -> bool:
    return _supports(scheme, FormatName.E4M3)


def int8_available() -> bool:
    return kernel_available(Implementation.TRITON) and hasattr(torch, "_int_mm")


def fp8_available() -> bool:
    if not (kernel_available(Implementation.TRITON) and hasattr(torch, "_scaled_mm")):
        return False
    return torch.cuda.get_device_capability() >= (8, 9)


class _W8A8Backend:
    name = ""
    _fmt: FormatName

    def __init__(self, check_finite: bool = True) -> None:
        self.check_finite = check_finite
        self.cache = ModuleCache()

    def release(self, module) -> None:
        self.cache.release(module)

    def _weight_t(self, module) -> torch.Tensor:
        codes = self.cache.get(module, lambda m: m.weight_codes.contiguous())
        return codes.t()  # [K, N], column-major: the layout cuBLAS wants for mat2

    def _matmul(self, xc: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, module, x: torch.Tensor) -> torch.Tensor:
        module.check_ready()
        spec = module.scheme.input_activations
        x2 = x.reshape(-1, module.in_features)
        name = f"{module.name}.input" if module.name else "input"
        codes, sx = gpu.quantize_rows(x2, spec, module.input_scale, check_finite=self.check_finite, name=name)
        acc = self._matmul(codes, self._weight_t(module))
        if x.dtype in (torch.float32, torch.bfloat16):  # one Triton pass, bit-identical to apply_scales
            y = gpu.scale_epilogue(acc, sx, module.weight_scale, module.bias, x.dtype)
        else:
            y = gpu.apply_scales(acc, sx, module.weight_scale, module.bias).to(x.dtype)
        return y.reshape(*x.shape[:-1], module.out_features)


class Int8MMBackend(_W8A8Backend):
    name = "cuda-int8"

    def _matmul(self, xc, w_t):
        return gpu.int8_matmul(xc, w_t)


class FP8MMBackend(_W8A8Backend):
    name = "cuda-fp8"

    def _matmul(self, xc, w_t):
        return gpu.fp8_matmul(xc, w_t)
