"""vLLM-CPU's bf16 arithmetic outside the linears (lowbit.quant.serving_ops): each rounding point
asserted on inputs where the alternatives differ. The attention cases are vLLM-CPU 0.32's own
outputs, measured by calling its kernel (torch.ops._C.cpu_attention_with_kv_cache, VEC ISA) on
these inputs (bench/serve/RESULTS-serve.md)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lowbit.quant import serving_ops as so
from lowbit.quant.serving import bf16_truncate

BF = torch.bfloat16


def _randn(*shape, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(BF)


def test_add_rms_norm_normalizes_the_float32_sum_and_keeps_its_bf16_rounding_as_residual():
    x, r = _randn(64, 96, seed=1), _randn(64, 96, seed=2, scale=37.0)
    w = _randn(96, seed=3)
    out, res = so.add_rms_norm(x, r, w, 1e-5)
    s = x.float() + r.float()
    assert torch.equal(res, s.to(BF))
    h = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.equal(out, h.to(BF) * w)
    # transformers normalizes the bf16-rounded sum: a different result on these inputs
    assert not torch.equal(out, so.rms_norm(res, w, 1e-5))
    assert torch.equal(so.rms_norm(s, w, 1e-5), out)   # the same rule on the float32 sum


def test_rope_is_one_float32_rotation_truncated_to_bf16():
    x = _randn(32, 4, 64, seed=4, scale=3.0)
    cos, sin = so.rope_cos_sin(torch.arange(32), 64, 10000.0)
    c, s = cos[:, None, :], sin[:, None, :]
    y = so.rope(x, c, s)
    xf = x.float()
    rot = torch.cat((-xf[..., 32:], xf[..., :32]), -1)
    f = xf * c.to(BF).float() + rot * s.to(BF).float()
    assert torch.equal(y, bf16_truncate(f))
    assert (y.float().abs() <= f.abs()).all()                      # toward zero
    assert not torch.equal(y, f.to(BF))                            # not to nearest
    half = x[..., :32]
    hf = x * c.to(BF) + torch.cat((-x[..., 32:], half), -1) * s.to(BF)  # transformers' bf16 rounding
    assert not torch.equal(y, hf)


def test_rope_tables_are_float32_angles_position_times_inverse_frequency():
    cos, sin = so.rope_cos_sin(torch.tensor([0, 7, 1000]), 8, 100000.0)
    inv = 1.0 / (100000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    ang = torch.tensor([0.0, 7.0, 1000.0])[:, None] * inv
    assert torch.equal(cos[:, :4], ang.cos()) and torch.equal(cos[:, 4:], ang.cos())
    assert torch.equal(sin[:, 4:], ang.sin()) and cos[0].eq(1).all()


# (key with score 0, keys with score -17.125, vLLM's output for the last query): the 64 keys'
# softmax sum is 1 plus two or three terms of 3.66e-8 (each below half an ulp of 1). Whether they
# meet before they meet the 1 depends on the lane reduction: vLLM sums keys j = l mod 16 per lane,
# then lanes 0-7 and 8-15 each in order, then the two halves. Summing the 16 lanes in order gets
# 6 of these 8 cases wrong, a pairwise tree 2 of them.
VLLM_DOMINATED_ROWS = [
    (27, (18, 8), 1.0), (12, (59, 35, 63), 1.0), (18, (6, 47, 4), 1.0), (55, (39, 40, 59), 0.99609375),
    (53, (28, 31, 42), 0.99609375), (2, (62, 63), 0.99609375), (23, (31, 13), 0.99609375), (49, (54, 41, 5), 1.0),
]


@pytest.mark.parametrize("big,tiny,vllm", VLLM_DOMINATED_ROWS)
def test_attention_sums_like_vllms_avx2_kernel(big, tiny, vllm):
    n = 64
    s = torch.full((n,), -200.0)
    s[big] = 0.0
    s[list(tiny)] = -17.125
    q = torch.zeros(n, 1, 64)
    q[:, 0, 0] = 8.0                        # q.k * 64^-0.5 = the score
    k = torch.zeros(n, 1, 64)
    k[:, 0, 0] = s
    v = torch.zeros(n, 1, 64)
    v[big, 0] = 1.0
    out = so.attention(q.to(BF), k.to(BF), v.to(BF), 64 ** -0.5)
    assert out[-1, 0, 0].item() == vllm


def test_attention_masks_and_cache_agree_with_the_causal_call():
    n, heads, kv, d = 40, 6, 2, 32
    q, k, v = _randn(n, heads, d, seed=5, scale=2.0), _randn(n, kv, d, seed=6, scale=2.0), _randn(n, kv, d, seed=7)
    causal = so.attention(q, k, v, d ** -0.5)
    tril = torch.ones(n, n, dtype=torch.bool).tril()
    assert torch.equal(so.attention(q, k, v, d ** -0.5, mask=tril[None]), causal)
    additive = torch.zeros(n, n).masked_fill(~tril, float("-inf"))
    assert torch.equal(so.attention(q, k, v, d ** -0.5, mask=additive), causal)
    # the last 3 queries against all keys (decoding with a cache) = the last 3 rows
    assert torch.equal(so.attention(q[-3:], k, v, d ** -0.5, mask=tril[-3:][None]), causal[-3:])
    with pytest.raises(ValueError, match="as many queries as keys"):
        so.attention(q[-3:], k, v, d ** -0.5)
    ref = F.scaled_dot_product_attention(q.double().transpose(0, 1), k.double().transpose(0, 1).repeat_interleave(3, 0),
                                         v.double().transpose(0, 1).repeat_interleave(3, 0), is_causal=True)
    ref = ref.transpose(0, 1)
    assert ((causal.double() - ref).abs() <= ref.abs() * 2 ** -7 + 1e-6).all()   # within one bf16 step
    assert (causal.double().abs() <= ref.abs() + 1e-6).all()                      # truncated toward zero


def test_silu_and_mul_rounds_silu_then_the_product():
    x = _randn(16, 2 * 48, seed=8, scale=4.0)
    y = so.silu_and_mul(x)
    assert torch.equal(y, (F.silu(x[:, :48]).float().to(BF).float() * x[:, 48:].float()).to(BF))
    assert not torch.equal(y, (F.silu(x[:, :48].float()) * x[:, 48:].float()).to(BF))


def test_attention_scores_sum_in_order_so_a_row_does_not_depend_on_the_others():
    g = torch.Generator().manual_seed(9)
    q = (torch.randn(9, 40, 64, generator=g) * 2).to(BF).float() * 0.125
    k = (torch.randn(9, 40, 64, generator=g) * 2).to(BF).float()
    s = so.attention_scores(q, k)
    assert torch.equal(so.attention_scores(q[:, -1:], k), s[:, -1:])   # one decoded query = its prompt row
    seq = torch.zeros(9, 40, 40)
    for j in range(64):
        seq = seq + q[:, :, j, None] * k[:, None, :, j]
    assert torch.equal(s, seq)
    # (why not a matmul: on some hosts a blocked matmul's rows depend on how many come together,
    # e.g. the AMD EPYC hosts of 2026-12; not asserted: it is the host's BLAS, not lowbit)
