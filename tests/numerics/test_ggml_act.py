"""llama.cpp's CPU rounding of a matmul's activations (lowbit.numerics.ggml_act) on adversarial
values: ties, the sign and position of the largest element, zero blocks, the saturation bound,
each against ggml's arithmetic written out by hand (arch/x86/quants.c, ggml-quants.c)."""

from __future__ import annotations

import pytest
import torch

from lowbit.errors import QuantizationError
from lowbit.numerics.ggml import GgmlType
from lowbit.numerics.ggml_act import VEC_DOT, DotInput, dot_input_values, q8_0_codes, q8_k_codes


def _block(values, n):
    x = torch.zeros(n)
    x[: len(values)] = torch.tensor(values, dtype=torch.float32)
    return x


def test_q8_0_x86_rounds_half_to_even_with_127_over_amax():
    # amax 127: the multiplier is exactly 1, so x itself is rounded: ties go to even (the
    # reference quantize_row_q8_0_ref's roundf would give 3 and -3 for 2.5 and -2.5)
    x = _block([127.0, 2.5, -2.5, 3.5, 0.5, -0.5, 1.5], 32)
    q, d = q8_0_codes(x)
    assert q[0, :7].tolist() == [127, 2, -2, 4, 0, 0, 2]
    assert float(d[0]) == 1.0
    vals, s = dot_input_values(x, DotInput.Q8_0)
    assert s is None and vals[:7].tolist() == [127.0, 2.0, -2.0, 4.0, 0.0, 0.0, 2.0]


def test_q8_0_multiplier_is_the_rounded_reciprocal_not_one_over_d():
    # amax 3: 127/3 in float32 vs 1/(3/127): a product that lands on either side of a tie
    torch.manual_seed(0)
    x = torch.randn(64 * 32) * 3
    q, d = q8_0_codes(x)
    b = x.reshape(-1, 32)
    amax = b.abs().amax(1)
    want = torch.round(b * (torch.full_like(amax, 127.0) / amax)[:, None])
    assert torch.equal(q.float(), want)
    assert torch.equal(d, amax / 127.0)
    vals, _ = dot_input_values(x, DotInput.Q8_0)
    assert torch.equal(vals, (q.float() * d.half().float()[:, None]).reshape(-1))


def test_q8_0_zero_block_and_negative_extreme():
    x = torch.cat([torch.zeros(32), _block([-4.0, 2.0, 1.0], 32)])
    q, d = q8_0_codes(x)
    assert q[0].abs().sum() == 0 and float(d[0]) == 0.0
    assert q[1, :3].tolist() == [-127, 64, 32]              # 2 * 127/4 = 63.5 -> 64 (even), 31.75 -> 32


def test_q8_1_stores_fp16_of_float32_d_times_the_code_sum():
    x = _block([100.0, 33.3, -7.1, 0.01], 32)
    q, d = q8_0_codes(x)
    vals, s = dot_input_values(x, DotInput.Q8_1)
    assert float(s[0]) == float(torch.tensor(float(d[0]) * float(q.sum())).half())
    assert torch.equal(vals, (q.float() * d.half().float()).reshape(-1))


def test_q8_k_ties_sign_and_first_maximum():
    # max -127: iscale = 1, x rounds half to even (nearest_int)
    x = _block([-127.0, 2.5, 3.5, -2.5, 0.5, 1.5], 256)
    q, d = q8_k_codes(x)
    assert q[0, :6].tolist() == [-127, 2, 4, -2, 0, 2] and float(d[0]) == 1.0
    # max +127: iscale = -1, so the codes of -x are those of x and d = -1 (a positive maximum
    # takes the code -127, never +128: no clamp needed, and the tie directions mirror)
    q, d = q8_k_codes(-x)
    assert q[0, :6].tolist() == [-127, 2, 4, -2, 0, 2] and float(d[0]) == -1.0
    # a tie in magnitude: the first one sets the sign (+5 first: iscale -127/5)
    q, d = q8_k_codes(_block([5.0, -5.0, 1.0], 256))
    assert q[0, :2].tolist() == [-127, 127] and float(d[0]) == float(torch.tensor(1.0) / (torch.tensor(-127.0) / 5))
    q, d = q8_k_codes(_block([-5.0, 5.0], 256))
    assert q[0, :2].tolist() == [-127, 127] and float(d[0]) > 0


def test_q8_k_zero_block_and_values():
    torch.manual_seed(1)
    x = torch.cat([torch.zeros(256), torch.randn(256) * 7])
    q, d = q8_k_codes(x)
    assert q[0].abs().sum() == 0 and float(d[0]) == 0.0
    b = x[256:]
    top = b[b.abs().argmax()]
    iscale = torch.tensor(-127.0) / top
    assert torch.equal(q[1], torch.round(b * iscale).clamp(max=127).int())
    assert float(d[1]) == float(torch.tensor(1.0) / iscale)
    vals, _ = dot_input_values(x, DotInput.Q8_K)
    assert torch.equal(vals[256:], q[1].float() * d[1])
    assert int(q.max()) <= 127 and int(q.min()) >= -127


def test_float_inputs_and_the_vec_dot_table():
    x = torch.tensor([1.0 + 2 ** -12, 3.0, 1e-9] * 32)
    assert torch.equal(dot_input_values(x, DotInput.F32)[0], x)
    assert torch.equal(dot_input_values(x, DotInput.F16)[0], x.half().float())
    assert torch.equal(dot_input_values(x, DotInput.BF16)[0], x.bfloat16().float())
    assert VEC_DOT[GgmlType.Q4_1] is DotInput.Q8_1 and VEC_DOT[GgmlType.Q5_0] is DotInput.Q8_0
    assert VEC_DOT[GgmlType.MXFP4] is DotInput.Q8_0 and VEC_DOT[GgmlType.Q3_K] is DotInput.Q8_K
    assert set(VEC_DOT) == set(GgmlType)
    with pytest.raises(QuantizationError, match="blocks of 256"):
        dot_input_values(torch.zeros(2, 96), DotInput.Q8_K)
