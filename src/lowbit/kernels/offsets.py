"""Block reconstruction's rounded weight and offset step (lowbit.algorithms.reconstruct_offsets,
fixed scales): the entry point of their kernels.

``fusable`` says whether the native kernels take a linear's offsets (the setting allows the
native implementation, which it does only where the library loads; the element format rounds
natively and is signed; the tensors are contiguous float32 CPU tensors); ``rounded_weight`` and ``offset_step`` then run them
(reconstruct_native.c), bit-identical to the torch and reference expressions
(tests/kernels/test_reconstruct_native.py). Where they do not apply, the caller keeps its torch
path.
"""

from __future__ import annotations

import torch

from lowbit.kernels import native
from lowbit.kernels.rounding import supports
from lowbit.kernels.select import Implementation, allows


def fusable(fmt: object, V: torch.Tensor, v: torch.Tensor, step: torch.Tensor, e: torch.Tensor,
            zero: torch.Tensor) -> bool:
    """Whether ``rounded_weight`` and ``offset_step`` take these offsets (see the module docstring)."""
    return (allows(Implementation.NATIVE) and supports(fmt) and getattr(fmt, "signed", True) is not False
            and native.offsets_fit(V, (v, step, e), zero))


def rounded_weight(V, v, step, e, zero, fmt) -> torch.Tensor | None:
    """``where(zero, 0, ((r - x) + x) * e)``, x = V * step + v, r the nearest grid value of x in
    ``fmt``, in one C pass; None when the library is unavailable."""
    return native.rounded_weight(V, v, step, e, zero, fmt)


def offset_step(V, g, e, step, zero, lr: float, exponent: int | None = None) -> bool:
    """``V = clamp(V - sign(where(zero, 0, g) * e * step) * lr, -0.5, 0.5)`` in place, in one C
    pass, g first rounded to a multiple of 2^-exponent when given (as
    ``lowbit.algorithms.reconstruct_steps`` rounds a one-atom gradient); False (V untouched) when
    the library is unavailable."""
    return native.offset_step(V, g, e, step, zero, lr, exponent)
