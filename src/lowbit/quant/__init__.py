"""The quantization primitives: scale groups, scale rules (max, full range, MSE search),
quantize/dequantize, packing and quantized tensors; pure functions on tensors. The algorithms
built on them (GPTQ, SmoothQuant) live in lowbit.algorithms."""

from lowbit.kernels.bitpack import pack_int32, pack_nibbles, pack_sixes, unpack_int32, unpack_nibbles, unpack_sixes
from lowbit.quant.qtensor import PackedQuantizedTensor, QuantizedTensor, nibbles
from lowbit.quant.mse_scales import group_error, search_scales
from lowbit.quant.qdq import (
    allows_ragged, amax, check_finite, dequantize, effective_scale, fake_quantize,
    global_scale_from_amax, int_values, num_groups, quantize, quantize_into, scales_from_amax, static_scale_from_amax,
)

__all__ = [
    "QuantizedTensor", "PackedQuantizedTensor", "nibbles", "quantize", "quantize_into", "int_values", "dequantize", "fake_quantize", "amax", "check_finite",
    "effective_scale", "global_scale_from_amax", "scales_from_amax", "static_scale_from_amax",
    "num_groups", "allows_ragged", "search_scales", "group_error", "pack_nibbles", "unpack_nibbles", "pack_int32", "unpack_int32", "pack_sixes", "unpack_sixes",
]
