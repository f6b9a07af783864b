"""GPTQ onto GGML's FP4 value tables (``lowbit.algorithms.gptq_table``) and the FP4 code accessors
(``lowbit.numerics.ggml_fp4``): the encoders' codes when no error is spread, the stored scales
kept, a smaller Hessian-weighted error than the encoders' own codes when inputs correlate."""

from __future__ import annotations

import pytest
import torch

from lowbit.algorithms.gptq import GPTQOptions
from lowbit.algorithms.gptq_table import gptq_on_table
from lowbit.errors import QuantizationError
from lowbit.numerics.ggml import GgmlType, decode, encode
from lowbit.numerics.ggml_fp4 import DOUBLED_E2M1, FP4_GROUP, fp4_codes, fp4_scales, with_fp4_codes

TABLE = torch.tensor(DOUBLED_E2M1, dtype=torch.float32)
FP4 = [GgmlType.MXFP4, GgmlType.NVFP4]


def _weight(rows=24, cols=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 1, rows)[:, None]
    W[0, :64] = 0.0                                   # a zero block: scale 0, code 0
    W[1, 5] = 6.0 * 2 ** 3                            # a block whose max is on the grid
    W[2, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)  # ties between table values
    return W


@pytest.mark.parametrize("kind", FP4)
def test_codes_and_scales_are_what_decode_reads(kind):
    data = encode(_weight(), kind)
    codes, d = fp4_codes(data, kind), fp4_scales(data, kind)
    vals = (d.repeat_interleave(FP4_GROUP[kind], dim=1) * TABLE[codes])
    assert torch.equal(vals, decode(data, kind))
    assert torch.equal(with_fp4_codes(data, kind, codes), data)
    flipped = with_fp4_codes(data, kind, codes ^ 8)   # every sign flipped, scales kept
    assert torch.equal(fp4_scales(flipped, kind), d) and torch.equal(fp4_codes(flipped, kind), codes ^ 8)
    with pytest.raises(ValueError, match="0, 15"):
        with_fp4_codes(data, kind, codes + 16)


@pytest.mark.parametrize("kind", FP4)
def test_a_diagonal_hessian_gives_the_encoders_codes(kind):
    W = _weight()
    data = encode(W, kind)
    H = torch.diag(torch.rand(W.shape[1], generator=torch.Generator().manual_seed(1)) + 0.5).double()
    codes = gptq_on_table(W, H, fp4_scales(data, kind), FP4_GROUP[kind], TABLE)
    assert torch.equal(codes, fp4_codes(data, kind))


@pytest.mark.parametrize("kind", FP4)
def test_correlated_inputs_lower_the_output_error_under_the_same_scales(kind):
    g = torch.Generator().manual_seed(2)
    W = torch.randn(64, 256, generator=g)
    X = torch.randn(2048, 256, generator=g) @ (torch.eye(256) + torch.randn(256, 256, generator=g) / 8)
    H = (X.T @ X).double()
    data = encode(W, kind)
    d = fp4_scales(data, kind)
    codes = gptq_on_table(W, H, d, FP4_GROUP[kind], TABLE, GPTQOptions(block_size=32))
    ours = with_fp4_codes(data, kind, codes)
    assert torch.equal(fp4_scales(ours, kind), d)

    def err(q):
        e = (W - decode(q, kind)).double()
        return float(torch.einsum("ri,ij,rj->", e, H, e))

    assert err(ours) < 0.8 * err(data)


def test_scales_that_do_not_fit_are_an_error():
    with pytest.raises(QuantizationError, match="'w'"):
        gptq_on_table(torch.ones(4, 64), torch.eye(64).double(), torch.ones(4, 3), 32, TABLE, name="w")


def test_the_callers_weight_is_left_as_given():
    W = torch.randn(1, 64, generator=torch.Generator().manual_seed(3))  # one row: W.t() is contiguous already
    before = W.clone()
    data = encode(W, GgmlType.MXFP4)
    H = torch.ones(64, 64, dtype=torch.float64) + torch.eye(64, dtype=torch.float64)
    gptq_on_table(W, H, fp4_scales(data, GgmlType.MXFP4), 32, TABLE)
    assert torch.equal(W, before)
