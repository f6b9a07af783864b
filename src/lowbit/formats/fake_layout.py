"""The ``fake`` format: weights stored already quantized-dequantized, in the model's dtype.

Tensors of one quantized Linear ``P``: ``P.weight`` (dequantize(qweight) in the model dtype, the
usual [out, in] float weight) and ``P.bias``, nothing else, so plain transformers opens the folder
as a float model (it warns that it does not know quant_method "lowbit" and skips it); the weight
files keep the standard names (``model.safetensors``...) for that reason.

``quantization_config`` is the lowbit one with ``"format": "fake"`` plus the static input scales
(float32 values, exact through JSON) so that ``lowbit.load`` rebuilds modules that QDQ their
inputs at run time::

    {"quant_method": "lowbit", "format": "fake", "format_version": 1,
     "config_groups": {"group_0": {"targets": ["Linear"], "scheme": Scheme.to_dict()}},
     "ignore": [...],
     "static_scales": {"model.layers.0.self_attn.q_proj": {"input_scale": 0.0123, "input_global_scale": null}}}

A calibrated FP8 KV cache adds ``"kv_cache"`` with its scales in the config (``lowbit.formats.kv_layout``).

Weights are not re-quantized on loading (re-quantizing QDQ'd bf16 values is not exact in general):
the stored float weight is used as is, which equals the reference backend's dequantized weight
exactly when the model dtype is float32.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from lowbit.errors import FormatError
from lowbit.formats.base import FLOAT_DTYPES, Format, Layout, LinearRead, ParsedConfig, TensorSpec, check_tensor, need
from lowbit.files.folder import STANDARD_STEM
from lowbit.formats.lowbit_layout import lowbit_quantization_config, read_bias, read_version, scheme_groups
from lowbit.quant import dequantize
from lowbit.schemes import Dynamic, Scheme


def _value(t: torch.Tensor | None) -> float | None:
    return None if t is None else float(t.to(torch.float32).reshape(-1)[0].item())


def static_scale_entry(input_scale: torch.Tensor | None, input_global_scale: torch.Tensor | None) -> dict[str, Any]:
    """The config entry for one layer's static scales (exact float32 values as JSON numbers)."""
    return {"input_scale": _value(input_scale), "input_global_scale": _value(input_global_scale)}


