"""Every decoder-only causal-LM family the installed transformers registers, built tiny.

Which types: ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` less (1) encoder-only families whose causal
head is a decoder mode of an encoder (they are also in ``MODEL_FOR_MASKED_LM_MAPPING_NAMES``),
(2) encoder-decoder configs (``is_encoder_decoder``: BART, Whisper, ...) and (3) composite
configs (``sub_configs``: vision / audio wrappers such as ``gemma3`` or ``llama4``, whose text
model is registered as a type of its own, ``gemma3_text``, ``llama4_text``).

How tiny: every size the config's constructor takes among ``SIZES`` (hidden 128, 2 layers, 4
heads of 32, 2 KV heads, 4 experts of which 2 per token, vocabulary 256), so that group 128
divides the input width of every attention and MLP linear. Random weights, seed 0.
"""

from __future__ import annotations

import inspect
import warnings

import torch

SIZES = {
    "vocab_size": 256, "hidden_size": 128, "n_embd": 128, "d_model": 128, "num_hidden_layers": 2, "n_layer": 2,
    "n_layers": 2, "num_layers": 2, "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256, "ffn_hidden_size": 256, "n_inner": 256,
    "moe_intermediate_size": 128, "expert_intermediate_size": 128, "shared_expert_intermediate_size": 128,
    "moe_shared_expert_intermediate_size": 128,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "top_k_experts": 2, "moe_k": 2, "moe_topk": 2,
    "max_position_embeddings": 128, "n_positions": 128, "seq_length": 128, "sliding_window": 16,
    "first_k_dense_replace": 1, "first_dense_intermediate_size": 256, "global_head_dim": 64, "num_kv_shared_layers": 0,
    "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 256,
    "kv_lora_rank": 32, "q_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
    "mamba_n_heads": 8, "mamba_d_head": 32, "mamba_head_dim": 32, "mamba_d_state": 16, "ssm_state_size": 16,
    "mamba_n_groups": 1, "n_groups": 1, "mamba_expand": 2, "mamba_chunk_size": 16, "chunk_size": 16,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}


def decoder_only_types() -> list[str]:
    """The decoder-only causal-LM model types of the installed transformers (module docstring)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    out = []
    for t in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        if t in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
            continue
        try:
            cfg = AutoConfig.for_model(t)
        except Exception:  # noqa: BLE001 - a type whose config cannot be built is listed by the sweep
            out.append(t)
            continue
        if getattr(cfg, "is_encoder_decoder", False) or getattr(type(cfg), "sub_configs", None):
            continue
        out.append(t)
    return out


def tiny_config(model_type: str, **overrides):
    """The family's config at ``SIZES`` (the sizes its constructor takes), then ``overrides``."""
    from transformers import AutoConfig

    cls = type(AutoConfig.for_model(model_type))
    params = inspect.signature(cls.__init__).parameters
    kw = {k: v for k, v in SIZES.items() if k in params}
    if "kv_lora_rank" in params:  # multi-head latent attention: one KV head per query head
        kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)
    if "rotary_dim" in params:  # partial rotary: within the head
        kw["rotary_dim"] = 16
    return cls(**{**kw, **overrides})


def tiny_model(model_type: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """The family's causal LM from ``tiny_config`` (with ``overrides``), float32, eval mode, seed ``seed``; built with
    warnings silenced (transformers' remarks on the tiny sizes are not what the tests check)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=torch.float32).eval()
