"""Native (C) kernels on CPU tensors: per-group extremes and fused divide + encode (+ nibble pack);
GPTQ's sub-block column loop (``gptq_sub_fn``, raw pointers: lowbit.quant.gptq_solve).

Each wrapper returns None when the library is unavailable (no compiler, build failed, or
``build.ENABLED`` is False); callers then take their torch path, which gives the same bits.
Inputs: 2-D contiguous CPU tensors [rows, cols] of float32, bfloat16 or float16; groups of ``g``
consecutive elements of a row, the last one possibly shorter (it acts zero-padded).
"""

from __future__ import annotations

import torch

from lowbit.numerics.native.build import library

DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels take ``x`` (CPU, a supported float dtype) and the library loads."""
    return x.device.type == "cpu" and x.dtype in DTYPES and library() is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _rows_cols(x: torch.Tensor) -> tuple[int, int]:
    assert x.dim() == 2 and x.is_contiguous() and x.device.type == "cpu", "native kernels take 2-D contiguous CPU"
    return x.shape[0], x.shape[1]


def group_amax(x: torch.Tensor, g: int) -> tuple[torch.Tensor, bool] | None:
    """(float32 [rows, G] absolute max per group, whether x holds NaN/Inf)."""
    lib = library()
    if lib is None:
        return None
    rows, cols = _rows_cols(x)
    out = torch.empty(rows, -(-cols // g), dtype=torch.float32)
    bad = lib.lb_group_amax(_ptr(x), DTYPES[x.dtype], rows, cols, g, _ptr(out))
    return out, bool(bad)


def group_minmax(x: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """(float32 [rows, G] signed min, signed max per group (a ragged group includes 0), NaN/Inf)."""
    lib = library()
    if lib is None:
        return None
    rows, cols = _rows_cols(x)
    lo = torch.empty(rows, -(-cols // g), dtype=torch.float32)
    hi = torch.empty_like(lo)
    bad = lib.lb_group_minmax(_ptr(x), DTYPES[x.dtype], rows, cols, g, _ptr(lo), _ptr(hi))
    return lo, hi, bool(bad)


def encode(x: torch.Tensor, g: int, eff: torch.Tensor | None, fmt: object, *, pack: bool = False,
           out: torch.Tensor | None = None) -> torch.Tensor | None:
    """uint8 codes of ``fmt`` for x / eff (eff: float32 [rows, G], zero means code 0; None: x
    itself), nibble-packed into [rows, cols / 2] when ``pack``; written into ``out`` if given.
    None when the library is unavailable or a value needs the reference encoder (NaN, negative
    input of an unsigned format): the caller's torch path then raises the reference's error."""
    from lowbit.numerics.fast_encode import native_steps, native_table
    from lowbit.numerics.integer import IntFormat

    lib = library()
    if lib is None:
        return None
    rows, cols = _rows_cols(x)
    table = native_table(fmt)
    if table is not None:
        qmin, qmax, bits, neg = 0, 0, 8, not getattr(fmt, "signed", False)
    elif isinstance(fmt, IntFormat):
        table, qmin, qmax, bits, neg = None, fmt.qmin, fmt.qmax, fmt.bits, False
    else:
        return None
    if pack and (cols % 2 or fmt.bits != 4):
        raise ValueError(f"nibble packing needs 4-bit codes and an even last dimension, got {fmt.name}, {cols}")
    shape = (rows, cols // 2 if pack else cols)
    if out is None:
        out = torch.empty(shape, dtype=torch.uint8)
    assert out.shape == shape and out.dtype == torch.uint8 and out.is_contiguous()
    if eff is not None:
        assert eff.dtype == torch.float32 and eff.is_contiguous() and eff.shape == (rows, -(-cols // g))
    steps = native_steps(fmt) if table is not None else None
    status = lib.lb_encode(_ptr(x), DTYPES[x.dtype], rows, cols, g, _ptr(eff), _ptr(table), _ptr(steps), qmin, qmax,
                           bits, int(neg), int(pack), _ptr(out))
    return out if status == 0 else None


def decode(codes: torch.Tensor, values: torch.Tensor) -> torch.Tensor | None:
    """float32 ``values[codes]`` (uint8 codes on the CPU, values: float32 [256], a format's
    ``code_values``), or None when the library is unavailable."""
    lib = library()
    if lib is None or codes.device.type != "cpu":
        return None
    assert codes.dtype == torch.uint8 and values.dtype == torch.float32 and values.numel() == 256
    codes = codes.contiguous()
    out = torch.empty(codes.shape, dtype=torch.float32)
    lib.lb_decode(_ptr(codes), codes.numel(), _ptr(values.contiguous()), _ptr(out))
    return out


def pack_nibbles(codes: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(packed uint8 [..., n / 2], the largest code) of contiguous uint8 codes [..., n], n even."""
    lib = library()
    if lib is None:
        return None
    out = torch.empty(*codes.shape[:-1], codes.shape[-1] // 2, dtype=torch.uint8)
    m = lib.lb_pack_nibbles(_ptr(codes), codes.numel(), _ptr(out))
    return out, int(m)


def gptq_sub_fn():
    """``lb_gptq_sub`` (GPTQ's column loop inside one sub-block, lowbit.quant.gptq_solve), or None
    when the library is unavailable."""
    lib = library()
    return None if lib is None else lib.lb_gptq_sub