class FakeLayout(Layout):
    format = Format.FAKE
    weights_stem = STANDARD_STEM  # plain float weights: stock loaders read them correctly
    quant_suffixes = ()          # quantized layers are stored as plain dequantized ``weight``
    holds_dequantized = True

    def check_scheme(self, scheme: Scheme) -> None:
        return None

    def linear_tensors(self, prefix, qweight, scheme, bias=None, input_scale=None, input_global_scale=None,
                       dtype=torch.bfloat16):
        if qweight.spec != scheme.weights:
            raise FormatError(f"layer {prefix!r}: weight spec does not match scheme {scheme.name}")
        t = {f"{prefix}.weight": dequantize(qweight, dtype).contiguous()}
        if bias is not None:
            t[f"{prefix}.bias"] = bias.detach().to(dtype).contiguous()
        return t

    def tensor_specs(self, scheme, out_features, in_features, *, dtype, bias=False, input_scale=False,
                     input_global_scale=False, prefix="layer"):
        # the static input scales live in the config (static_scales), not in tensors
        t = {"weight": TensorSpec((out_features, in_features), dtype)}
        if bias:
            t["bias"] = TensorSpec((out_features,), dtype)
        return t

    def quantization_config_groups(self, groups, ignore=(), *, static_scales=None):
        cfg = lowbit_quantization_config(Format.FAKE, groups, ignore)
        cfg["static_scales"] = {k: dict(v) for k, v in sorted((static_scales or {}).items())}
        return cfg

    def kv_tensors(self, scales, dtype):
        return {}  # the KV scales live in the config (kv_cache.scales): plain transformers reads the folder

    def add_kv_config(self, qcfg, kv_cache, scales):
        from lowbit.formats.kv_layout import lowbit_kv_entry

        if kv_cache is not None:
            qcfg["kv_cache"] = lowbit_kv_entry(kv_cache, scales)
        return qcfg

    def read_kv_scales(self, parsed, tensors, modules):
        from lowbit.formats.kv_layout import config_kv_scales

        return config_kv_scales(parsed, modules)

    def reads(self, qcfg: Mapping[str, Any]) -> bool:
        return qcfg.get("quant_method") == "lowbit" and qcfg.get("format") == self.format.value

    def parse_config(self, qcfg: Mapping[str, Any]) -> ParsedConfig:
        w = "config.json quantization_config (lowbit fake)"
        expected = {"quant_method", "format", "format_version", "config_groups", "ignore", "static_scales"}
        missing, unknown = expected - set(qcfg), set(qcfg) - expected - {"kv_cache"}
        if missing or unknown:
            raise FormatError(f"{w}: missing fields {sorted(missing)}, unknown fields {sorted(unknown)}")
        read_version(qcfg, w)  # the fake layout's tensors are the same in every version
        scales = qcfg["static_scales"]
        if not isinstance(scales, dict):
            raise FormatError(f"{w}: 'static_scales' must map layer names to their scales")
        for layer, e in scales.items():
            if not isinstance(e, dict) or set(e) != {"input_scale", "input_global_scale"}:
                raise FormatError(f"{w}: static_scales[{layer!r}] must have exactly 'input_scale' and "
                                  f"'input_global_scale'")
            for k, v in e.items():
                if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                    raise FormatError(f"{w}: static_scales[{layer!r}][{k!r}] must be a positive number, got {v!r}")
        from lowbit.formats.kv_layout import parse_lowbit_kv

        kv_cache, kv_scales = parse_lowbit_kv(qcfg.get("kv_cache"), w, scales=True)
        return ParsedConfig(Format.FAKE, scheme_groups(qcfg, w), list(qcfg["ignore"]), static_scales=scales,
                            source="lowbit", kv_cache=kv_cache, kv_scales=kv_scales)

    def read_linear(self, prefix, tensors, scheme, dtype=torch.bfloat16, config: ParsedConfig | None = None,
                    shape=None):
        what = f"layer {prefix!r} ({scheme.name}, fake)"
        k = f"{prefix}.weight"
        w = check_tensor(tensors, k, need(tensors, k, what), dtypes=FLOAT_DTYPES, what=what)
        if w.dim() != 2:
            raise FormatError(f"tensor {k!r} must be 2-D, has shape {tuple(w.shape)}")
        entry = dict((config.static_scales.get(prefix) if config is not None else None) or {})
        for key in ("input_scale", "input_global_scale"):  # auto-round fake folders keep them as tensors
            if entry.get(key) is None and f"{prefix}.{key}" in tensors:
                t = tensors[f"{prefix}.{key}"]
                if t.numel() != 1 or not t.dtype.is_floating_point:
                    raise FormatError(f"tensor {prefix}.{key!s} must hold one float, has shape {tuple(t.shape)} "
                                      f"dtype {t.dtype}")
                entry[key] = float(t.to(torch.float32).reshape(-1)[0])
        a = scheme.input_activations
        isc = igs = None
        if a is not None and a.dynamic is Dynamic.STATIC:
            if entry.get("input_scale") is None:
                raise FormatError(f"config.json static_scales[{prefix!r}]['input_scale'] (or tensor "
                                  f"{prefix + '.input_scale'!r}) is missing: {what} has static input activations")
            isc = torch.tensor([entry["input_scale"]], dtype=torch.float32)
        if a is not None and a.global_scale:
            if entry.get("input_global_scale") is None:
                raise FormatError(f"config.json static_scales[{prefix!r}]['input_global_scale'] (or tensor "
                                  f"{prefix + '.input_global_scale'!r}) is missing: {what} has an NVFP4 input "
                                  f"global scale")
            igs = torch.tensor([entry["input_global_scale"]], dtype=torch.float32)
        return LinearRead(None, read_bias(prefix, tensors, w.shape[0]), isc, igs, weight=w)
