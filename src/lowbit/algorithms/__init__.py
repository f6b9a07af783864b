"""The algorithms built on the quantization primitives of lowbit.quant: GPTQ weight rounding
(``gptq``, ``gptq_solve``), SmoothQuant (``smoothquant``), block-output reconstruction
(``reconstruct``) and fused Hadamard rotations (``rotate``). Pure functions on tensors (and, for
SmoothQuant's fold and the rotation pass, on the modules they rewrite); the calibration pipeline
and ``lowbit.quantize`` call them."""

from lowbit.algorithms.gptq import (
    GPTQOptions, WeightRounding, gptq_quantize, gptq_quantize_groups, gptq_quantize_shared, inverse_hessian_factor,
)

__all__ = [
    "GPTQOptions", "WeightRounding", "gptq_quantize", "gptq_quantize_groups", "gptq_quantize_shared",
    "inverse_hessian_factor",
]
