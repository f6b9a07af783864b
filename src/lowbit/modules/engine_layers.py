"""Decoder-layer modules that run a transformers Llama-family model with vLLM-CPU's bf16 arithmetic
outside the linears (``lowbit.quant.serving_ops``), for ``lowbit.load(..., numerics=VLLM_CPU)``.

``use_engine_model_ops(model, numerics)`` replaces, in place, each decoder layer by an
``EngineDecoderLayer`` holding the same submodules (norm weights, projections, MLP: nothing is
copied) and the final norm by an ``EngineFinalNorm``. What changes is where the arithmetic
rounds, as vLLM-CPU does:

- the residual stream between layers is carried as the float32 sum of two bf16 tensors (the layer
  output and the residual); the next norm reads that sum unrounded and the new residual is its
  bf16 rounding (vLLM's fused add + RMSNorm);
- RoPE (the default rotation, its tables computed from the positions as vLLM does) and attention
  run in float32 and are truncated to bf16 (vLLM's CPU kernels);
- the MLP and the linears are the model's own modules (the linears' emulation is the backend's).

Covered: the model types in ``ENGINE_MODEL_TYPES`` (decoder layers of transformers' Llama layout:
input_layernorm, self_attn with q/k/v/o_proj, post_attention_layernorm, mlp; Qwen3's per-head
q_norm / k_norm before RoPE, as vLLM's Qwen3Attention applies its RMSNorm to q and k viewed per
head: bit for bit with vLLM on a tiny Qwen3 folder, bench/serve/RESULTS-serve.md) with head
sizes that are multiples of 32 (vLLM-CPU's VEC attention kernel; it takes VEC16 for other
multiples of 16). A sliding window (Mistral's ``config.sliding_window``, a Qwen layer's
``self_attn.sliding_window``) is honoured in the mask; bit equality with vLLM was measured on
sequences inside the window. Another model, one with a quantized KV cache or another head size
keeps transformers' bf16 modules: the function returns the reason, and ``lowbit.load`` warns
with it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from lowbit.quant import serving_ops as so
from lowbit.quant.serving import CpuIsa, ServingNumerics

#: transformers model types whose decoder layers these modules reproduce
ENGINE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class EngineAttention(nn.Module):
    """Self-attention with vLLM-CPU's RoPE and attention arithmetic around the model's own q/k/v/o
    projections. RoPE's tables come from the positions and ``rope_theta`` by vLLM's rule
    (``serving_ops.rope_cos_sin``), not from transformers' rotary module (whose inverse
    frequencies a ``model.to(bfloat16)`` rounds). Takes transformers' attention keywords
    (position_ids, attention_mask, cache); a 4-D boolean or additive mask is honoured, none means
    causal."""

    def __init__(self, inner: nn.Module, rope_theta: float, window: int | None = None,
                 isa: CpuIsa = CpuIsa.AVX2) -> None:
        super().__init__()
        self.window = window                                # keys j > i - window seen by query i (None: all)
        self.isa = isa                                      # the host kind whose RoPE and attention these are
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = inner.q_proj, inner.k_proj, inner.v_proj, inner.o_proj
        self.head_dim, self.scaling, self.layer_idx = inner.head_dim, inner.scaling, inner.layer_idx
        self.rope_theta = float(rope_theta)
        # Qwen3: RMSNorm of each head's q and k before RoPE (None on the Llama layout)
        self.q_norm, self.k_norm = getattr(inner, "q_norm", None), getattr(inner, "k_norm", None)

    def _head_norm(self, x: torch.Tensor, norm: nn.Module | None) -> torch.Tensor:
        return x if norm is None else so.rms_norm(x, norm.weight, _eps(norm))

    def forward(self, hidden_states, position_ids=None, attention_mask=None, cache=None, **kwargs):
        b, n, _ = hidden_states.shape
        q = self._head_norm(self.q_proj(hidden_states).view(b, n, -1, self.head_dim), self.q_norm)
        k = self._head_norm(self.k_proj(hidden_states).view(b, n, -1, self.head_dim), self.k_norm)
        v = self.v_proj(hidden_states).view(b, n, -1, self.head_dim)
        pos = position_ids if position_ids is not None else torch.arange(n)[None]
        tables = [so.rope_cos_sin(pos[min(i, pos.shape[0] - 1)], self.head_dim, self.rope_theta) for i in range(b)]
        q, k = _rope(q, tables, self.isa), _rope(k, tables, self.isa)
        if cache is not None:
            kt, vt = cache.update(k.transpose(1, 2), v.transpose(1, 2), self.layer_idx, kwargs=kwargs)
            k, v = kt.transpose(1, 2), vt.transpose(1, 2)
        mask = None
        if attention_mask is not None and attention_mask.dim() == 4:
            mask = attention_mask
        elif k.shape[1] != n or (self.window is not None and k.shape[1] > self.window):
            offset = k.shape[1] - n                        # decoding against a cache: query i is position offset + i
            i, j = torch.arange(n)[:, None] + offset, torch.arange(k.shape[1])[None, :]
            seen = j <= i
            if self.window is not None:
                seen = seen & (j > i - self.window)
            mask = seen[None, None]
        outs = [so.attention(q[i], k[i], v[i], self.scaling, mask=None if mask is None else mask[min(i, mask.shape[0] - 1)],
                             isa=self.isa) for i in range(b)]
        return self.o_proj(torch.stack(outs).reshape(b, n, -1)), None



def _rope(x: torch.Tensor, tables: list[tuple[torch.Tensor, torch.Tensor]], isa: CpuIsa) -> torch.Tensor:
    """x [b, n, heads, d] rotated per sequence with its (cos, sin) tables [n, d]."""
    return torch.stack([so.rope(x[i], cos[:, None, :], sin[:, None, :], isa) for i, (cos, sin) in enumerate(tables)])


class EngineDecoderLayer(nn.Module):
    """A decoder layer whose input and output are the float32 residual sum (see the module doc)."""

    def __init__(self, inner: nn.Module, rope_theta: float, window: int | None = None,
                 isa: CpuIsa = CpuIsa.AVX2) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = inner.input_layernorm, inner.post_attention_layernorm
        self.self_attn, self.mlp = EngineAttention(inner.self_attn, rope_theta, window, isa), inner.mlp
        self.eps, self.post_eps = _eps(inner.input_layernorm), _eps(inner.post_attention_layernorm)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, **kwargs):
        kwargs.pop("position_embeddings", None)
        kwargs.pop("use_cache", None)
        s = hidden_states.float()                          # the embeddings (bf16) or the last layer's float32 sum
        residual = s.to(so.BF16)
        h = so.rms_norm(s, self.input_layernorm.weight, self.eps)
        a, _ = self.self_attn(h, position_ids=position_ids, attention_mask=attention_mask, cache=cache, **kwargs)
        h, residual = so.add_rms_norm(a, residual, self.post_attention_layernorm.weight, self.post_eps)
        m = self.mlp(h)
        return m.float() + residual.float()


class EngineFinalNorm(nn.Module):
    """The model's last norm on the float32 residual sum: bf16 output."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.weight, self.eps = inner.weight, _eps(inner)

    def forward(self, hidden_states):
        return so.rms_norm(hidden_states.float(), self.weight, self.eps)


