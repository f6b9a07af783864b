"""In-place rounding to the nearest value of a number format, up to the sign of zero: the one
entry point of this kernel.

For callers that only need the nearest grid value of finite float32 values: GPTQ's column loop
(the final codes are ``quantize`` of the solved weights with the fixed scales) and the mse scale
search (it sums squared errors). Both overwrite ``y`` with ``fmt.qdq(y)`` (round to nearest, ties
to even, saturating) except that a negative value that rounds to zero may come back as +0.0 or
-0.0. The ``torch`` implementation (lowbit.kernels.torch_ops: INT round and clamp, the magic
number addition for signed minifloats) runs when the kernel setting allows it
(lowbit.kernels.select), else the ``reference``: the format's own ``qdq``.
"""

from __future__ import annotations

from typing import Callable

import torch

from lowbit.kernels import native, torch_ops
from lowbit.kernels.select import Implementation, allows

supports = torch_ops.supports_rounding  # INT and minifloats (unsigned ones: non-negative values only)


def _check(fmt) -> None:
    if not supports(fmt):
        raise ValueError(f"no in-place nearest rounding for the format {fmt!r}")


def round_nearest_(y: torch.Tensor, fmt) -> torch.Tensor:
    """``fmt.qdq(y)`` up to the sign of zero, in place, for a contiguous float32 tensor of finite
    values (non-negative ones for an unsigned format); returns y."""
    _check(fmt)
    if allows(Implementation.TORCH):
        return torch_ops.round_nearest_(y, fmt)
    return y.copy_(fmt.qdq(y))


def column_rounder(fmt, n: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """(y, f): a float32 buffer ``y`` [n] on ``device`` and ``f()`` that overwrites it, holding
    finite values, with ``round_nearest_(y, fmt)`` and returns it (buffers and constants made
    once: GPTQ rounds ~100k columns of ~1000-3000 weights per model). Each call has its own
    buffers."""
    _check(fmt)
    if allows(Implementation.TORCH):
        return torch_ops.column_rounder(fmt, n, device)
    y = torch.empty(n, dtype=torch.float32, device=device)
    return y, lambda: y.copy_(fmt.qdq(y))


def gptq_sub_block(fmt, device: torch.device | str = "cpu"):
    """(``lb_gptq_sub``, its rounding arguments) when the setting allows the native GPTQ column loop
    (lowbit.algorithms.gptq_solve) and the weights are on the CPU, else None."""
    _check(fmt)
    fn = native.gptq_sub_fn() if allows(Implementation.NATIVE) and torch.device(device).type == "cpu" else None
    return None if fn is None else (fn, native.rounding_args(fmt))
