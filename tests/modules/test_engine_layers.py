"""lowbit.modules.engine_layers: the engine's decoder layers around the model's own modules, as
lowbit.load(numerics=VLLM_CPU) installs them."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import lowbit
from helpers.models import tiny_llama, tiny_qwen3
from helpers.moe_models import tiny_moe
from lowbit.quant import serving_ops as so
from lowbit.modules.engine_layers import EngineDecoderLayer, EngineFinalNorm, use_engine_model_ops
from lowbit.quant.serving import ServingNumerics

VLLM = ServingNumerics.VLLM_CPU
IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def _bf16_llama():
    return tiny_llama(hidden_size=128, intermediate_size=256).to(torch.bfloat16)   # head size 32


def _by_hand(hf, ids):
    """The engine's logits for one sequence ``ids`` [1, n], composed from serving_ops on ``hf``'s own
    modules (4 query heads, 2 KV heads of 32; a layer's q_norm / k_norm, when it has them, on each
    head before RoPE): the residual carried as the float32 sum."""
    def heads(x, n_heads, norm):
        x = x.view(-1, n_heads, 32)
        return x if norm is None else so.rms_norm(x, norm.weight, norm.variance_epsilon)

    base = hf.model
    with torch.no_grad():
        s = base.embed_tokens(ids)[0].float()
        cos, sin = so.rope_cos_sin(torch.arange(ids.shape[1]), 32, hf.config.rope_parameters["rope_theta"])
        for layer in base.layers:
            at, eps = layer.self_attn, layer.input_layernorm.variance_epsilon
            residual = s.to(torch.bfloat16)
            h = so.rms_norm(s, layer.input_layernorm.weight, eps)
            q = so.rope(heads(at.q_proj(h), 4, getattr(at, "q_norm", None)), cos[:, None], sin[:, None])
            k = so.rope(heads(at.k_proj(h), 2, getattr(at, "k_norm", None)), cos[:, None], sin[:, None])
            a = at.o_proj(so.attention(q, k, at.v_proj(h).view(-1, 2, 32), 32 ** -0.5).reshape(ids.shape[1], -1))
            h, residual = so.add_rms_norm(a, residual, layer.post_attention_layernorm.weight, eps)
            s = layer.mlp(h).float() + residual.float()
        return hf.lm_head(so.rms_norm(s, base.norm.weight, base.norm.variance_epsilon))


def test_the_layers_compose_the_engine_ops_on_the_models_own_weights():
    hf = _bf16_llama()
    eng = copy.deepcopy(hf)
    assert use_engine_model_ops(eng, VLLM) is None
    assert all(isinstance(m, EngineDecoderLayer) for m in eng.model.layers)
    assert isinstance(eng.model.norm, EngineFinalNorm)
    assert eng.model.layers[0].mlp is not hf.model.layers[0].mlp and \
        eng.model.layers[0].self_attn.q_proj.weight.data_ptr() != hf.model.layers[0].self_attn.q_proj.weight.data_ptr()
    # by hand, one sequence, from the embeddings
    ids = IDS[:1]
    want = _by_hand(hf, ids)
    with torch.no_grad():
        got = eng(input_ids=ids).logits[0]
    assert torch.equal(got, want)
    # and it is not transformers' bf16 arithmetic, but close to it
    with torch.no_grad():
        ref = hf(input_ids=ids).logits[0]
    assert not torch.equal(got, ref)
    assert ((got.float() - ref.float()).norm() / ref.float().norm()) < 0.05


def test_qwen3_layers_norm_each_heads_q_and_k_before_rope():
    hf = tiny_qwen3().to(torch.bfloat16)
    eng = copy.deepcopy(hf)
    assert use_engine_model_ops(eng, VLLM) is None
    ids = IDS[:1]
    want = _by_hand(hf, ids)
    assert all(hasattr(m.self_attn, "q_norm") for m in hf.model.layers)
    with torch.no_grad():
        got = eng(input_ids=ids).logits[0]
        ref = hf(input_ids=ids).logits[0]
    assert torch.equal(got, want)
    assert ((got.float() - ref.float()).norm() / ref.float().norm()) < 0.05


def test_a_sliding_window_limits_what_each_position_sees():
    # window 6 (keys i-5 .. i), 2 layers: position i depends on tokens i-10 .. i only
    hf = tiny_qwen3(use_sliding_window=True, sliding_window=6, max_window_layers=0,
                    layer_types=["sliding_attention"] * 2).to(torch.bfloat16)
    eng = copy.deepcopy(hf)
    assert use_engine_model_ops(eng, VLLM) is None
    assert [m.self_attn.window for m in eng.model.layers] == [6, 6]
    other = IDS[:1].clone()
    other[0, 0] = (other[0, 0] + 1) % 256
    with torch.no_grad():
        a, b = eng(input_ids=IDS[:1]).logits[0], eng(input_ids=other).logits[0]
        ref = hf(input_ids=IDS[:1]).logits[0]
    assert torch.equal(a[11:], b[11:]) and not torch.equal(a[:11], b[:11])
    assert ((a.float() - ref.float()).norm() / ref.float().norm()) < 0.05
    full = copy.deepcopy(tiny_qwen3().to(torch.bfloat16))     # the same weights without the window
    use_engine_model_ops(full, VLLM)
    with torch.no_grad():
        f = full(input_ids=IDS[:1]).logits[0]
    assert torch.equal(f[:6], a[:6]) and not torch.equal(f[11:], a[11:])


@pytest.mark.parametrize("numerics", [VLLM, ServingNumerics.VLLM_CPU_AVX512])
def test_decoding_with_the_cache_gives_the_full_forwards_logits(numerics):
    eng = _bf16_llama()
    use_engine_model_ops(eng, numerics)
    with torch.no_grad():
        full = eng(input_ids=IDS).logits
        first = eng(input_ids=IDS[:, :20], use_cache=True)
        cache = getattr(first, "cache", None) or first.past_key_values
        step = eng(input_ids=IDS[:, 20:22], cache=cache, use_cache=True).logits
    assert torch.equal(step, full[:, 20:22])
    g = eng.generate(IDS[:, :8], max_new_tokens=4, do_sample=False)
    assert g.shape == (2, 12)


def test_models_it_does_not_reproduce_keep_their_modules_and_say_why(tmp_path):
    small_heads = tiny_llama().to(torch.bfloat16)             # head size 16: vLLM's VEC16 kernel
    assert "head size 16" in use_engine_model_ops(small_heads, VLLM)
    assert not any(isinstance(m, EngineDecoderLayer) for m in small_heads.modules())
    moe = tiny_moe("qwen3_moe")
    assert "qwen3_moe" in use_engine_model_ops(moe, VLLM)
    scaled = tiny_llama(hidden_size=128, intermediate_size=256,
                        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    assert "RoPE 'linear'" in use_engine_model_ops(scaled, VLLM)
    assert use_engine_model_ops(_bf16_llama(), ServingNumerics.LOWBIT) is None
    q = lowbit.quantize(tiny_llama(), "w8a8-int8-dynamic")
    lowbit.save(q, tmp_path / "q", format="compressed-tensors")
    with pytest.warns(UserWarning, match="head size 16.*only the linears reproduce the engine"):
        lowbit.load(tmp_path / "q", numerics=VLLM)


def test_load_with_engine_numerics_installs_the_engine_layers(tmp_path):
    q = lowbit.quantize(tiny_llama(hidden_size=128, intermediate_size=256), "w8a8-fp8-dynamic")
    lowbit.save(q, tmp_path / "q", format="compressed-tensors")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=r"lowbit: numerics .* hosts; this host is")  # this host's kind
        m = lowbit.load(tmp_path / "q", numerics=VLLM)
    assert all(isinstance(x, EngineDecoderLayer) for x in m.model.layers)
    assert not any(isinstance(x, EngineDecoderLayer) for x in lowbit.load(tmp_path / "q").modules())
    with torch.no_grad():
        assert torch.isfinite(m(input_ids=IDS).logits.float()).all()
