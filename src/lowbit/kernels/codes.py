"""Element encode, decode and QDQ of a number format: the one entry point of these kernels.

Each function returns what the format's reference (lowbit.numerics) returns, bit for bit, by the
implementation the kernel setting allows (lowbit.kernels.select): ``native`` (one C pass over a
CPU tensor: key-table formats, E8M0 and INTn; decode through the format's ``code_values``),
``torch`` (lowbit.kernels.torch_ops: key tables and INT rounding) or ``reference`` (the format's
own method). An implementation that does not take an input (another device, a format it has no
kernel for, a value the reference refuses) leaves it to the next one down, so errors are the
reference's.
"""

from __future__ import annotations

import torch

from lowbit.kernels import native, torch_ops
from lowbit.kernels.select import Implementation, allows


def encode(fmt: object, x: torch.Tensor) -> torch.Tensor:
    """``fmt.encode(x)``, bit for bit."""
    if allows(Implementation.NATIVE):
        codes = native.encode_format(fmt, x)
        if codes is not None:
            return codes
    if allows(Implementation.TORCH):
        codes = torch_ops.encode(fmt, x)
        if codes is not None:
            return codes
    return fmt.encode(x)  # type: ignore[attr-defined]


def decode(fmt: object, codes: torch.Tensor) -> torch.Tensor:
    """``fmt.decode(codes)``, bit for bit: natively one gather through the format's own
    ``code_values`` (the reference's index_select through the same table otherwise)."""
    values = getattr(fmt, "code_values", None)
    if values is not None and codes.dtype == torch.uint8 and allows(Implementation.NATIVE):
        out = native.decode(codes, values())
        if out is not None:
            return out
    return fmt.decode(codes)  # type: ignore[attr-defined]


def qdq(fmt: object, x: torch.Tensor) -> torch.Tensor:
    """``fmt.qdq(x)``, bit for bit: for a key-table minifloat, natively ``decode(encode(x))`` (a
    minifloat's qdq equals decode(encode(.)) bit for bit, its documented contract, tested);
    else ``fmt.qdq`` itself."""
    if torch_ops.has_table(fmt) and allows(Implementation.NATIVE):
        codes = native.encode_format(fmt, x)
        if codes is not None:
            return decode(fmt, codes)
    return fmt.qdq(x)  # type: ignore[attr-defined]


def pack_nibbles(codes: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(packed uint8 [..., n / 2], the largest code) of uint8 codes [..., n] (n even) in one C pass,
    or None when the native implementation does not take them (the caller packs with torch)."""
    if not codes.numel() or codes.device.type != "cpu" or not codes.is_contiguous():
        return None
    return native.pack_nibbles(codes) if allows(Implementation.NATIVE) else None
