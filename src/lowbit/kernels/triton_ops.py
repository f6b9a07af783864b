"""The ``triton`` implementation of the QDQ of a spec: activation quantize-dequantize by the Triton
kernels (lowbit.kernels.actquant, through its entry points in lowbit.kernels.gpu), bit for bit the reference ``fake_quantize``. Reached only through
``lowbit.quant.fake_quantize`` under ``using(Implementation.TRITON)`` for CUDA tensors (under
Triton's CPU interpreter the kernels also take CPU tensors: tests/kernels/test_triton_kernels.py).

- microscaled block specs (``supports_block_spec``: NVFP4, NVFP4-E5M3, MXFP4/8 with dynamic block
  scales; the global scale given where the spec has one): the block kernel's float32 QDQ output;
- INT8 / FP8-E4M3 rows (``supports_row_spec``): the row kernel's codes times their scale (+0.0
  for INT, as the reference: an integer code decodes to +0.0).

Anything else returns None (the next implementation runs). NaN/Inf in the input is a
QuantizationError naming the tensor (the kernels' message).
"""

from __future__ import annotations

import torch

from lowbit.kernels import gpu
from lowbit.kernels.support import supports_block_spec, supports_row_spec
from lowbit.numerics import IntFormat, get_format
from lowbit.schemes import Dynamic, Granularity, QuantSpec


def fake_quantize(x: torch.Tensor, spec: QuantSpec, *, scale: torch.Tensor | None = None,
                  global_scale: torch.Tensor | None = None, name: str = "tensor") -> torch.Tensor | None:
    """The reference ``fake_quantize(x, spec, ...)`` by the Triton kernels, or None (no kernel)."""
    if x.dim() == 0 or not x.numel():
        return None
    if supports_block_spec(spec) and scale is None and x.shape[-1] % spec.group_size == 0:
        if spec.global_scale and global_scale is None:
            return None  # the reference computes it from x
        return gpu.quantize_blocks(x, spec, global_scale if spec.global_scale else None, codes=False,
                               qdq_dtype=torch.float32, name=name)["qdq"]
    static = spec.granularity is Granularity.TENSOR and spec.dynamic is Dynamic.STATIC
    if supports_row_spec(spec) and (scale is not None) == static:
        codes, s = gpu.quantize_rows(x, spec, scale, name=name)
        fmt = get_format(spec.format)
        out = fmt.decode(codes) * s
        return out.add_(0.0) if isinstance(fmt, IntFormat) else out
    return None
