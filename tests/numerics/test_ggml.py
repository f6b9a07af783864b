"""GGML's block types: lowbit's decode equals gguf-py's dequantization bit for bit on any bytes,
and lowbit's encode equals gguf-py's port of llama.cpp's reference quantizer byte for byte, on
adversarial blocks (ties of the rounding, a largest magnitude on a tie, zero and constant blocks,
fp16 overflow and subnormal scales)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize as g_dequantize, quantize as g_quantize  # noqa: E402

from lowbit.errors import QuantizationError  # noqa: E402
from lowbit.numerics import ggml_blocks, ggml_kquants  # noqa: E402
from lowbit.numerics.ggml import GgmlType  # noqa: E402

BLOCK_TYPES = {GgmlType.Q8_0: T.Q8_0, GgmlType.Q4_0: T.Q4_0, GgmlType.Q4_1: T.Q4_1,
               GgmlType.Q5_0: T.Q5_0, GgmlType.Q5_1: T.Q5_1}
K_TYPES = {GgmlType.Q2_K: T.Q2_K, GgmlType.Q3_K: T.Q3_K, GgmlType.Q4_K: T.Q4_K, GgmlType.Q5_K: T.Q5_K, GgmlType.Q6_K: T.Q6_K}


def _adversarial_rows() -> torch.Tensor:
    """Rows of 32 (one block each) that stress the reference quantizers."""
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(64, 32, generator=g) * s for s in (1e-3, 0.02, 1.0, 300.0)]
    rows.append(torch.zeros(2, 32))                                      # d = 0: inverse 0
    rows.append(torch.full((2, 32), 0.75))                              # constant block
    tie = torch.randn(4, 32, generator=g)
    tie[:, 3], tie[:, 9] = 2.5, -2.5                                    # +-max: the first wins
    rows.append(tie)
    halves = torch.arange(32, dtype=torch.float32)[None] * 0.5 - 8.0     # x * id lands on .5 exactly
    rows += [halves, halves * 127 / 16, -halves]
    rows.append(torch.tensor([[1e7] + [1.0] * 31]))                     # d beyond fp16's largest: inf
    rows.append(torch.randn(2, 32, generator=g) * 1e-6)                  # fp16-subnormal scales
    return torch.cat([r.reshape(-1, 32) for r in rows])


@pytest.mark.parametrize("kind", list(BLOCK_TYPES))
def test_encode_is_the_reference_quantizer_byte_for_byte(kind):
    x = _adversarial_rows()
    ours = ggml_blocks.encode(x, kind)
    with np.errstate(over="ignore"):  # the fp16 overflow row: gguf-py warns, both write inf
        theirs = g_quantize(x.numpy(), BLOCK_TYPES[kind])
    assert ours.shape == (x.shape[0], ggml_blocks.BLOCK_BYTES[kind])
    np.testing.assert_array_equal(ours.numpy(), theirs)


@pytest.mark.parametrize("kind", list(BLOCK_TYPES))
def test_decode_equals_gguf_py_on_any_bytes(kind):
    nb = ggml_blocks.BLOCK_BYTES[kind]
    data = torch.randint(0, 256, (64, 4 * nb), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    data.view(-1, nb)[:, 1] &= 0x7B  # a finite fp16 d (exponent bits not all ones) ...
    if kind in (GgmlType.Q4_1, GgmlType.Q5_1):
        data.view(-1, nb)[:, 3] &= 0x7B  # ... and m: every value finite, compared bit for bit
    ours = ggml_blocks.decode(data, kind)
    theirs = g_dequantize(data.numpy(), BLOCK_TYPES[kind])
    assert bool(torch.isfinite(ours).all())
    np.testing.assert_array_equal(ours.numpy().view(np.uint32), theirs.astype(np.float32).view(np.uint32))
    # and a round trip through lowbit's own encode is decoded the same by both
    enc = ggml_blocks.encode(_adversarial_rows()[:64], kind)
    np.testing.assert_array_equal(ggml_blocks.decode(enc, kind).numpy(), g_dequantize(enc.numpy(), BLOCK_TYPES[kind]))


@pytest.mark.parametrize("kind", list(K_TYPES))
def test_kquant_decode_equals_gguf_py_on_any_bytes(kind):
    nb = ggml_kquants.SUPER_BYTES[kind]
    data = torch.randint(0, 256, (16, 2 * nb), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    blk = data.view(-1, nb)
    for off in {GgmlType.Q2_K: (81, 83), GgmlType.Q3_K: (109,), GgmlType.Q4_K: (1, 3), GgmlType.Q5_K: (1, 3),
                GgmlType.Q6_K: (209,)}[kind]:
        blk[:, off] &= 0x7B  # finite fp16 d / dmin (the high byte's exponent bits not all ones)
    ours = ggml_kquants.decode(data, kind)
    theirs = g_dequantize(data.numpy(), K_TYPES[kind])
    assert bool(torch.isfinite(ours).all())
    np.testing.assert_array_equal(ours.numpy().view(np.uint32), theirs.astype(np.float32).view(np.uint32))


def test_roundf_ties_away_from_zero_and_exact_below_a_half():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, -0.49999997, 8388607.5, 3.0])
    assert ggml_blocks.roundf(x).tolist() == [1.0, 2.0, 3.0, -1.0, -3.0, 0.0, -0.0, 8388608.0, 3.0]


def test_bad_input_is_a_clear_error():
    with pytest.raises(QuantizationError, match="'w'.*multiple of GGML's block of 32"):
        ggml_blocks.encode(torch.zeros(2, 48), GgmlType.Q8_0, name="w")
    bad = torch.zeros(1, 32)
    bad[0, 5] = float("nan")
    with pytest.raises(QuantizationError, match="'w' holds NaN"):
        ggml_blocks.encode(bad, GgmlType.Q4_0, name="w")
    with pytest.raises(QuantizationError, match="whole blocks of 34 bytes"):
        ggml_blocks.decode(torch.zeros(1, 33, dtype=torch.uint8), GgmlType.Q8_0)
    with pytest.raises(QuantizationError, match="q6_k data must be uint8 in whole blocks of 210 bytes"):
        ggml_kquants.decode(torch.zeros(1, 200, dtype=torch.uint8), GgmlType.Q6_K)


def _fp4_rows() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    rows = [torch.randn(64, 32, generator=g) * s for s in (1e-30, 1e-3, 1.0, 1e6)]
    rows.append(torch.zeros(1, 32))
    grid = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0])
    rows.append(torch.cat([grid, -grid])[None] * 2.0)                    # every tie between two codes
    near = torch.full((4, 32), 0.1)
    near[:, 0] = torch.tensor([4.0, 3.9999998, 8.0, 7.9999995])          # amax at and just below powers of 2
    rows.append(near)
    return torch.cat(rows)


def test_mxfp4_encode_is_ggml_reference_and_decode_is_exact():
    from lowbit.numerics import ggml_fp4

    x = _fp4_rows()
    ours = ggml_fp4.encode_mxfp4(x)
    np.testing.assert_array_equal(ours.numpy(), g_quantize(x.numpy(), T.MXFP4))
    # amax 4, 4 - 2 ulp, 8, 8 - 1 ulp: float32 log2 of the last rounds up to 3, so the reference
    # gives it the scale of 8 (an exact floor(log2) would not)
    assert ours[-4:, 0].tolist() == [127, 126, 128, 128]
    data = torch.randint(0, 256, (32, 4 * 17), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    with np.errstate(over="ignore"):  # scale codes near 255 times 12: both give inf
        theirs = g_dequantize(data.numpy(), T.MXFP4).astype(np.float32)
    np.testing.assert_array_equal(ggml_fp4.decode_mxfp4(data).numpy().view(np.uint32), theirs.view(np.uint32))
    # the codes are OCP MXFP4's: lowbit's own E2M1 and E8M0 give the same values
    from lowbit.numerics import E2M1, E8M0

    blk = ours[:, :17]
    q = torch.cat([blk[:, 1:] & 0x0F, blk[:, 1:] >> 4], dim=1)
    ocp = E2M1.decode(q) * E8M0.decode(blk[:, :1])
    torch.testing.assert_close(ggml_fp4.decode_mxfp4(blk), ocp, rtol=0, atol=0)


def test_nvfp4_decode_equals_gguf_py_on_any_bytes():
    from lowbit.numerics import ggml_fp4

    data = torch.randint(0, 256, (32, 2 * 36), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    data.view(-1, 36)[:, :4] &= 0x7F  # UE4M3 scale codes (the sign bit unused)
    np.testing.assert_array_equal(ggml_fp4.decode_nvfp4(data).numpy().view(np.uint32),
                                  g_dequantize(data.numpy(), T.NVFP4).astype(np.float32).view(np.uint32))


def test_one_entry_point_for_every_type():
    from lowbit.numerics import ggml

    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 512, generator=g)
    for kind in GgmlType:
        n, nb = ggml.GEOMETRY[kind]
        data = ggml.encode(x, kind)
        assert data.shape == (3, 512 // n * nb) and data.dtype == torch.uint8
        back = ggml.decode(data, kind)
        assert back.shape == x.shape
        rel = float((back - x).norm() / x.norm())
        assert rel < {2: 0.5, 3: 0.25}.get(int(ggml.bits_per_weight(kind)), 0.15), (kind, rel)
    assert ggml.bits_per_weight(GgmlType.Q4_K) == 4.5 and ggml.bits_per_weight(GgmlType.Q8_0) == 8.5
