"""The algorithms built on the quantization primitives of lowbit.quant: GPTQ weight rounding
(``gptq``, ``gptq_solve``) and SmoothQuant (``smoothquant``). Pure functions on tensors (and, for
SmoothQuant's fold, on the modules it rescales); the calibration pipeline calls them."""

from lowbit.algorithms.gptq import (
    GPTQOptions, WeightRounding, gptq_quantize, gptq_quantize_groups, gptq_quantize_shared, inverse_hessian_factor,
)

__all__ = [
    "GPTQOptions", "WeightRounding", "gptq_quantize", "gptq_quantize_groups", "gptq_quantize_shared",
    "inverse_hessian_factor",
]
