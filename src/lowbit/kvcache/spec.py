"""The quantization spec of the FP8 KV cache (``kv_cache="fp8"``)."""

from __future__ import annotations

from lowbit.numerics import FormatName
from lowbit.schemes import Dynamic, Granularity, QuantSpec

#: how K and V are quantized under ``kv_cache="fp8"``: E4M3, one static scale per tensor (per layer)
KV_SPEC = QuantSpec(FormatName.E4M3, Granularity.TENSOR, dynamic=Dynamic.STATIC)
