"""Bit packing: nibbles (NVFP4 layout) and int32 words (compressed-tensors pack-quantized)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbit.errors import QuantizationError
from lowbit.numerics import E2M1
from lowbit.quant import pack_int32, pack_nibbles, quantize, unpack_int32, unpack_nibbles
from lowbit.schemes import PRESETS

SETTINGS = settings(max_examples=25, deadline=None)


def u8(*v):
    return torch.tensor(v, dtype=torch.uint8)


# ---------------------------------------------------------------------------- nibbles
def test_nibble_layout_explicit_bytes():
    packed = pack_nibbles(u8(0x1, 0x2, 0x3, 0x4, 0xF, 0x0, 0x0, 0xA))
    # element 2i in the LOW nibble, 2i+1 in the high nibble
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [0x21, 0x43, 0x0F, 0xA0]
    assert unpack_nibbles(packed).tolist() == [1, 2, 3, 4, 15, 0, 0, 10]


def test_nibble_pack_2d_rows_independent():
    codes = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.uint8)
    assert pack_nibbles(codes).tolist() == [[0x21, 0x43], [0x65, 0x87]]
    assert pack_nibbles(codes).shape == (2, 2)
    assert pack_nibbles(codes).is_contiguous()


def test_nibble_round_trip_all_pairs_and_nvfp4_codes():
    a, b = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    codes = torch.stack([b.reshape(-1), a.reshape(-1)], -1).reshape(-1).to(torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == list(range(256))  # (lo=b, hi=a) pairs in order: every byte value 16*a + b
    assert torch.equal(unpack_nibbles(packed), codes)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    q = quantize(x, PRESETS["nvfp4"].weights)
    p = pack_nibbles(q.codes)
    assert p.shape == (8, 32)
    assert torch.equal(unpack_nibbles(p), q.codes)
    assert torch.equal(E2M1.decode(p[:, :1] & 0xF), E2M1.decode(q.codes[:, :1]))


@SETTINGS
@given(st.integers(1, 4), st.integers(1, 40), st.data())
def test_nibble_round_trip_property(rows, half, data):
    vals = data.draw(st.lists(st.integers(0, 15), min_size=rows * half * 2, max_size=rows * half * 2))
    codes = torch.tensor(vals, dtype=torch.uint8).reshape(rows, 2 * half)
    packed = pack_nibbles(codes)
    assert packed.shape == (rows, half)
    assert torch.equal(packed, codes[:, 0::2] | (codes[:, 1::2] << 4))
    assert torch.equal(unpack_nibbles(packed), codes)


def test_nibble_errors():
    with pytest.raises(QuantizationError, match="odd"):
        pack_nibbles(u8(1, 2, 3), name="w")
    with pytest.raises(QuantizationError, match="'w'"):
        pack_nibbles(u8(1, 16), name="w")
    with pytest.raises(TypeError):
        pack_nibbles(torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(TypeError):
        unpack_nibbles(torch.tensor([1, 2], dtype=torch.int8))


# ---------------------------------------------------------------------------- int32 words
def _word(unsigned: int) -> int:
    """The int32 value of a 32-bit pattern."""
    return unsigned - (1 << 32) if unsigned >= 1 << 31 else unsigned


def test_int4_word_explicit():
    v = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7], dtype=torch.int8)
    w = pack_int32(v, 4)
    # +8 offset: nibbles 8..15, lowest first -> 0xFEDCBA98
    assert w.dtype == torch.int32 and w.tolist() == [_word(0xFEDCBA98)]
    assert pack_int32(torch.tensor([-8] * 8), 4).tolist() == [0]
    assert pack_int32(torch.tensor([-1, 0, 1, -8, 7, -2, 2, 3]), 4).tolist() == [_word(0xBA6F0987)]
    assert unpack_int32(w, 4, 8).tolist() == v.tolist()


def test_int8_word_explicit():
    v = torch.tensor([1, 2, 3, 4, -128, 127, 0, -1])
    w = pack_int32(v, 8)
    # +128 offset, 4 per word lowest byte first
    assert w.tolist() == [_word(0x84838281), _word(0x7F80FF00)]
    assert unpack_int32(w, 8, 8).tolist() == v.tolist()
    assert unpack_int32(w, 8, 8).dtype == torch.int32


def test_int32_ragged_tail():
    v = torch.tensor([[7, -8, 1, 2, 3, 4, 5, 6, -1, 0]])
    w = pack_int32(v, 4)
    assert w.shape == (1, 2)
    # the tail word holds two values (+8: 7 and 8) and zero padding above them
    assert w[0, 1].item() == 0x87
    assert w[0, 0].item() == _word(0xEDCBA90F)
    assert unpack_int32(w, 4, 10).tolist() == v.tolist()
    assert unpack_int32(w, 4, 16)[0, 10:].tolist() == [-8] * 6  # the padding reads as offset 0


@SETTINGS
@given(bits=st.sampled_from([2, 4, 8]), rows=st.integers(1, 3), n=st.integers(1, 70), data=st.data())
def test_int32_round_trip_property(bits, rows, n, data):
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    vals = data.draw(st.lists(st.integers(lo, hi), min_size=rows * n, max_size=rows * n))
    v = torch.tensor(vals, dtype=torch.int32).reshape(rows, n)
    w = pack_int32(v, bits)
    per = 32 // bits
    assert w.shape == (rows, -(-n // per)) and w.dtype == torch.int32
    assert torch.equal(unpack_int32(w, bits, n), v)
    # independent check of one word: sum of (v + offset) << (bits * i)
    first = sum(((vals[i] - lo) << (bits * i)) for i in range(min(per, n)))
    assert w[0, 0].item() == _word(first)


def test_int32_errors():
    with pytest.raises(QuantizationError):
        pack_int32(torch.tensor([8]), 4)
    with pytest.raises(QuantizationError):
        pack_int32(torch.tensor([-9]), 4)
    with pytest.raises(ValueError):
        pack_int32(torch.tensor([1]), 3)
    with pytest.raises(TypeError):
        unpack_int32(torch.tensor([1], dtype=torch.int64), 4, 8)
