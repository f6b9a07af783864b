"""llama-quantize's mixes (lowbit.formats.gguf.mixes): the type of each tensor, by llama.cpp's rules.

The expected types are llama-quantize's (llama.cpp vendored by llama-cpp-python 0.3.36) on a
model of SmolLM2-135M's shapes: 30 layers, hidden 576 (not a multiple of 256: the k-quants fall
back), intermediate 1536, 9 query and 3 KV heads, tied embeddings; bench/gguf/check_mixes.py
compares the whole table with llama-quantize's own choice on the real model."""

from __future__ import annotations

import pytest

from lowbit.errors import FormatError
from lowbit.formats.gguf.mixes import F16, Mix, ModelFacts, Role, choose_types, fallback, quantizable, role_of
from lowbit.numerics.ggml import GgmlType as T

FACTS = ModelFacts(n_layer=30, n_head=9, n_head_kv=3)


def smollm2_tensors(tied: bool = True, hidden: int = 576, inter: int = 1536):
    out = [("token_embd.weight", (49152, hidden)), ("output_norm.weight", (hidden,))]
    if not tied:
        out.append(("output.weight", (49152, hidden)))
    for i in range(30):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (hidden,)), (b + "attn_q.weight", (hidden, hidden)),
                (b + "attn_k.weight", (192, hidden)), (b + "attn_v.weight", (192, hidden)),
                (b + "attn_output.weight", (hidden, hidden)), (b + "ffn_norm.weight", (hidden,)),
                (b + "ffn_gate.weight", (inter, hidden)), (b + "ffn_up.weight", (inter, hidden)),
                (b + "ffn_down.weight", (hidden, inter))]
    return out


def _more_bits(i, n=30):
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def test_roles_and_what_is_never_quantized():
    assert role_of("blk.3.ffn_down_exps.weight") is Role.FFN_DOWN
    assert role_of("blk.3.ffn_up_shexp.weight") is Role.FFN_UP
    assert role_of("blk.0.attn_v.weight") is Role.ATTN_V and role_of("blk.0.attn_v.bias") is Role.OTHER
    assert role_of("output.weight") is Role.OUTPUT and role_of("token_embd.weight") is Role.TOKEN_EMBD
    assert not quantizable("blk.0.attn_norm.weight", (576,))
    assert not quantizable("blk.0.ffn_gate_inp.weight", (8, 576))       # a router
    assert not quantizable("blk.0.ssm_conv1d.weight", (64, 4))
    assert not quantizable("blk.0.attn_q.bias", (576, 576))
    assert not quantizable("blk.0.x.weight", (1, 576))                  # one axis for GGML: ne = [576, 1]
    assert quantizable("blk.0.ffn_down_exps.weight", (8, 576, 1536))


def test_fallbacks_follow_llama_quantize():
    assert fallback(T.Q4_K, 576) is T.Q5_0 and fallback(T.Q5_K, 576) is T.Q5_1
    assert fallback(T.Q6_K, 576) is T.Q8_0 and fallback(T.Q2_K, 576) is T.Q4_0 and fallback(T.Q3_K, 576) is T.Q4_0
    assert fallback(T.Q4_K, 1536) is T.Q4_K
    assert fallback(T.Q4_K, 48) == F16 and fallback(T.Q8_0, 48) == F16


def test_q4_k_m_on_smollm2_shapes():
    t = choose_types(Mix.Q4_K_M, smollm2_tensors(), FACTS)
    assert t["token_embd.weight"] is T.Q8_0        # tied: the output rule, 576 columns: Q8_0
    assert t["output_norm.weight"] is None and t["blk.4.attn_norm.weight"] is None
    for i in range(30):
        b = f"blk.{i}."
        assert t[b + "attn_v.weight"] is (T.Q8_0 if _more_bits(i) else T.Q5_0), i   # Q6_K / Q4_K, fallen back
        assert t[b + "ffn_down.weight"] is (T.Q6_K if _more_bits(i) else T.Q4_K), i  # 1536 columns: no fallback
        for p in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert t[b + p + ".weight"] is T.Q5_0


