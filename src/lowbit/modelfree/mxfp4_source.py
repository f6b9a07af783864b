"""gpt-oss's MXFP4 expert tensors as its checkpoints store them (``quantization_config``
``quant_method: "mxfp4"``), dequantized one expert at a time.

``<block>.experts.gate_up_proj_blocks`` uint8 [E, 2I, G, 16] holds two E2M1 codes per byte (the
even element in the low nibble) of the [E, 2I, H] weights in [out, in] orientation (gate and up
rows interleaved), ``..._scales`` uint8 [E, 2I, G] their E8M0 block exponents (value 2^(code-127),
one per 32 elements); ``down_proj_blocks`` / ``_scales`` likewise for [E, H, I]. Every decoded
value (an E2M1 value times a power of two) is exact in float32 and, within its range, in bfloat16.
"""

from __future__ import annotations

import torch

from lowbit.numerics import E2M1, E8M0
from lowbit.quant import unpack_nibbles

BLOCKS, SCALES = "_blocks", "_scales"


def dequantize_expert(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One expert's [R, G, 16] uint8 blocks and [R, G] uint8 scales -> [R, 32 G] in ``dtype``."""
    codes = unpack_nibbles(blocks.contiguous())                     # [R, G, 32]
    vals = E2M1.decode(codes) * E8M0.decode(scales.contiguous()).unsqueeze(-1)
    return vals.reshape(blocks.shape[0], -1).to(dtype)


def dequantized_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """[E, R, G, 16] -> [E, R, 32 G]."""
    e, r, g, b = blocks_shape
    return (e, r, 2 * g * b)
