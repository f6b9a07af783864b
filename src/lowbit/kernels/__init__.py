"""lowbit's kernels: one interface per operation, one selection point, and the implementations.

- ``select``: the setting (``Implementation``, ``using``) that decides which implementation runs,
  and how the native library is built (``BuildOptions``, lowbit.kernels.build_options);
- ``interface``: the operations and their contracts;
- ``codes`` (encode, decode, QDQ of a format) and ``rounding`` (nearest rounding): the entry points
  of the element kernels; quantize groups and the QDQ of a spec are lowbit.quant's ``quantize``
  and ``fake_quantize``, which choose through ``select`` as well;
- implementations: ``torch_ops`` (torch), ``native`` (the C library and its build), and the Triton
  GPU kernels (``actquant``, ``dequant``, ``matmul``, ``gemm``, ``epilogue``, ``bits``), bit-exact
  with lowbit.quant;
- ``gpu``: the entry points of the GPU kernels for the Triton backends of lowbit.backends (and for
  ``triton_ops``), which ask ``select`` before running one.

Importing this package does not import Triton; the Triton submodules do. Triton decides at import
time of a submodule whether kernels run compiled (a CUDA GPU) or under its CPU interpreter
(``TRITON_INTERPRET=1``, used by the tests); lowbit never sets that variable itself.
"""

from __future__ import annotations

from lowbit.kernels.build_options import BuildOptions
from lowbit.kernels.select import Implementation, KernelUnavailable, Selection, available, current, resolve, using
from lowbit.kernels.support import cuda_triton_available, triton_available

__all__ = ["BuildOptions", "Implementation", "KernelUnavailable", "Selection", "available", "current", "resolve",
           "using", "triton_available", "cuda_triton_available"]
