"""Triton GPU kernels, bit-exact with lowbit.quant (activation quantization, weight
dequantization) plus the W8A8 matmul routes through torch._int_mm / torch._scaled_mm.

Importing this package does not import Triton; its submodules do (``actquant``, ``dequant``,
``gemm``). ``triton_available()`` says whether they can be used. Triton decides at import
time of a submodule whether kernels run compiled (a CUDA GPU) or under its CPU interpreter
(``TRITON_INTERPRET=1``, used by the tests); lowbit never sets that variable itself.
"""

from __future__ import annotations

import functools
import importlib.util


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Triton is installed (it does not say whether a GPU is present)."""
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def cuda_triton_available() -> bool:
    """Triton installed and a CUDA device present: the kernels can run compiled."""
    import torch

    return triton_available() and torch.cuda.is_available()


__all__ = ["triton_available", "cuda_triton_available"]
