"""The ``compressed-tensors`` format (what llm-compressor writes and transformers/vLLM load).

Tensors of one quantized Linear ``P`` (see shared/reference/formats.md):

| compression format | tensors |
|---|---|
| int-quantized / float-quantized | ``P.weight`` int8 or float8_e4m3fn [out, in]; ``P.weight_scale`` model dtype [out, 1] (channel), [1] (tensor), [out, G] (group) or [ceil(out/b), ceil(in/b)] (block, FP8_BLOCK); ``P.input_scale`` model dtype [1] (static inputs) |
| pack-quantized (weight-only int) | ``P.weight_packed`` int32 [out, ceil(in*bits/32)] (+2^(bits-1) offset, lowest first); ``P.weight_shape`` int64 [2]; ``P.weight_scale`` model dtype |
| nvfp4-pack-quantized | ``P.weight_packed`` uint8 [out, in/2] (element 2i low nibble); ``P.weight_scale`` float8_e4m3fn [out, in/16]; ``P.weight_global_scale`` float32 [1]; ``P.input_global_scale`` float32 [1] |
| mxfp4-pack-quantized | ``P.weight_packed`` uint8 [out, in/2]; ``P.weight_scale`` uint8 E8M0 codes [out, in/32] |
| mxfp8-quantized | ``P.weight`` float8_e4m3fn [out, in]; ``P.weight_scale`` uint8 E8M0 codes [out, in/32] |
| mxfp6-pack-quantized | ``P.weight_packed`` uint8 [out, 3*in/4]: four 6-bit E2M3 codes in 3 bytes, the 24-bit little-endian word c0 | c1 << 6 | c2 << 12 | c3 << 18; ``P.weight_scale`` uint8 E8M0 codes [out, in/32] |

Zero points (asymmetric INT only): ``P.weight_zero_point`` int8 in the scale's shape for
int-quantized; for pack-quantized int32 [ceil(out*bits/32), G], packed like the weights but
along the output dimension (compressed-tensors' ``packed_dim=0``).

Scales that compressed-tensors keeps in the model dtype are cast to it on writing: exact when the
scale is representable (always for float32 models); for bf16/fp16 models a float32 lowbit scale is
rounded, which ``lowbit.save`` reports (the file then holds a slightly different dequantization).
Reading uses the stored scales exactly (compressed-tensors' int scales are amax/127.5 and its
codes span -128..127; both are read as they are). Groups in auto-round's non-standard
``nvfp4-e5m3-pack-quantized`` format are read (with lowbit's layout, which their tensors are byte
for byte: ``ct_args.layout_format``); writing NVFP4-E5M3 is refused (``ct_args.spec_to_args``
says why).

Each compression format's codes and each scale format's scales are one object that writes,
declares and reads them (``lowbit.formats.ct_tensors``); this layout looks them up.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from lowbit.errors import FormatError, OptionRef
from lowbit.formats.base import (
    FLOAT_DTYPES, SHARED_SCALES, Format, Layout, LinearRead, ParsedConfig, check_tensor, need,
)
from lowbit.formats.ct_args import CTFormat, args_to_spec, ct_format_of, layout_format, named_scheme, spec_to_args
from lowbit.files.folder import STANDARD_STEM
from lowbit.formats.kv_layout import ct_kv_cache_scheme, kv_scale_tensors, parse_ct_kv
from lowbit.formats.ct_tensors import as_shape, codes_store, float_scale, scale_store
from lowbit.formats.lowbit_layout import read_bias, scale_shape
from lowbit.numerics import FormatName
from lowbit.quant import QuantizedTensor
from lowbit.schemes import Dynamic, Granularity, Scheme

CT_VERSION = "0.20.1"  # the compressed-tensors release whose layouts these files were checked against


class CTConfig(ParsedConfig):
    """A compressed-tensors config: each layer read with ``layout_format(scheme)``."""

    def format_for(self, scheme: Scheme) -> Format:
        return layout_format(scheme)


def _check_e5m3(scheme: Scheme, where_: str) -> None:
    """An ``nvfp4-e5m3-pack-quantized`` group: NVFP4-E5M3 weights, inputs the same or none."""
    w, a = scheme.weights, scheme.input_activations
    if a is not None and not (a.scale_format is FormatName.UE5M3 and a.group_size == 16):
        raise FormatError(f"{where_}: {CTFormat.NVFP4_E5M3_PACK_QUANTIZED.value} takes NVFP4-E5M3 input "
                          f"activations (group 16) or none, got {a.describe()}")
    if w.scale_format is not FormatName.UE5M3:
        raise FormatError(f"{where_}: {CTFormat.NVFP4_E5M3_PACK_QUANTIZED.value} needs FP4 weights, got {w.describe()}")


def _check_shape(prefix: str, scheme: Scheme, in_f: int) -> None:
    """compressed-tensors holds whole groups only (BLOCK: ragged tiles, ceil-shaped scales)."""
    spec = scheme.weights
    if spec.granularity is Granularity.GROUP and in_f % spec.group_size:
        raise FormatError(f"layer {prefix!r} ({scheme.name}): compressed-tensors needs the input dimension "
                          f"{in_f} to be a multiple of the group size {spec.group_size}; ignore this layer or "
                          "save with {lowbit}", lowbit=OptionRef("format", "lowbit"))


class CompressedTensorsLayout(Layout):
    format = Format.COMPRESSED_TENSORS
    weights_stem = STANDARD_STEM  # transformers and vLLM load these folders

    def check_scheme(self, scheme: Scheme) -> None:
        ct_format_of(scheme)

    def serving_verdicts(self, folder, scheme):
        from lowbit.formats.ct_serving import engine_support

        return engine_support(folder, scheme)

    def nibble_packed(self, scheme: Scheme, in_features: int) -> bool:
        return codes_store(ct_format_of(scheme)).nibble_packed

    # ------------------------------------------------------------------ write
    def linear_tensors(self, prefix, qweight, scheme, bias=None, input_scale=None, input_global_scale=None,
                       dtype=torch.bfloat16):
        ct_format = ct_format_of(scheme)
        spec = scheme.weights
        if qweight.spec != spec:
            raise FormatError(f"layer {prefix!r}: weight spec {qweight.spec.describe()} is not the weights of "
                              f"scheme {scheme.name}")
        out_f, in_f = qweight.shape
        _check_shape(prefix, scheme, in_f)
        store = codes_store(ct_format)
        t = store.write(prefix, qweight)
        t[f"{prefix}.weight_scale"] = scale_store(spec).write(qweight, dtype)
        stored_input_scale = None if input_scale is None else float_scale(input_scale.reshape(1), dtype)
        t.update(self.common_tensors(prefix, qweight, input_scale=stored_input_scale,
                                     input_global_scale=input_global_scale, bias=bias, dtype=dtype))
        if qweight.zero_point is not None:
            t[f"{prefix}.weight_zero_point"] = store.write_zero_point(qweight.zero_point, spec)
        return t

    def check_layers(self, scales):
        """q/k/v and gate/up must share NVFP4 global scales and static input scales (fused runtimes
        keep one per fused layer): a checkpoint that would be misread after fusion is refused."""
        from lowbit.fusion import fused_groups

        for group in fused_groups(list(scales)):
            if len(group) < 2:
                continue
            for attr in SHARED_SCALES:
                vals = [scales[n].get(attr) for n in group]
                present = [v for v in vals if v is not None]
                if present and any(v is None or not torch.equal(v, present[0]) for v in vals):
                    raise FormatError(
                        f"layers {group} are fused by runtimes but their {attr} values differ "
                        f"({[None if v is None else float(v.reshape(-1)[0]) for v in vals]}); compressed-tensors "
                        "needs them shared (calibrate with shared scales, or save with {lowbit})",
                        lowbit=OptionRef("format", "lowbit"))

    def tensor_specs(self, scheme, out_features, in_features, *, dtype, bias=False, input_scale=False,
                     input_global_scale=False, prefix="layer"):
        ct_format, spec, out_f, in_f = ct_format_of(scheme), scheme.weights, out_features, in_features
        _check_shape(prefix, scheme, in_f)
        store = codes_store(ct_format)
        t = store.specs(spec, out_f, in_f)
        t["weight_scale"] = scale_store(spec).spec(spec, out_f, in_f, dtype)
        t.update(self.common_specs(scheme, out_f, in_f, dtype=dtype, bias=bias,
                                   input_scale=dtype if input_scale else None, input_global_scale=input_global_scale))
        if "weight_zero_point" in t:
            t["weight_zero_point"] = store.zero_point_spec(spec, t["weight_zero_point"])
        return t

    def quantization_config_groups(self, groups, ignore=(), *, static_scales=None):
        fmts = {ct_format_of(s) for s, _ in groups}
        top = fmts.pop().value if len(fmts) == 1 else "mixed-precision"
        cg = {}
        for i, (s, targets) in enumerate(groups):
            f = ct_format_of(s).value
            cg[f"group_{i}"] = {
                "targets": list(targets),
                "weights": spec_to_args(s.weights, s, True),
                "input_activations": None if s.input_activations is None else
                spec_to_args(s.input_activations, s, False),
                "output_activations": None,
                "format": f,
            }
        return {
            "quant_method": "compressed-tensors", "format": top, "quantization_status": "compressed",
            "config_groups": cg, "ignore": sorted(set(ignore)), "kv_cache_scheme": None,
            "global_compression_ratio": None, "sparsity_config": {}, "transform_config": {}, "version": CT_VERSION,
        }

    def kv_tensors(self, scales, dtype):
        return kv_scale_tensors(scales, dtype)  # in the model dtype, as compressed-tensors writes them

    def add_kv_config(self, qcfg, kv_cache, scales):
        if kv_cache is not None:  # kv_cache_scheme stays null otherwise
            qcfg["kv_cache_scheme"] = ct_kv_cache_scheme()
        return qcfg

    # ------------------------------------------------------------------ read
    def reads(self, qcfg: Mapping[str, Any]) -> bool:
        return qcfg.get("quant_method") == "compressed-tensors"

    def parse_config(self, qcfg: Mapping[str, Any]) -> ParsedConfig:
        w = "config.json quantization_config (compressed-tensors)"
        status = qcfg.get("quantization_status", "compressed")
        if status not in ("compressed", "frozen"):
            raise FormatError(f"{w}: quantization_status {status!r}; lowbit reads compressed checkpoints only")
        if qcfg.get("sparsity_config"):
            raise FormatError(f"{w}: sparsity_config is set; sparse compressed-tensors checkpoints are not supported")
        if qcfg.get("transform_config"):
            raise FormatError(f"{w}: transform_config is set; rotated (transformed) checkpoints are not supported")
        kv_cache = parse_ct_kv(qcfg.get("kv_cache_scheme"), w)
        top = qcfg.get("format")
        groups_in = qcfg.get("config_groups")
        if not isinstance(groups_in, dict) or not groups_in:
            raise FormatError(f"{w}: 'config_groups' must be a non-empty mapping")
        groups: list[tuple[Scheme, list[str]]] = []
        formats: dict[str, str] = {}
        for gname, g in groups_in.items():
            gw = f"{w} group {gname!r}"
            if not isinstance(g, dict):
                raise FormatError(f"{gw}: must be a mapping")
            if g.get("output_activations"):
                raise FormatError(f"{gw}: output activation quantization is not supported")
            f = g.get("format") or top
            valid = {c.value for c in CTFormat}
            if f not in valid:
                raise FormatError(f"{gw}: compression format {f!r} is not supported; lowbit reads {sorted(valid)}")
            if g.get("weights") is None:
                raise FormatError(f"{gw}: no 'weights' args (activation-only quantization is not supported)")
            ws = args_to_spec(g["weights"], f, f"{gw} weights", True)
            acts = g.get("input_activations")
            a = None if acts is None else args_to_spec(acts, f, f"{gw} input_activations", False)
            targets = g.get("targets", ["Linear"])
            if not isinstance(targets, list):
                raise FormatError(f"{gw}: 'targets' must be a list")
            scheme = named_scheme(ws, a, f"ct-{gname}")
            for t in targets:
                formats[t] = f
            groups.append((scheme, targets))
            if f == CTFormat.NVFP4_E5M3_PACK_QUANTIZED.value:
                _check_e5m3(scheme, gw)
                continue
            try:
                ct_format_of(scheme)
            except FormatError as e:
                raise FormatError(f"{gw}: {e}") from None
        ignore = qcfg.get("ignore") or []
        provider = qcfg.get("provider")
        return CTConfig(Format.COMPRESSED_TENSORS, groups, list(ignore),
                        source="compressed-tensors" + (f" ({provider})" if provider else ""),
                        extra={"version": qcfg.get("version"), "formats": formats}, kv_cache=kv_cache)

    def read_linear(self, prefix, tensors, scheme, dtype=torch.bfloat16, config=None, shape=None):
        ct_format = ct_format_of(scheme)
        spec = scheme.weights
        what = f"layer {prefix!r} ({scheme.name}, {ct_format.value})"
        store = codes_store(ct_format)
        codes = store.read(prefix, tensors, spec, what)
        out_f, in_f = codes.shape
        sshape = scale_shape(spec, out_f, in_f, prefix)
        sk = f"{prefix}.weight_scale"
        scale = scale_store(spec).read(tensors, sk, need(tensors, sk, what), spec, sshape, out_f, what)
        zp = None if spec.symmetric else store.read_zero_point(prefix, tensors, spec, sshape, what)
        gs = None
        if spec.global_scale:
            gk = f"{prefix}.weight_global_scale"
            graw = as_shape(tensors, gk, need(tensors, gk, what), (1,))
            gs = check_tensor(tensors, gk, graw, shape=(1,), dtypes=[torch.float32], what=what)
        a = scheme.input_activations
        isc = igs = None
        if a is not None and a.dynamic is Dynamic.STATIC:
            ik = f"{prefix}.input_scale"
            iraw = as_shape(tensors, ik, need(tensors, ik, f"{what} static input"), (1,))
            isc = check_tensor(tensors, ik, iraw, shape=(1,), dtypes=FLOAT_DTYPES, what=what).to(torch.float32)
        if a is not None and a.global_scale:
            ik = f"{prefix}.input_global_scale"
            iraw = as_shape(tensors, ik, need(tensors, ik, f"{what} NVFP4 input"), (1,))
            igs = check_tensor(tensors, ik, iraw, shape=(1,), dtypes=[torch.float32], what=what)
        bias = read_bias(prefix, tensors, out_f)
        return LinearRead(QuantizedTensor(codes, scale, spec, zp, gs), bias, isc, igs)

