"""The ``lowbit`` native format: exact, packed, every scheme.

Tensors of one quantized Linear ``P`` (nothing else is stored for it):

| tensor | dtype | shape | meaning |
|---|---|---|---|
| ``P.weight_packed`` | uint8 | [out, in/2] | 4-bit element codes (E2M1, INT4), element 2i in the low nibble (in even) |
| ``P.weight_codes`` | code dtype | [out, in] | codes of every other element format, and 4-bit codes when in is odd |
| ``P.weight_scale`` | float32 | scale shape | plain (fp32) scales, exactly as quantized (BLOCK: one per tile, [ceil(out/b), ceil(in/b)]) |
| ``P.weight_scale`` | uint8 | scale shape | codes of the block-scale format (UE4M3, UE5M3, E8M0) |
| ``P.weight_zero_point`` | int8 | scale shape | asymmetric INT only |
| ``P.weight_global_scale`` | float32 | [1] | NVFP4 divisor |
| ``P.input_scale`` | float32 | [1] | static per-tensor input scale |
| ``P.input_global_scale`` | float32 | [1] | NVFP4 input divisor |
| ``P.bias`` | model dtype | [out] | |

Scale shape: TENSOR [1], CHANNEL [out, 1], GROUP [out, ceil(in / group_size)].

Code dtype (``code_dtype``): the torch dtype whose bits are the element format's codes where one
exists, so that the stored dtype says which format the codes are in (a folder whose config names
another scheme is refused, never decoded as the wrong format): int8 for INT8 (two's complement),
float8_e4m3fn for E4M3, float8_e5m2 for E5M2; uint8 for the others (4-bit codes, INT2..INT7).
Format version 1 folders stored every code as uint8 and are still read as such.

Weight files (``weights_stem = "lowbit-model"``):

| file | when |
|---|---|
| ``lowbit-model.safetensors`` | one shard |
| ``lowbit-model-0000i-of-0000n.safetensors`` | several shards (or a sharded model-free source) |
| ``lowbit-model.safetensors.index.json`` | with several shards: ``{"metadata": {"total_size"}, "weight_map"}`` |

Not the standard ``model*.safetensors`` names on purpose: transformers only warns about the unknown
quant_method and would load uninitialised weights for every quantized Linear (its tensors are
``weight_packed``/``weight_codes``, not ``weight``); with no weights file it finds, it raises an
error naming the files it looked for. ``lowbit.load`` reads both namings (older lowbit folders
used the standard names).

``quantization_config``::

    {"quant_method": "lowbit", "format": "lowbit", "format_version": 1,
     "config_groups": {"group_0": {"targets": ["Linear"] | [names], "scheme": Scheme.to_dict()}},
     "ignore": [names...]}

plus, with a calibrated FP8 KV cache, ``"kv_cache": {"name": "fp8", "spec": ...}`` and float32 [1]
``<attention>.k_scale`` / ``.v_scale`` tensors (``lowbit.formats.kv_layout``).

Every QuantSpec field is written (QuantSpec.to_dict) and read back strictly (from_dict).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from lowbit.errors import FormatError, SchemeError
from lowbit.formats.base import (
    FLOAT_DTYPES, Format, Layout, LinearRead, ParsedConfig, TensorSpec, check_codes, check_tensor, need, where,
)
from lowbit.files.folder import LOWBIT_STEM
from lowbit.numerics import FormatName, get_format
from lowbit.quant import QuantizedTensor, nibbles, num_groups, unpack_nibbles
from lowbit.quant.groups import block_scales, row_scales
from lowbit.schemes import Granularity, QuantSpec, Scheme

FORMAT_VERSION = 2  # 2: weight_codes in their code dtype (1: always uint8)
READ_VERSIONS = (1, 2)
# the element formats whose codes are the bits of a torch dtype (the rest are stored as uint8)
_CODE_DTYPES = {FormatName.INT8: torch.int8, FormatName.E4M3: torch.float8_e4m3fn, FormatName.E5M2: torch.float8_e5m2}


def code_dtype(spec: QuantSpec, version: int = FORMAT_VERSION) -> torch.dtype:
    """The dtype ``weight_codes`` of ``spec`` is stored in (format ``version``): see the module docstring."""
    return _CODE_DTYPES.get(spec.format, torch.uint8) if version >= 2 else torch.uint8


def lowbit_quantization_config(checkpoint_format: Format, groups, ignore: Iterable[str]) -> dict[str, Any]:
    """The ``quantization_config`` of lowbit's own formats (``lowbit`` and ``fake``): every
    group's full scheme, field by field, and the ignored layers."""
    return {
        "quant_method": "lowbit",
        "format": checkpoint_format.value,
        "format_version": FORMAT_VERSION,
        "config_groups": {f"group_{i}": {"targets": list(t), "scheme": s.to_dict()}
                          for i, (s, t) in enumerate(groups)},
        "ignore": sorted(set(ignore)),
    }


