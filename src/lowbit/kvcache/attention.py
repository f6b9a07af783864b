"""The attention wrapper that observes or quantizes K and V, and the KV scales on a model.

transformers 5 calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key,
value, attention_mask, **kwargs)`` with the post-RoPE key and value states (after the cache
update). ``enable(model)`` registers ``"lowbit_kv_<base>"`` (idempotently, with the attention mask
function of ``<base>``) for the implementation the model had (sdpa, eager...) and sets it on the
model's config; the wrapper then, per attention module:

- observing (``observe(model)``, calibration): records amax(|K|) and amax(|V|) and leaves them as
  they are;
- with scales (``k_scale``/``v_scale`` buffers, ``attach``): replaces K and V by their E4M3 QDQ
  ``fake_quantize(x, KV_SPEC, scale=...)`` cast back to their dtype, then calls the base;
- otherwise: calls the base unchanged.

``disable(model)`` restores the base implementation. The scales are non-persistent buffers: not
in ``state_dict``; ``lowbit.save`` writes them per format (``lowbit.formats.kv_layout``).
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn

from lowbit.kvcache.spec import KV_SPEC
from lowbit.quant import fake_quantize

PREFIX = "lowbit_kv_"
_OBSERVED = "_lowbit_kv_amax"  # [amax K, amax V] float32 tensors while observing


def attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The attention modules whose K and V a KV cache holds: modules with an int ``layer_idx``
    and ``k_proj``/``v_proj`` children (``model.layers.{i}.self_attn``), by name."""
    return {n: m for n, m in model.named_modules()
            if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "k_proj") and hasattr(m, "v_proj")}


def _base_function(base: str, module: nn.Module):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if base == "eager":  # every model family defines its own eager attention in its modeling file
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise RuntimeError(f"{type(module).__name__}: no eager_attention_forward in {type(module).__module__}")
        return fn
    return ALL_ATTENTION_FUNCTIONS[base]


def qdq_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 quantize-dequantize of key or value states under a static per-tensor scale, in x's dtype."""
    return fake_quantize(x, KV_SPEC, scale=scale.to(device=x.device, dtype=torch.float32)).to(x.dtype)


def _wrapper(base: str):
    def lowbit_kv_attention(module, query, key, value, attention_mask, **kwargs):
        seen = getattr(module, _OBSERVED, None)
        if seen is not None:
            seen[0] = torch.maximum(seen[0], key.detach().abs().amax().float().cpu())
            seen[1] = torch.maximum(seen[1], value.detach().abs().amax().float().cpu())
        elif getattr(module, "k_scale", None) is not None:
            key, value = qdq_kv(key, module.k_scale), qdq_kv(value, module.v_scale)
        return _base_function(base, module)(module, query, key, value, attention_mask, **kwargs)

    return lowbit_kv_attention


def register(base: str) -> str:
    """Register the wrapper of attention implementation ``base`` (and its mask function) with
    transformers' AttentionInterface under ``"lowbit_kv_<base>"``, once; returns that name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = PREFIX + base
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _wrapper(base))
    if name not in ALL_MASK_ATTENTION_FUNCTIONS and base in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name


def enable(model: nn.Module) -> None:
    """Run ``model``'s attention through the lowbit wrapper of its current implementation."""
    cfg = model.config
    base = cfg._attn_implementation or "eager"
    if not base.startswith(PREFIX):
        cfg._attn_implementation = register(base)


def disable(model: nn.Module) -> None:
    """Restore the attention implementation ``enable`` wrapped."""
    cfg = model.config
    impl = cfg._attn_implementation or ""
    if impl.startswith(PREFIX):
        cfg._attn_implementation = impl[len(PREFIX):]


def start_observing(modules: dict[str, nn.Module]) -> None:
    for m in modules.values():
        setattr(m, _OBSERVED, [torch.zeros((), dtype=torch.float32), torch.zeros((), dtype=torch.float32)])


def stop_observing(modules: dict[str, nn.Module]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The amax of K and V each module saw (float32 scalars), observation removed."""
    out = {}
    for n, m in modules.items():
        seen = getattr(m, _OBSERVED, None)
        if seen is not None:
            out[n] = (seen[0], seen[1])
            delattr(m, _OBSERVED)
    return out


def attach(model: nn.Module, scales: dict[str, tuple[torch.Tensor, torch.Tensor]], kv_cache: str) -> None:
    """Give each named attention module its ``k_scale``/``v_scale`` (float32 [1] non-persistent
    buffers, on the module's device), record ``model.lowbit_kv_cache = kv_cache`` and enable the
    wrapper: from now on the model's forward QDQs K and V. (Buffers follow ``model.to(...)``: a
    later ``model.to(torch.bfloat16)`` rounds them; ``qdq_kv`` then uses the rounded values.)"""
    for name, (k, v) in scales.items():
        m = model.get_submodule(name)
        dev = next((p.device for p in m.parameters()), torch.device("cpu"))
        m.register_buffer("k_scale", k.detach().to(device=dev, dtype=torch.float32).reshape(1).clone(), persistent=False)
        m.register_buffer("v_scale", v.detach().to(device=dev, dtype=torch.float32).reshape(1).clone(), persistent=False)
    model.lowbit_kv_cache = kv_cache
    enable(model)


def kv_scales(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{attention module name: (k_scale, v_scale)} of a model with a KV cache scheme (else {})."""
    if getattr(model, "lowbit_kv_cache", None) is None:
        return {}
    return {n: (m.k_scale, m.v_scale) for n, m in attention_modules(model).items()
            if getattr(m, "k_scale", None) is not None}
