"""Calibrate the FP8 KV-cache scales of a model: one full-model pass over the calibration tokens.

The pass runs after the weights are quantized (``lowbit.quantize``), so K and V are the ones the
quantized model computes, as vLLM's cache holds them. It is a separate pass rather than a part of
the layer-by-layer weight calibration (lowbit.calibration.pipeline) on purpose: the scales then
depend only on the finished model and the tokens, whatever the weight calibration's layer
inputs, and the pass is simply a forward of the model.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from lowbit.errors import OptionRef, QuantizationError
from lowbit.kvcache import check_kv_cache
from lowbit.kvcache.spec import KV_SPEC
from lowbit.kvcache.attention import attach, attention_modules, disable, enable, start_observing, stop_observing
from lowbit.quant import static_scale_from_amax


def check_kv_model(model: nn.Module, kv_cache: str) -> dict[str, nn.Module]:
    """The model's attention modules (``attention_modules``), or a QuantizationError naming the
    option when it has none (e.g. DeepSeek's MLA attention caches a compressed latent, not K and V)."""
    check_kv_cache(kv_cache)
    modules = attention_modules(model)
    if not modules:
        raise QuantizationError(f"{{kv}} needs attention modules with k_proj/v_proj and a layer_idx; "
                                f"{type(model).__name__} has none", kv=OptionRef("kv_cache", kv_cache))
    return modules


@torch.no_grad()
def calibrate_kv_cache(model: nn.Module, tokens: torch.Tensor, kv_cache: str = "fp8", batch_size: int = 4) -> dict:
    """Observe amax(|K|) and amax(|V|) of every attention module (``attention_modules``) over
    ``tokens`` [n, seq_len] (no padding: every position counts), set ``k_scale = amax(K) / 448``
    and ``v_scale = amax(V) / 448`` (``static_scale_from_amax`` under ``KV_SPEC``; an all-zero
    tensor gets scale 1/448) and enable KV QDQ on the model (``attention.attach``). Returns the
    report {name: {"k_amax", "v_amax", "k_scale", "v_scale"}} (floats), also left on
    ``model.lowbit_kv_calibration``. On failure the model is left as it was (no wrapper, no
    observers)."""
    modules = check_kv_model(model, kv_cache)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    enable(model)
    start_observing(modules)
    try:
        for i in range(0, tokens.shape[0], max(1, batch_size)):
            model(input_ids=tokens[i:i + batch_size].to(device), use_cache=False)
        seen = stop_observing(modules)
    except BaseException:
        stop_observing(modules)
        disable(model)
        raise
    finally:
        model.train(was_training)
    scales = {n: (static_scale_from_amax(k, KV_SPEC), static_scale_from_amax(v, KV_SPEC)) for n, (k, v) in seen.items()}
    attach(model, scales, kv_cache)
    report = {n: {"k_amax": float(seen[n][0]), "v_amax": float(seen[n][1]), "k_scale": float(k), "v_scale": float(v)}
              for n, (k, v) in scales.items()}
    model.lowbit_kv_calibration = report
    return report
