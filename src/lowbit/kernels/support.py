"""Which specs the kernels handle (pure predicates; importing this does not import Triton)."""

from __future__ import annotations

import functools
import importlib.util

from lowbit.numerics import FormatName
from lowbit.schemes import Dynamic, Granularity, QuantSpec

BLOCK_SIZES = (16, 32, 64, 128)


def supports_block_spec(spec: QuantSpec | None) -> bool:
    """Microscaled activation specs with dynamic block scales (NVFP4, NVFP4-E5M3, MXFP4/8)."""
    return (spec is not None and spec.granularity is Granularity.GROUP and spec.is_microscaled
            and spec.symmetric and spec.dynamic is not Dynamic.STATIC
            and spec.format in (FormatName.E2M1, FormatName.E4M3) and spec.group_size in BLOCK_SIZES)


def supports_row_spec(spec: QuantSpec | None) -> bool:
    """INT8 / FP8-E4M3 activations per token (dynamic) or per tensor (static), without a scale floor."""
    if spec is None or not spec.symmetric or spec.scale_format is not FormatName.FP32 or spec.scale_floor is not None:
        return False
    if spec.format not in (FormatName.INT8, FormatName.E4M3):
        return False
    return ((spec.granularity is Granularity.TOKEN and spec.dynamic is Dynamic.DYNAMIC)
            or (spec.granularity is Granularity.TENSOR and spec.dynamic is Dynamic.STATIC))


def supports_microscaled_weight(spec: QuantSpec) -> bool:
    return (spec.granularity is Granularity.GROUP and spec.is_microscaled and spec.symmetric
            and spec.format in (FormatName.E2M1, FormatName.E4M3) and spec.group_size in BLOCK_SIZES)


def supports_int_weight(spec: QuantSpec) -> bool:
    return (spec.is_integer and spec.format in (FormatName.INT8, FormatName.INT4)
            and spec.scale_format is FormatName.FP32
            and spec.granularity in (Granularity.CHANNEL, Granularity.GROUP, Granularity.TENSOR))


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Triton is installed (it does not say whether a GPU is present)."""
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def cuda_triton_available() -> bool:
    """Triton installed and a CUDA device present: the kernels can run compiled."""
    import torch

    return triton_available() and torch.cuda.is_available()


def triton_interpreted() -> bool:
    """Triton installed and its CPU interpreter in force (Triton's TRITON_INTERPRET setting, read
    by Triton; lowbit never sets it): the kernels then run on CPU tensors (the kernel tests)."""
    if not triton_available():
        return False
    from triton import knobs

    return bool(knobs.runtime.interpret)
