"""A calibrated FP8 (E4M3) KV cache, as compressed-tensors and vLLM define it.

    lowbit.quantize(model, scheme, calibration=..., kv_cache="fp8")

Every attention module (``attention_modules``) gets two static per-tensor scales, ``k_scale =
amax(K) / 448`` and ``v_scale = amax(V) / 448``, over the calibration tokens, where K and V are
the key and value states the attention computes with (K after RoPE): what vLLM's FP8 KV cache
quantizes. They are non-persistent float32 [1] buffers ``<attention>.k_scale`` / ``.v_scale``
(``model.layers.{i}.self_attn.k_scale``), and the model's attention implementation becomes a
lowbit wrapper of the one it had (``lowbit.kvcache.attention``) that quantize-dequantizes K and V
with E4M3 under those scales before the attention itself.

This module is torch-free (the CLI checks ``--kv-cache`` before importing torch): the option's
values. The KV-cache spec is ``lowbit.kvcache.spec.KV_SPEC``; the model-side parts are
``lowbit.kvcache.attention`` (the wrapper, attaching scales) and ``lowbit.kvcache.calibrate``.
"""

from __future__ import annotations

from lowbit.errors import OptionRef, QuantizationError

#: the one default of ``lowbit.quantize(kv_cache=...)``, ``lowbit quantize --kv-cache`` and ``compare``: none
DEFAULT_KV_CACHE: str | None = None
KV_FP8 = "fp8"
KV_CACHE_CHOICES = (KV_FP8,)


def check_kv_cache(value) -> str | None:
    """``value`` if it is a KV-cache choice (None: no KV quantization, or "fp8"), else a
    one-line QuantizationError naming the option (``kv_cache=`` / ``--kv-cache``)."""
    if value is None or value in KV_CACHE_CHOICES:
        return value
    raise QuantizationError(f"unknown KV-cache quantization {value!r}: {{kv}} is the only choice "
                            f"(default: none)", kv=OptionRef("kv_cache", KV_FP8))


__all__ = ["DEFAULT_KV_CACHE", "KV_FP8", "KV_CACHE_CHOICES", "check_kv_cache"]