def test_q3_k_m_and_q2_k_promotions_on_multiples_of_256():
    shapes = smollm2_tensors(tied=False, hidden=512, inter=1536)
    t = choose_types(Mix.Q3_K_M, shapes, FACTS)
    assert t["output.weight"] is T.Q6_K and t["token_embd.weight"] is T.Q3_K
    assert [t[f"blk.{i}.attn_v.weight"] for i in range(3)] == [T.Q5_K, T.Q5_K, T.Q4_K]
    assert t["blk.0.ffn_down.weight"] is T.Q5_K and t["blk.2.ffn_down.weight"] is T.Q4_K    # i < 30 / 16
    assert t["blk.5.attn_output.weight"] is T.Q4_K and t["blk.5.attn_q.weight"] is T.Q3_K
    t2 = choose_types(Mix.Q2_K, shapes, FACTS)
    assert t2["blk.7.attn_v.weight"] is T.Q3_K        # n_gqa 3 < 4
    assert t2["blk.7.ffn_down.weight"] is T.Q3_K and t2["blk.7.attn_output.weight"] is T.Q3_K
    assert t2["blk.7.ffn_up.weight"] is T.Q2_K
    gqa = choose_types(Mix.Q2_K, shapes, ModelFacts(n_layer=30, n_head=32, n_head_kv=8))
    assert gqa["blk.7.attn_v.weight"] is T.Q4_K


def test_q4_k_s_q5_k_m_and_imatrix_rules():
    shapes = smollm2_tensors(tied=False, hidden=512)
    s = choose_types(Mix.Q4_K_S, shapes, FACTS)
    assert [s[f"blk.{i}.attn_v.weight"] for i in (0, 3, 4)] == [T.Q5_K, T.Q5_K, T.Q4_K]
    assert s["blk.2.ffn_down.weight"] is T.Q5_K and s["blk.3.ffn_down.weight"] is T.Q4_K
    m = choose_types(Mix.Q5_K_M, shapes, FACTS)
    assert m["blk.0.attn_v.weight"] is T.Q6_K and m["blk.4.ffn_down.weight"] is T.Q5_K
    q40 = choose_types(Mix.Q4_0, shapes, ModelFacts(30, 9, 3, has_importance=True))
    assert q40["blk.0.ffn_down.weight"] is T.Q4_1 and q40["blk.4.ffn_down.weight"] is T.Q4_0
    assert choose_types(Mix.Q4_0, shapes, FACTS)["blk.0.ffn_down.weight"] is T.Q4_0


def test_eight_experts_and_mxfp4_moe():
    shapes = [("token_embd.weight", (1000, 512)), ("output.weight", (1000, 512)),
              ("blk.0.attn_k.weight", (128, 512)), ("blk.0.attn_v.weight", (128, 512)),
              ("blk.0.attn_output.weight", (512, 512)), ("blk.0.ffn_gate_inp.weight", (8, 512)),
              ("blk.0.ffn_down_exps.weight", (8, 512, 1024)), ("blk.1.ffn_down_exps.weight", (8, 512, 1024))]
    facts = ModelFacts(n_layer=2, n_head=4, n_head_kv=1, n_expert=8)
    t = choose_types(Mix.Q4_K_M, shapes, facts)
    assert t["blk.0.attn_k.weight"] is T.Q8_0 and t["blk.0.attn_v.weight"] is T.Q8_0
    assert t["blk.0.attn_output.weight"] is T.Q5_K and t["blk.0.ffn_gate_inp.weight"] is None
    # the layer from the name (MoE): more bits for i >= 7 n / 8 only, with 2 layers
    assert t["blk.0.ffn_down_exps.weight"] is T.Q4_K and t["blk.1.ffn_down_exps.weight"] is T.Q6_K
    mx = choose_types(Mix.MXFP4_MOE, shapes, facts)
    assert mx["blk.0.ffn_down_exps.weight"] is T.MXFP4 and mx["blk.0.attn_k.weight"] is T.Q8_0
    assert mx["output.weight"] is T.Q8_0


def test_unknown_mix_is_one_error():
    with pytest.raises(FormatError, match="unknown GGUF mix 'Q4_K_X'.*Q4_K_M"):
        choose_types("Q4_K_X", [], FACTS)
