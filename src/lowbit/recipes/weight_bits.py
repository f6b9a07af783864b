"""Weight storage of a scheme, in bits, counting scales: the size measure of recipe budgets.

Per weight matrix [out, in] under a weight spec, the bits are

    out * in * element bits                       (the codes)
  + n_scales * scale bits                         (8 for UE4M3 / UE5M3 / E8M0 block scales,
                                                   16 for float scales, as compressed-tensors
                                                   and vLLM keep them in the model's 16-bit dtype)
  + n_scales * element bits, asymmetric specs     (the zero points)

with n_scales = out * ceil(in / group) for GROUP, out for CHANNEL, ceil(out/B) * ceil(in/B)
for BLOCK (B x B tiles). Per-tensor scalars (a per-tensor scale, NVFP4's global scale) are not
counted: a few bytes a matrix, they would only keep "4.5 bits" from meaning NVFP4. The average over a model is the sum over its quantized
linears divided by their element count: NVFP4 is 4.5 bits (4 + 8/16), MXFP4 4.25, W4A16 with
group 128 4.125, per-channel FP8/INT8 8 + 16/in. These are "effective bits" as NVIDIA ModelOpt's
auto_quantize counts them (weights and their scales; activations are not stored).
"""

from __future__ import annotations

import math

from lowbit.numerics import FormatName
from lowbit.schemes import Granularity, QuantSpec, Scheme

BLOCK_SCALE_BITS = {FormatName.UE4M3: 8, FormatName.UE5M3: 8, FormatName.E8M0: 8}
FLOAT_SCALE_BITS = 16


def n_scales(spec: QuantSpec, out_features: int, in_features: int) -> int:
    g = spec.granularity
    if g is Granularity.GROUP:
        return out_features * math.ceil(in_features / spec.group_size)
    if g is Granularity.CHANNEL:
        return out_features
    if g is Granularity.BLOCK:
        return math.ceil(out_features / spec.group_size) * math.ceil(in_features / spec.group_size)
    return 0  # TENSOR: one scalar, not counted


def weight_bits(scheme: Scheme, out_features: int, in_features: int) -> int:
    """The bits ``scheme`` stores one [out_features, in_features] weight in (see the module)."""
    spec = scheme.weights
    k = n_scales(spec, out_features, in_features)
    bits = out_features * in_features * spec.bits
    bits += k * BLOCK_SCALE_BITS.get(spec.scale_format, FLOAT_SCALE_BITS)
    if not spec.symmetric:
        bits += k * spec.bits
    return bits


def average_bits(shapes: dict[str, tuple[int, int]], schemes: dict[str, Scheme]) -> float:
    """The average bits per weight element over the linears ``schemes`` names (their [out, in]
    in ``shapes``)."""
    total = sum(weight_bits(schemes[n], *shapes[n]) for n in schemes)
    return total / max(1, sum(shapes[n][0] * shapes[n][1] for n in schemes))
