"""Bit packing of low-bit codes (a kernel: nibble packing has a native implementation, chosen in
lowbit.kernels.codes.pack_nibbles).

- Nibble packing: uint8 codes [..., n] (n even, values < 16) -> uint8 [..., n/2], element 2i
  in the low nibble and 2i+1 in the high nibble (compressed-tensors / NVFP4 layout).
- int32 packing: n-bit signed integers [..., n] -> int32 [..., ceil(n*bits/32)], 32/bits values
  per word, lowest first, each stored with a +2^(bits-1) offset (compressed-tensors
  pack-quantized). A ragged tail is zero-padded; unpacking needs the original length.
"""

from __future__ import annotations

import torch

from lowbit.errors import QuantizationError


def pack_nibbles(codes: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_nibbles expects uint8 codes, got {codes.dtype}")
    if codes.shape[-1] % 2:
        raise QuantizationError(f"tensor {name!r}: last dimension {codes.shape[-1]} is odd, cannot pack nibbles")
    native = _pack_native(codes)
    if native is not None:
        packed, top = native
        if top > 15:
            raise QuantizationError(f"tensor {name!r}: codes above 15 cannot be packed into nibbles")
        return packed
    if codes.numel() and int(codes.max()) > 15:
        raise QuantizationError(f"tensor {name!r}: codes above 15 cannot be packed into nibbles")
    c = codes.reshape(*codes.shape[:-1], -1, 2)
    packed = c[..., 1] << 4
    packed |= c[..., 0]
    return packed


def _pack_native(codes: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(packed, largest code) in one C pass (lowbit.kernels.codes.pack_nibbles), or None (torch path)."""
    from lowbit.kernels.codes import pack_nibbles as pack  # codes imports the C wrappers: loaded on first use

    return pack(codes)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_nibbles expects uint8, got {packed.dtype}")
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack signed ints in [-2^(bits-1), 2^(bits-1)) (any int dtype) into int32 words."""
    if 32 % bits:
        raise ValueError(f"int32 packing needs bits dividing 32, got {bits}")
    per = 32 // bits
    v = values.to(torch.int64) + (1 << (bits - 1))
    if bool((v < 0).any()) or bool((v >= (1 << bits)).any()):
        raise QuantizationError(f"values out of range for {bits}-bit packing")
    n = v.shape[-1]
    pad = (-n) % per
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    v = v.reshape(*v.shape[:-1], -1, per)
    shifts = torch.arange(per, dtype=torch.int64, device=v.device) * bits
    words = (v << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def unpack_int32(words: torch.Tensor, bits: int, length: int) -> torch.Tensor:
    """Inverse of pack_int32: int32 [..., w] -> int32 values [..., length]."""
    if words.dtype != torch.int32:
        raise TypeError(f"unpack_int32 expects int32, got {words.dtype}")
    per = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, dtype=torch.int64, device=w.device) * bits
    v = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    v = v.reshape(*words.shape[:-1], -1)[..., :length]
    return (v - (1 << (bits - 1))).to(torch.int32)


def pack_sixes(codes: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """6-bit codes uint8 [..., n] (n a multiple of 4, values < 64) -> uint8 [..., 3n/4]: each four
    codes c0..c3 form the 24-bit word c0 | c1 << 6 | c2 << 12 | c3 << 18, stored little-endian in
    three bytes (compressed-tensors' mxfp6-pack-quantized)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_sixes expects uint8 codes, got {codes.dtype}")
    if codes.shape[-1] % 4:
        raise QuantizationError(f"tensor {name!r}: last dimension {codes.shape[-1]} is not a multiple of 4, "
                                f"cannot pack 6-bit codes")
    if codes.numel() and int(codes.max()) > 63:
        raise QuantizationError(f"tensor {name!r}: codes above 63 cannot be packed into 6 bits")
    c = codes.reshape(*codes.shape[:-1], -1, 4).to(torch.int32)
    word = c[..., 0] | (c[..., 1] << 6) | (c[..., 2] << 12) | (c[..., 3] << 18)
    out = torch.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], dim=-1).to(torch.uint8)
    return out.reshape(*codes.shape[:-1], codes.shape[-1] // 4 * 3)


def unpack_sixes(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_sixes: uint8 [..., 3m] -> uint8 codes [..., 4m]."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_sixes expects uint8, got {packed.dtype}")
    b = packed.reshape(*packed.shape[:-1], -1, 3).to(torch.int32)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    c = torch.stack([(word >> s) & 0x3F for s in (0, 6, 12, 18)], dim=-1).to(torch.uint8)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] // 3 * 4)
