"""Tiny seeded mixture-of-experts models of the families lowbit supports (never downloaded):
Qwen3-MoE, Qwen2-MoE (shared expert), DeepSeek-V3 (MLA, shared experts, a first dense layer),
Mixtral (legacy checkpoint names) and gpt-oss (transposed, interleaved experts with biases).
Hidden 128, 2 layers, 8 experts, top-2; every input width is a multiple of 128, so that every
scheme's groups fit (compressed-tensors needs whole groups)."""

from __future__ import annotations

import torch

COMMON = dict(vocab_size=256, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, tie_word_embeddings=False)


def _configs():
    from transformers import DeepseekV3Config, GptOssConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    return {
        "qwen3_moe": (Qwen3MoeConfig, dict(intermediate_size=256, moe_intermediate_size=128, num_experts=8,
                                           num_experts_per_tok=2, head_dim=32, norm_topk_prob=True)),
        "qwen2_moe": (Qwen2MoeConfig, dict(intermediate_size=256, moe_intermediate_size=128, num_experts=8,
                                           num_experts_per_tok=2, shared_expert_intermediate_size=128)),
        "deepseek_v3": (DeepseekV3Config, dict(intermediate_size=256, moe_intermediate_size=128, n_routed_experts=8,
                                               num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                               n_group=2, topk_group=1, q_lora_rank=128, kv_lora_rank=128,
                                               qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                                               num_key_value_heads=4)),
        "mixtral": (MixtralConfig, dict(intermediate_size=128, num_local_experts=8, num_experts_per_tok=2)),
        "gpt_oss": (GptOssConfig, dict(intermediate_size=128, num_local_experts=8, num_experts_per_tok=2,
                                       head_dim=32, sliding_window=64, layer_types=["sliding_attention",
                                                                                    "full_attention"])),
    }


MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "deepseek_v3", "mixtral", "gpt_oss")


def tiny_moe(family: str, seed: int = 0):
    """A random 2-layer MoE model of ``family`` (float32, eval mode, fixed seed)."""
    from transformers import AutoModelForCausalLM

    cls, extra = _configs()[family]
    cfg = cls(**{**COMMON, **extra})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # routers start at zero in some families: give them a spread
        for n, p in model.named_parameters():
            if n.endswith((".gate.weight", ".router.weight")):
                p.normal_(0.0, 0.5)
    return model