def _eps(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def use_engine_model_ops(model: nn.Module, numerics: ServingNumerics) -> str | None:
    """Replace ``model``'s decoder layers and final norm by the engine's (see the module doc).
    Returns None when done, else why the model keeps transformers' bf16 modules outside the
    linears (``lowbit.load`` warns with it). LOWBIT numerics: nothing to do (None)."""
    if numerics is ServingNumerics.LOWBIT:
        return None
    mt = getattr(getattr(model, "config", None), "model_type", None)
    if mt not in ENGINE_MODEL_TYPES:
        return f"model type {mt!r} (covered: {', '.join(ENGINE_MODEL_TYPES)})"
    if getattr(model, "lowbit_kv_cache", None) is not None:
        return f"a quantized KV cache ({model.lowbit_kv_cache})"
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None or not hasattr(base, "norm"):
        return f"model type {mt!r} without model.layers / model.norm"
    rope = dict(getattr(model.config, "rope_parameters", None) or {})
    theta = rope.get("rope_theta", getattr(model.config, "rope_theta", None))
    if rope.get("rope_type", "default") != "default" or theta is None:
        return f"RoPE {rope.get('rope_type')!r} (reproduced: the default rotation with rope_theta)"
    hd = layers[0].self_attn.head_dim if len(layers) else 0
    if hd % 32:  # vLLM-CPU runs its VEC16 attention kernel then, whose sums are not reproduced here
        return f"head size {hd} (vLLM-CPU's VEC attention kernel, the one reproduced, needs a multiple of 32)"
    for i, layer in enumerate(layers):
        if isinstance(layer, EngineDecoderLayer):
            continue
        window = getattr(layer.self_attn, "sliding_window", None)
        if mt == "mistral":                                # Mistral's window is the config's, for every layer
            window = getattr(model.config, "sliding_window", None)
        layers[i] = EngineDecoderLayer(layer, theta, window, numerics.isa)
    if not isinstance(base.norm, EngineFinalNorm):
        base.norm = EngineFinalNorm(base.norm)
    return None
