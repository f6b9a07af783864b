"""Attention as llama.cpp's CPU backend computes it with its default F16 KV cache.

llama.cpp stores every key (after RoPE) and value in an F16 cache (``--cache-type-k/-v f16``) and,
with flash attention (its default on the CPU), computes the scores and the weighted sum from the
cached values widened back to float32 (``ggml-cpu/ops.cpp``, ``flash_attn_ext``: the tiled path
a prompt of 32 or more tokens takes keeps Q in float32 and accumulates in float32). So the one
rounding it adds to float32 attention is K and V to fp16 (round to nearest even).

``use_llama_cpp_attention(model)`` makes a transformers model attend this way through
transformers' own attention registry (``AttentionInterface``, the public hook for an attention
function; nothing of transformers is replaced): the function rounds key and value to fp16 and
hands them to transformers' sdpa attention in float32.
"""

from __future__ import annotations

import torch
import torch.nn as nn

ATTENTION_NAME = "lowbit_llama_cpp_f16_kv"


def f16_kv_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs):
    """transformers' sdpa attention on K and V rounded to fp16 and widened back (llama.cpp's F16 KV cache)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def f16(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float16).to(t.dtype)

    return sdpa_attention_forward(module, query, f16(key), f16(value), attention_mask, **kwargs)


def use_llama_cpp_attention(model: nn.Module) -> None:
    """Register ``f16_kv_attention`` with transformers (once) and make ``model`` use it."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, f16_kv_attention)
    model.set_attn_implementation(ATTENTION_NAME)
