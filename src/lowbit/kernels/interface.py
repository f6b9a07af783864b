"""The kernel operations: what every implementation of each must return (bit for bit the reference).

Each operation has one entry point; the entry point asks lowbit.kernels.select which
implementations it may run and runs the highest one that takes the input.

=================  ==========================================  =====================================
operation          entry point                                 implementations
=================  ==========================================  =====================================
encode / decode    lowbit.kernels.codes.encode, .decode, .qdq  reference: ``fmt.encode/decode/qdq``;
                                                               torch: key tables, INT rounding
                                                               (torch_ops); native: one C pass
nearest rounding   lowbit.kernels.rounding.round_nearest_,     reference: ``fmt.qdq``; torch: magic
                   .column_rounder, .gptq_sub_block            number / INT round (torch_ops);
                                                               native: GPTQ's column loop in C
quantize groups    lowbit.quant.quantize (and .quantize_into)  reference: lowbit.quant.qdq;
                                                               native: lowbit.quant.native_quant
QDQ of a spec      lowbit.quant.fake_quantize (.int_values)    reference: lowbit.quant.qdq;
                                                               torch: lowbit.quant.fast_qdq;
                                                               triton: lowbit.kernels.triton_ops
GGML searches      lowbit.kernels.ggml.direct_search, .encode, reference: lowbit.numerics.ggml_direct,
                   .grid_block                                 lowbit.algorithms.gptq_grid (torch);
                                                               native: ggml_native.c
=================  ==========================================  =====================================

The Triton kernels are also run by the Triton backends (lowbit.backends: quantize groups of
activations, weight dequantization, fused matmuls), chosen per module, through their entry points
in lowbit.kernels.gpu (each asks ``select.require(Implementation.TRITON)``).

The Protocols below state the signatures; tests/kernels/test_kernel_conformance.py runs every
implementation of every operation on adversarial values of every format and compares bits.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch


class Codes(Protocol):
    def encode(self, fmt: object, x: torch.Tensor) -> torch.Tensor:
        """uint8 codes of ``x`` in ``fmt``: round to nearest, ties to even, saturating; the
        reference's error for NaN (a format without NaN) and negative input (unsigned)."""

    def decode(self, fmt: object, codes: torch.Tensor) -> torch.Tensor:
        """float32 values of uint8 ``codes``."""

    def qdq(self, fmt: object, x: torch.Tensor) -> torch.Tensor:
        """float32 nearest values: ``decode(encode(x))`` bit for bit, zero signs and NaN included."""


class Rounding(Protocol):
    def round_nearest_(self, y: torch.Tensor, fmt: object) -> torch.Tensor:
        """``fmt.qdq(y)`` in place for finite float32 ``y``, up to the sign of zero; returns y."""

    def column_rounder(self, fmt: object, n: int) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
        """(y [n], f) with ``f()`` == ``round_nearest_(y, fmt)``."""


class QuantizeGroups(Protocol):
    def __call__(self, x: torch.Tensor, spec, *, global_scale: torch.Tensor | None = None,
                 name: str = "tensor"):
        """The QuantizedTensor of ``x`` under ``spec`` (codes, scales, zero points, global scale)
        as lowbit.quant.qdq defines them; NaN/Inf is the QuantizationError naming ``name``."""


class SpecQDQ(Protocol):
    def __call__(self, x: torch.Tensor, spec, *, scale: torch.Tensor | None = None,
                 global_scale: torch.Tensor | None = None, name: str = "tensor") -> torch.Tensor:
        """float32 ``dequantize(quantize(x, spec, ...))``, bit for bit."""
