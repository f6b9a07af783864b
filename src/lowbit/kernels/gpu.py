"""The entry points of the GPU kernels that the Triton backends run.

The Triton backends of lowbit.backends (``triton``, ``cuda-int8``, ``cuda-fp8``; chosen per
module), their conformance checks and lowbit.kernels.triton_ops reach the kernel modules
(``actquant``, ``dequant``, ``matmul``, ``gemm``, ``epilogue``) only through the functions here:

- activation quantization: ``quantize_blocks`` (microscaled block specs), ``quantize_rows``
  (INT8 / FP8-E4M3 per token or per tensor);
- weights: ``pack_microscaled`` and ``pack_int`` (the packed layouts the kernels read),
  ``dequantize_microscaled`` and ``dequantize_int``;
- matmuls: ``mx_matmul`` (fused, packed microscaled weight), ``int8_matmul`` and ``fp8_matmul``
  (torch._int_mm / torch._scaled_mm), ``scale_epilogue`` (Triton) and ``apply_scales`` (torch),
  the W8A8 epilogue.

Every entry point that runs or imports a Triton kernel first asks the selection point,
``lowbit.kernels.select.require(Implementation.TRITON)``: without Triton and a CUDA device (or
Triton's CPU interpreter) it raises KernelUnavailable before a kernel module is imported. The torch
matmuls and ``apply_scales`` need no Triton. Arguments, results and errors are the kernel
modules' own (keyword tile sizes such as ``block_n`` are passed on as given); each function's
contract is stated on the kernel function it names.
"""

from __future__ import annotations

import torch

from lowbit.kernels.select import Implementation, require
from lowbit.schemes import QuantSpec


def _triton() -> None:
    require(Implementation.TRITON)


# ------------------------------------------------------------------------- activations
def quantize_blocks(x: torch.Tensor, spec: QuantSpec, global_scale: torch.Tensor | None = None, **kw) -> dict:
    """lowbit.kernels.actquant.quantize_blocks: codes, block scales (values, codes) and/or QDQ
    values of ``x`` under a microscaled spec, bit-exact with lowbit.quant."""
    _triton()
    from lowbit.kernels import actquant

    return actquant.quantize_blocks(x, spec, global_scale, **kw)


def quantize_rows(x: torch.Tensor, spec: QuantSpec, scale: torch.Tensor | None = None,
                  **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """lowbit.kernels.actquant.quantize_rows: (uint8 codes, float32 scale) of ``x`` per token
    (dynamic) or per tensor (static ``scale``), bit-exact with lowbit.quant."""
    _triton()
    from lowbit.kernels import actquant

    return actquant.quantize_rows(x, spec, scale, **kw)


# ------------------------------------------------------------------------- weights
def pack_microscaled(codes: torch.Tensor, scale: torch.Tensor, spec: QuantSpec,
                     name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """lowbit.kernels.dequant.pack_microscaled: (element bytes, uint8 block-scale codes)."""
    _triton()
    from lowbit.kernels import dequant

    return dequant.pack_microscaled(codes, scale, spec, name)


def pack_int(codes: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """lowbit.kernels.dequant.pack_int: int8 bytes (INT8) or int32 words (INT4)."""
    _triton()
    from lowbit.kernels import dequant

    return dequant.pack_int(codes, spec)


def dequantize_microscaled(data: torch.Tensor, scale_codes: torch.Tensor, spec: QuantSpec,
                           global_scale: torch.Tensor | None = None, **kw) -> torch.Tensor:
    """lowbit.kernels.dequant.dequantize_microscaled: the packed microscaled weight [out, in]
    in the asked dtype, bit-exact with lowbit.quant.dequantize."""
    _triton()
    from lowbit.kernels import dequant

    return dequant.dequantize_microscaled(data, scale_codes, spec, global_scale, **kw)


def dequantize_int(data: torch.Tensor, scale: torch.Tensor, spec: QuantSpec,
                   zero_point: torch.Tensor | None = None, **kw) -> torch.Tensor:
    """lowbit.kernels.dequant.dequantize_int: the packed INT weight [out, in] in the asked dtype,
    bit-exact with lowbit.quant.dequantize."""
    _triton()
    from lowbit.kernels import dequant

    return dequant.dequantize_int(data, scale, spec, zero_point, **kw)


# ------------------------------------------------------------------------- matmuls
def mx_matmul(x: torch.Tensor, data: torch.Tensor, scale_codes: torch.Tensor, spec: QuantSpec,
              global_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None, **kw) -> torch.Tensor:
    """lowbit.kernels.matmul.mx_matmul: x @ W^T (+ bias), W the packed microscaled weight."""
    _triton()
    from lowbit.kernels import matmul

    return matmul.mx_matmul(x, data, scale_codes, spec, global_scale, bias, **kw)


def scale_epilogue(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                   dtype: torch.dtype, **kw) -> torch.Tensor:
    """lowbit.kernels.epilogue.scale_epilogue: (acc * x_scale) * w_scale (+ bias) in ``dtype``,
    bit-identical to ``apply_scales(...).to(dtype)``."""
    _triton()
    from lowbit.kernels import epilogue

    return epilogue.scale_epilogue(acc, x_scale, w_scale, bias, dtype, **kw)


def int8_matmul(x_codes: torch.Tensor, w_codes_t: torch.Tensor) -> torch.Tensor:
    """lowbit.kernels.gemm.int8_matmul: the exact int32 product of int8 codes (no Triton)."""
    from lowbit.kernels import gemm

    return gemm.int8_matmul(x_codes, w_codes_t)


def fp8_matmul(x_codes: torch.Tensor, w_codes_t: torch.Tensor) -> torch.Tensor:
    """lowbit.kernels.gemm.fp8_matmul: the float32-accumulated product of E4M3 codes (no Triton)."""
    from lowbit.kernels import gemm

    return gemm.fp8_matmul(x_codes, w_codes_t)


def apply_scales(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """lowbit.kernels.gemm.apply_scales: (acc * x_scale) * w_scale (+ bias), float32 (no Triton)."""
    from lowbit.kernels import gemm

    return gemm.apply_scales(acc, x_scale, w_scale, bias)
