"""The FP8 KV cache (``lowbit.kvcache``) in each checkpoint format: config entry and tensors.

Per attention module ``A`` (``model.layers.{i}.self_attn``), the names vLLM loads:

| format | config (``quantization_config``) | tensors |
|---|---|---|
| compressed-tensors | ``"kv_cache_scheme"``: the QuantizationArgs of ``KV_SPEC`` (num_bits 8, type float, strategy tensor, dynamic false, symmetric true, observer minmax; every key explicit) | ``A.k_scale``, ``A.v_scale``: model dtype [1], as compressed-tensors initialises and writes them |
| lowbit | ``"kv_cache": {"name": "fp8", "spec": KV_SPEC.to_dict()}`` (absent: no KV quantization) | ``A.k_scale``, ``A.v_scale``: float32 [1] (exact) |
| fake | ``"kv_cache"`` as lowbit's plus ``"scales": {A: {"k_scale": float, "v_scale": float}}`` (exact float32 values as JSON numbers, like its static input scales) | none (plain transformers reads the folder) |

Reading accepts only the FP8 per-tensor static symmetric scheme (anything else is a FormatError
naming ``kv_cache_scheme``/``kv_cache``) and scales of shape [1] or [] in a float dtype, returned
as float32 [1]. Pure functions: no model. Which row a format writes is its layout's choice
(``Layout.kv_tensors``, ``Layout.add_kv_config``); the helpers here build the rows.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from lowbit.errors import FormatError, SchemeError
from lowbit.formats.base import FLOAT_DTYPES, ParsedConfig, check_tensor, need, where
from lowbit.kvcache import KV_FP8
from lowbit.kvcache.spec import KV_SPEC
from lowbit.schemes import QuantSpec, Scheme

KV_TENSORS = ("k_scale", "v_scale")


KVScales = Mapping[str, tuple[torch.Tensor, torch.Tensor]]


def ct_kv_cache_scheme() -> dict[str, Any]:
    """compressed-tensors' ``kv_cache_scheme``: the QuantizationArgs of ``KV_SPEC``."""
    from lowbit.formats.ct_args import spec_to_args

    return spec_to_args(KV_SPEC, Scheme("kv-cache-fp8", KV_SPEC), False)


def kv_scale_tensors(scales: KVScales, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """{``A.k_scale``: ..., ``A.v_scale``: ...} [1] in ``dtype`` (through float32) for ``scales``
    {A: (k, v)}: what formats that store the KV scales as tensors write (``Layout.kv_tensors``)."""
    return {f"{a}.{n}": t.detach().to(torch.float32).to(dtype).reshape(1).clone().cpu()
            for a, pair in scales.items() for n, t in zip(KV_TENSORS, pair)}


def lowbit_kv_entry(kv_cache: str, scales: KVScales | None = None) -> dict[str, Any]:
    """The ``kv_cache`` config entry of lowbit's own formats; with ``scales`` (the ``fake`` format)
    the scales too, as exact float32 values."""
    entry: dict[str, Any] = {"name": kv_cache, "spec": KV_SPEC.to_dict()}
    if scales is not None:
        entry["scales"] = {a: {n: float(t.to(torch.float32).reshape(-1)[0]) for n, t in zip(KV_TENSORS, pair)}
                           for a, pair in sorted(scales.items())}
    return entry


def parse_ct_kv(args: Any, w: str) -> str | None:
    """compressed-tensors ``kv_cache_scheme``: None, or "fp8" for the FP8 per-tensor static scheme."""
    if not args:
        return None
    from lowbit.formats.ct_args import args_to_spec

    try:
        spec = args_to_spec(args, None, f"{w} kv_cache_scheme", False)
    except FormatError as e:
        raise FormatError(f"{e}; lowbit reads only the FP8 per-tensor static KV cache") from None
    if spec != KV_SPEC:
        raise FormatError(f"{w}: kv_cache_scheme {spec.describe()} ({spec.dynamic.value}) is not supported; lowbit "
                          f"reads only the FP8 (E4M3) per-tensor static symmetric KV cache")
    return KV_FP8


def parse_lowbit_kv(entry: Any, w: str, *, scales: bool = False) -> tuple[str | None, dict[str, dict[str, float]]]:
    """lowbit/fake ``kv_cache`` entry: (None or "fp8", its per-module scales); ``scales``: whether
    the entry holds them (the ``fake`` format), else it must not."""
    if entry is None:
        return None, {}
    keys = {"name", "spec"} | ({"scales"} if scales else set())
    if not isinstance(entry, dict) or set(entry) != keys:
        raise FormatError(f"{w}: 'kv_cache' must have exactly {sorted(keys)}")
    try:
        spec = QuantSpec.from_dict(entry["spec"])
    except (SchemeError, TypeError, KeyError) as e:
        raise FormatError(f"{w}: kv_cache spec: {e}") from None
    if entry["name"] != KV_FP8 or spec != KV_SPEC:
        raise FormatError(f"{w}: kv_cache {entry['name']!r} ({spec.describe()}) is not supported; lowbit reads only "
                          f"{KV_FP8!r} ({KV_SPEC.describe()})")
    per_module = entry.get("scales", {})
    if not isinstance(per_module, dict):
        raise FormatError(f"{w}: kv_cache 'scales' must map attention modules to their scales")
    for a, e in per_module.items():
        if not isinstance(e, dict) or set(e) != set(KV_TENSORS) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in e.values()):
            raise FormatError(f"{w}: kv_cache scales[{a!r}] must have exactly positive 'k_scale' and 'v_scale'")
    return KV_FP8, per_module


def config_kv_scales(parsed: ParsedConfig, modules: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{A: (k_scale, v_scale)} float32 [1] from the config's scales (``parsed.kv_scales``, the
    ``fake`` format) for every attention module in ``modules``; {} without a KV cache. A module
    without scales is a FormatError naming it."""
    if parsed.kv_cache is None:
        return {}
    out = {}
    for a in modules:
        e = parsed.kv_scales.get(a)
        if e is None:
            raise FormatError(f"config.json quantization_config kv_cache: no scales for attention module {a!r}")
        out[a] = tuple(torch.tensor([e[n]], dtype=torch.float32) for n in KV_TENSORS)
    return out


def tensor_kv_scales(parsed: ParsedConfig, tensors: Mapping[str, torch.Tensor],
                     modules: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{A: (k_scale, v_scale)} float32 [1] from the tensors ``A.k_scale`` / ``A.v_scale`` (any
    float dtype, shape [1] or []) for every attention module in ``modules``; {} without a KV
    cache (``parsed.kv_cache``). A missing or non-positive scale is a FormatError naming it."""
    if parsed.kv_cache is None:
        return {}
    out = {}
    for a in modules:
        pair = []
        for n in KV_TENSORS:
            k = f"{a}.{n}"
            t = need(tensors, k, f"the KV cache of attention module {a!r}")
            if t.numel() != 1:
                check_tensor(tensors, k, t, shape=(1,), what="a per-tensor KV-cache scale")
            check_tensor(tensors, k, t, dtypes=FLOAT_DTYPES, what="a KV-cache scale")
            v = t.to(torch.float32).reshape(1)
            if not bool(torch.isfinite(v).all()) or not bool((v > 0).all()):
                raise FormatError(f"tensor {where(tensors, k)} is {float(v[0])}: a KV-cache scale must be positive")
            pair.append(v)
        out[a] = (pair[0], pair[1])
    return out
