"""The entry points of the GGML kernels: the encoding of a tensor (its MXFP4 / NVFP4 encoders and the
direct importance search of Q4_0 / Q5_0) and GPTQ's column loop on a fixed GGML grid.

Each runs the native implementation (lowbit.kernels.native, C: ggml_native.c, ggml_fp4_native.c)
where the kernel setting allows it (lowbit.kernels.select) and the input fits (contiguous float32
CPU tensors), else the reference, the torch code of lowbit.numerics.ggml_fp4, ggml_direct and
lowbit.algorithms.gptq_grid; both give the same bits (tests/kernels/test_ggml_native.py,
test_ggml_fp4_native.py).
"""

from __future__ import annotations

import torch

from lowbit.kernels.select import Implementation, allows
from lowbit.numerics.ggml import GgmlType, ImportanceSearch
from lowbit.numerics.ggml import encode as reference_encode
from lowbit.numerics.ggml_direct import candidate_numerators, direct_symmetric_search


def direct_search(x: torch.Tensor, nmax: int, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``direct_symmetric_search(x, nmax, w)``: (scale [S], int64 codes [S, n]), in C where the
    setting allows and x, w are contiguous float32 CPU tensors (finite x, blocks of at most 64)."""
    if allows(Implementation.NATIVE):
        from lowbit.kernels.native import direct_search as native_search

        nums = torch.tensor(candidate_numerators(nmax), dtype=torch.float32)
        got = native_search(x.contiguous(), nmax, w.contiguous(), nums)
        if got is not None:
            return got[0], got[1].to(torch.int64)
    return direct_symmetric_search(x, nmax, w)


#: the types whose whole encoding has a native implementation (their reference takes no importance)
NATIVE_TYPES = frozenset({GgmlType.MXFP4, GgmlType.NVFP4})


def encode(x: torch.Tensor, kind: GgmlType, name: str = "tensor", importance: torch.Tensor | None = None,
           search: ImportanceSearch = ImportanceSearch.LLAMA_CPP) -> torch.Tensor:
    """``lowbit.numerics.ggml.encode``, its bytes: MXFP4 and NVFP4 in C where the setting allows and x
    is a contiguous float32 CPU tensor (``importance`` and ``search`` change nothing for them, as in
    the reference; NaN / Inf and shapes the block does not divide go to the reference, which
    raises), else the reference, its direct search through ``direct_search``."""
    kind = GgmlType(kind)
    if kind in NATIVE_TYPES and allows(Implementation.NATIVE):
        from lowbit.kernels.native import encode_fp4

        got = encode_fp4(x, kind.value)
        if got is not None:
            return got
    return reference_encode(x, kind, name, importance, search, direct_search=direct_search)


def grid_block(device: torch.device | str = "cpu"):
    """The native block of GPTQ's column loop on a GGML grid (lowbit.kernels.native.grid_block_fn)
    when the setting allows the native implementation and the weights are on the CPU, else None."""
    if not (allows(Implementation.NATIVE) and torch.device(device).type == "cpu"):
        return None
    from lowbit.kernels.native import grid_block_fn

    return grid_block_fn()