def read_version(qcfg: Mapping[str, Any], w: str) -> int:
    """The config's format_version, one of READ_VERSIONS (FormatError naming the config otherwise)."""
    v = qcfg["format_version"]
    if isinstance(v, bool) or v not in READ_VERSIONS:
        raise FormatError(f"{w}: format_version {v!r} is not supported (this lowbit reads versions "
                          f"{', '.join(map(str, READ_VERSIONS))})")
    return v


def scale_shape(spec: QuantSpec, out_f: int, in_f: int, name: str = "tensor") -> tuple[int, ...]:
    """The shape of the scales of an [out, in] weight under ``spec``."""
    if spec.granularity is Granularity.TENSOR:
        return (1,)
    if spec.granularity is Granularity.GROUP:
        return (out_f, num_groups(in_f, spec, name, (out_f, in_f)))
    if spec.granularity is Granularity.BLOCK:  # one per tile, as files hold them (quant.groups.block_scales)
        return (-(-out_f // spec.group_size), num_groups(in_f, spec, name, (out_f, in_f)))
    return (out_f, 1)


def file_scale(scale: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The weight scale in the shape files hold it: BLOCK scales one per tile, others as they are."""
    return block_scales(scale, spec.group_size) if spec.granularity is Granularity.BLOCK else scale


def model_scale(scale: torch.Tensor, spec: QuantSpec, out_f: int) -> torch.Tensor:
    """Inverse of file_scale: BLOCK scales back to one per row of their tile."""
    return row_scales(scale, spec.group_size, out_f) if spec.granularity is Granularity.BLOCK else scale


def _packs_nibbles(spec: QuantSpec, in_f: int) -> bool:
    return spec.bits == 4 and in_f % 2 == 0


def scale_dtype(spec: QuantSpec) -> torch.dtype:
    """The dtype ``weight_scale`` of ``spec`` is stored in: float32, or uint8 codes of the scale format."""
    return torch.float32 if spec.scale_format is FormatName.FP32 else torch.uint8


def stored_scale(qweight: QuantizedTensor) -> torch.Tensor:
    """The weight scale as stored (in ``scale_dtype``): float32, or the codes of the spec's scale format."""
    if qweight.spec.scale_format is FormatName.FP32:
        return file_scale(qweight.scale, qweight.spec).to(scale_dtype(qweight.spec)).contiguous()
    return qweight.scale_codes().contiguous().view(scale_dtype(qweight.spec))


def decode_scale(stored: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    if spec.scale_format is FormatName.FP32:
        return stored.to(torch.float32)
    return get_format(spec.scale_format).decode(stored)


def scheme_groups(qcfg: Mapping[str, Any], where_: str) -> list[tuple[Scheme, list[str]]]:
    groups = qcfg.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise FormatError(f"{where_}: 'config_groups' must be a non-empty mapping")
    out = []
    for gname, g in groups.items():
        if not isinstance(g, dict) or set(g) != {"targets", "scheme"}:
            raise FormatError(f"{where_}: config group {gname!r} must have exactly 'targets' and 'scheme'")
        try:
            scheme = Scheme.from_dict(g["scheme"])
        except SchemeError as e:
            raise FormatError(f"{where_}: config group {gname!r}: {e}") from e
        targets = g["targets"]
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise FormatError(f"{where_}: config group {gname!r}: 'targets' must be a list of names")
        out.append((scheme, targets))
    return out


class LowbitLayout(Layout):
    format = Format.LOWBIT
    weights_stem = LOWBIT_STEM  # stock loaders find no weights: they fail instead of misreading
    misnamed_weights = "load uninitialised weights for its layers"

    def check_scheme(self, scheme: Scheme) -> None:
        return None  # every lowbit scheme is representable exactly

    def nibble_packed(self, scheme: Scheme, in_features: int) -> bool:
        return _packs_nibbles(scheme.weights, in_features)

    # ------------------------------------------------------------------ write
    def linear_tensors(self, prefix, qweight, scheme, bias=None, input_scale=None, input_global_scale=None,
                       dtype=torch.bfloat16):
        spec = scheme.weights
        if qweight.spec != spec:
            raise FormatError(f"layer {prefix!r}: weight spec {qweight.spec.describe()} is not the weights of "
                              f"scheme {scheme.name}")
        out_f, in_f = qweight.shape
        t: dict[str, torch.Tensor] = {}
        if _packs_nibbles(spec, in_f):
            t[f"{prefix}.weight_packed"] = nibbles(qweight, f"{prefix}.weight")
        else:
            t[f"{prefix}.weight_codes"] = qweight.codes.to(torch.uint8).contiguous().view(code_dtype(spec))
        t[f"{prefix}.weight_scale"] = stored_scale(qweight)
        stored_input_scale = None if input_scale is None else input_scale.to(torch.float32)
        t.update(self.common_tensors(prefix, qweight, input_scale=stored_input_scale,
                                     input_global_scale=input_global_scale, bias=bias, dtype=dtype))
        return t

    def tensor_specs(self, scheme, out_features, in_features, *, dtype, bias=False, input_scale=False,
                     input_global_scale=False, prefix="layer"):
        spec, out_f, in_f = scheme.weights, out_features, in_features
        t = {}
        if _packs_nibbles(spec, in_f):
            t["weight_packed"] = TensorSpec((out_f, in_f // 2), torch.uint8)
        else:
            t["weight_codes"] = TensorSpec((out_f, in_f), code_dtype(spec))
        t["weight_scale"] = TensorSpec(scale_shape(spec, out_f, in_f), scale_dtype(spec))
        t.update(self.common_specs(scheme, out_f, in_f, dtype=dtype, bias=bias,
                                   input_scale=torch.float32 if input_scale else None,
                                   input_global_scale=input_global_scale))
        return t

    def quantization_config_groups(self, groups, ignore=(), *, static_scales=None):
        return lowbit_quantization_config(Format.LOWBIT, groups, ignore)

    def kv_tensors(self, scales, dtype):
        from lowbit.formats.kv_layout import kv_scale_tensors

        return kv_scale_tensors(scales, torch.float32)  # exact

    def add_kv_config(self, qcfg, kv_cache, scales):
        from lowbit.formats.kv_layout import lowbit_kv_entry

        if kv_cache is not None:
            qcfg["kv_cache"] = lowbit_kv_entry(kv_cache)
        return qcfg

    # ------------------------------------------------------------------ read
    def reads(self, qcfg: Mapping[str, Any]) -> bool:
        return qcfg.get("quant_method") == "lowbit" and qcfg.get("format") == self.format.value

    def parse_config(self, qcfg):
        w = "config.json quantization_config (lowbit)"
        expected = {"quant_method", "format", "format_version", "config_groups", "ignore"}
        missing, unknown = expected - set(qcfg), set(qcfg) - expected - {"kv_cache"}
        if missing or unknown:
            raise FormatError(f"{w}: missing fields {sorted(missing)}, unknown fields {sorted(unknown)}")
        version = read_version(qcfg, w)
        ignore = qcfg["ignore"]
        if not isinstance(ignore, list):
            raise FormatError(f"{w}: 'ignore' must be a list of layer names")
        from lowbit.formats.kv_layout import parse_lowbit_kv

        kv_cache, _ = parse_lowbit_kv(qcfg.get("kv_cache"), w)
        return ParsedConfig(Format.LOWBIT, scheme_groups(qcfg, w), list(ignore), source="lowbit",
                            extra={"format_version": version}, kv_cache=kv_cache)

    def read_linear(self, prefix, tensors, scheme, dtype=torch.bfloat16, config=None, shape=None):
        spec = scheme.weights
        what = f"layer {prefix!r} ({scheme.name})"
        pk, ck = f"{prefix}.weight_packed", f"{prefix}.weight_codes"
        if pk in tensors:
            packed = check_tensor(tensors, pk, tensors[pk], dtypes=[torch.uint8], what=what)
            if packed.dim() != 2 or spec.bits != 4:
                raise FormatError(f"tensor {where(tensors, pk)}: nibble-packed weights need a 2-D tensor and a "
                                  f"4-bit element format, scheme {scheme.name} has {spec.format.value}")
            codes = unpack_nibbles(packed)
        else:
            version = (config.extra if config is not None else {}).get("format_version", FORMAT_VERSION)
            codes = check_tensor(tensors, ck, need(tensors, ck, what), dtypes=[code_dtype(spec, version)],
                                 what=f"the {spec.format.value} codes of {what}").view(torch.uint8)
            if codes.dim() != 2:
                raise FormatError(f"tensor {where(tensors, ck)} must be 2-D, has shape {tuple(codes.shape)}")
        out_f, in_f = codes.shape
        check_codes(tensors, pk if pk in tensors else ck, codes, spec, what)
        sshape = scale_shape(spec, out_f, in_f, prefix)
        sk = f"{prefix}.weight_scale"
        scale = model_scale(decode_scale(check_tensor(tensors, sk, need(tensors, sk, what), shape=sshape,
                                                      dtypes=[scale_dtype(spec)], what=what), spec), spec, out_f)
        zp = None
        if not spec.symmetric:
            zk = f"{prefix}.weight_zero_point"
            zp = check_tensor(tensors, zk, need(tensors, zk, what), shape=sshape, dtypes=[torch.int8], what=what)
        gs = None
        if spec.global_scale:
            gk = f"{prefix}.weight_global_scale"
            gs = check_tensor(tensors, gk, need(tensors, gk, what), shape=(1,), dtypes=[torch.float32], what=what)
        isc, igs = read_input_scales(prefix, tensors, scheme, [torch.float32])
        bias = read_bias(prefix, tensors, out_f)
        return LinearRead(QuantizedTensor(codes, scale, spec, zp, gs), bias, isc, igs)


def read_input_scales(prefix: str, tensors: Mapping[str, torch.Tensor], scheme: Scheme,
                      dtypes: Iterable[torch.dtype]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The static input scales a scheme needs, as float32 [1] (missing ones are an error)."""
    a = scheme.input_activations
    what = f"layer {prefix!r} ({scheme.name}, static input activations)"
    isc = igs = None
    from lowbit.schemes import Dynamic

    if a is not None and a.dynamic is Dynamic.STATIC:
        k = f"{prefix}.input_scale"
        isc = check_tensor(tensors, k, need(tensors, k, what), shape=(1,), dtypes=dtypes, what=what).to(torch.float32)
    if a is not None and a.global_scale:
        k = f"{prefix}.input_global_scale"
        igs = check_tensor(tensors, k, need(tensors, k, what), shape=(1,), dtypes=[torch.float32],
                           what=what).to(torch.float32)
    return isc, igs


def read_bias(prefix: str, tensors: Mapping[str, torch.Tensor], out_f: int) -> torch.Tensor | None:
    k = f"{prefix}.bias"
    if k not in tensors:
        return None
    return check_tensor(tensors, k, tensors[k], shape=(out_f,), dtypes=FLOAT_DTYPES, what=f"layer {prefix!r} bias")
