"""Reading auto-round checkpoints (``quant_method: "auto-round"``).

auto-round writes a flat quantization_config and drops every field left at its default (and
every null), so each default is filled in here explicitly, as auto-round itself resolves them:

| field | default when omitted |
|---|---|
| bits | 4 |
| group_size | 128 (-1: per channel, 0: per tensor) |
| sym | true |
| data_type | "int" |
| act_bits | 16 (>= 16: activations not quantized) |
| act_group_size | group_size (-1: per token, 0: per tensor) |
| act_sym | sym |
| act_data_type | data_type when act_bits < 16 |
| act_dynamic | true (a missing act_dynamic is what broke reloading NVFP4-E5M3 checkpoints) |

Per-layer overrides come from ``extra_config`` ({name or regex: fields}; bits >= 16 means float);
``block_name_to_quantize`` (a list or comma-separated string) limits quantization to those blocks;
without it every Linear but the output embedding is quantized.

Packing formats and the tensor layout each uses:

| packing_format | tensors (read with) |
|---|---|
| auto_round:fp8_static | ``weight`` float8_e4m3fn [out, in], ``weight_scale`` [out] model dtype, ``input_scale`` [1] (compressed-tensors layout) |
| auto_round:llm_compressor | compressed-tensors layouts (nvfp4-pack, mxfp4-pack, mxfp8, pack-quantized); nvfp4_v2 layers as below |
| auto_round:llm_compressor_nvfp4_e5m3 | ``weight_packed`` uint8 [out, in/2], ``weight_scale`` uint8 UE5M3 codes [out, in/16], no global scales (lowbit layout) |
| auto_round:fake | ``weight`` already quantized-dequantized (fake layout); static input scales from ``input_scale`` tensors when present; FP8 layers with only ``act_max_scale`` (auto-round's export: static scales not saved) read with dynamic per-tensor inputs, as auto-round's loader runs them (lowbit.formats.autoround_fake) |
| auto_round:auto_gptq (the default) | ``qweight`` int32 [in_p / (32/bits), out], ``scales`` [in_p / g, out], ``qzeros`` int32 (zero - 1), optional trivial ``g_idx``; INT2/4/8 weight-only (lowbit.formats.gptq_pack) |

auto_gptq symmetric weights read with the ``full-range`` observer (auto-round's rule: scale = the
group's signed extreme / -2^(bits-1), negative when the extreme is positive), so W4A16 is lowbit's
w4a16 preset; asymmetric ones (sym false) with real zero points. On auto-round's model-free
output, W4A16 and W8A16 (group 128) read with codes and scales equal to lowbit's own RTN output
except in the groups where amax == -amin (auto-round picks the opposite sign: mirror image,
equal error; bench/modelfree/RESULTS-modelfree.md, section 5).

Data types: int -> INTn; fp (8 bits) -> FP8 E4M3; nv_fp -> NVFP4 (activations
nv_fp4_with_static_gs: static global scale); mx_fp -> MXFP4 / MXFP8; nvfp4_v2 (alias fp4_v2) ->
NVFP4-E5M3. Anything else is a FormatError naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from lowbit.errors import FormatError, SchemeError
from lowbit.formats.autoround_fake import LAYOUT as FAKE_LAYOUT
from lowbit.formats.base import Format, ParsedConfig
from lowbit.formats.ct_args import layout_format, named_scheme
from lowbit.formats.gptq_pack import PACKING as GPTQ_PACKING
from lowbit.formats.gptq_pack import GptqLayout, check_gptq_spec
from lowbit.numerics import FormatName
from lowbit.schemes import Dynamic, Granularity, WeightObserver, QuantSpec, Scheme

PACKING = {
    "auto_round:fp8_static": Format.COMPRESSED_TENSORS,
    "auto_round:llm_compressor": Format.COMPRESSED_TENSORS,
    "auto_round:llm_compressor_nvfp4_e5m3": Format.LOWBIT,
    "auto_round:fake": Format.FAKE,  # read by AutoRoundFakeLayout (AutoRoundConfig.layout_for)
    "fake": Format.FAKE,
    GPTQ_PACKING: Format.LOWBIT,  # read by GptqLayout into lowbit's QuantizedTensor (AutoRoundConfig.layout_for)
}
GPTQ_LAYOUT = GptqLayout()
SCHEME_KEYS = ("bits", "group_size", "sym", "data_type", "act_bits", "act_group_size", "act_sym", "act_data_type",
               "act_dynamic")
E5M3_TYPES = ("nvfp4_v2", "fp4_v2")

# auto-round's config records no scale rule: its weights read with lowbit's default observer
WEIGHT_OBSERVER = WeightObserver.MAX


def fill_defaults(fields_: Mapping[str, Any]) -> dict[str, Any]:
    """The auto-round scheme fields with every omitted default made explicit."""
    d = {k: fields_.get(k) for k in SCHEME_KEYS}
    d["bits"] = 4 if d["bits"] is None else d["bits"]
    d["group_size"] = 128 if d["group_size"] is None else d["group_size"]
    d["sym"] = True if d["sym"] is None else d["sym"]
    d["data_type"] = "int" if d["data_type"] is None else str(d["data_type"]).lower()
    d["act_bits"] = 16 if d["act_bits"] is None else d["act_bits"]
    d["act_group_size"] = d["group_size"] if d["act_group_size"] is None else d["act_group_size"]
    d["act_sym"] = d["sym"] if d["act_sym"] is None else d["act_sym"]
    if d["act_data_type"] is None:
        d["act_data_type"] = d["data_type"] if d["act_bits"] < 16 else "float"
    d["act_data_type"] = str(d["act_data_type"]).lower()
    d["act_dynamic"] = True if d["act_dynamic"] is None else d["act_dynamic"]
    return d


def _gran(g: Any, where: str, is_act: bool) -> tuple[Granularity, int | None]:
    if isinstance(g, (list, tuple)):
        raise FormatError(f"{where}: block-wise group_size {list(g)} (FP8 block) is not a lowbit scheme")
    g = int(g)
    if g == 0:
        return Granularity.TENSOR, None
    if g == -1:
        return (Granularity.TOKEN if is_act else Granularity.CHANNEL), None
    if g > 0:
        return Granularity.GROUP, g
    raise FormatError(f"{where}: invalid group_size {g}")


def _weight_spec(d: dict[str, Any], where: str, packing: str = "") -> QuantSpec:
    dt, bits = d["data_type"], int(d["bits"])
    w = f"{where} (data_type {dt!r}, bits {bits})"
    if dt in E5M3_TYPES:
        return QuantSpec(FormatName.E2M1, Granularity.GROUP, int(d["group_size"]), scale_format=FormatName.UE5M3,
                         observer=WEIGHT_OBSERVER)
    if dt in ("nv_fp", "nv_fp4", "nvfp4"):
        return QuantSpec(FormatName.E2M1, Granularity.GROUP, int(d["group_size"]), scale_format=FormatName.UE4M3,
                         global_scale=True, observer=WEIGHT_OBSERVER)
    if dt in ("mx_fp", "mx_fp4", "mx_fp8", "mx_fp_rceil"):
        elem = {4: FormatName.E2M1, 8: FormatName.E4M3}.get(bits)
        if elem is None:
            raise FormatError(f"{w}: MX with {bits} bits is not supported (4 or 8)")
        return QuantSpec(elem, Granularity.GROUP, int(d["group_size"]), scale_format=FormatName.E8M0,
                         observer=WEIGHT_OBSERVER)
    gran, gs = _gran(d["group_size"], w, False)
    if dt in ("fp", "fp8", "fp8_e4m3", "float8_e4m3fn") and bits == 8:
        return QuantSpec(FormatName.E4M3, gran, gs, observer=WEIGHT_OBSERVER)
    if dt in ("int", "int_sym", "int_asym") and 2 <= bits <= 8:
        sym = bool(d["sym"]) and dt != "int_asym"
        # the GPTQ packing stores auto-round's signed full-range scales as they are
        observer = WeightObserver.FULL_RANGE if sym and packing == GPTQ_PACKING else WEIGHT_OBSERVER
        return QuantSpec(FormatName(f"int{bits}"), gran, gs, symmetric=sym, observer=observer)
    raise FormatError(f"{w}: this weight data type is not supported by lowbit")


def _act_spec(d: dict[str, Any], where: str) -> QuantSpec | None:
    if int(d["act_bits"]) >= 16:
        return None
    dt, bits, dyn = d["act_data_type"], int(d["act_bits"]), d["act_dynamic"]
    w = f"{where} (act_data_type {dt!r}, act_bits {bits}, act_dynamic {dyn})"
    if not d["act_sym"]:
        raise FormatError(f"{w}: asymmetric activations are not supported")
    if dt in E5M3_TYPES:
        if not dyn:
            raise FormatError(f"{w}: NVFP4-E5M3 activations are dynamic; act_dynamic false has no static scale")
        return QuantSpec(FormatName.E2M1, Granularity.GROUP, int(d["act_group_size"]), dynamic=Dynamic.DYNAMIC,
                         scale_format=FormatName.UE5M3)
    if dt in ("nv_fp4_with_static_gs", "nv_fp", "nv_fp4", "nvfp4"):
        if dyn and dt != "nv_fp4_with_static_gs":
            raise FormatError(f"{w}: NVFP4 activations with a dynamic global scale are not a lowbit scheme "
                              f"(lowbit's NVFP4 inputs use a static global scale)")
        return QuantSpec(FormatName.E2M1, Granularity.GROUP, int(d["act_group_size"]), dynamic=Dynamic.LOCAL,
                         scale_format=FormatName.UE4M3, global_scale=True)
    if dt in ("mx_fp", "mx_fp4", "mx_fp8"):
        elem = {4: FormatName.E2M1, 8: FormatName.E4M3}.get(bits)
        if elem is None:
            raise FormatError(f"{w}: MX activations with {bits} bits are not supported")
        return QuantSpec(elem, Granularity.GROUP, int(d["act_group_size"]), dynamic=Dynamic.DYNAMIC,
                         scale_format=FormatName.E8M0)
    gran, gs = _gran(d["act_group_size"], w, True)
    dynamic = Dynamic.DYNAMIC if dyn else Dynamic.STATIC
    if dt in ("fp", "fp8", "fp8_static") and bits == 8:
        return QuantSpec(FormatName.E4M3, gran, gs, dynamic=Dynamic.STATIC if dt == "fp8_static" else dynamic)
    if dt in ("int", "int_sym") and 2 <= bits <= 8:
        return QuantSpec(FormatName(f"int{bits}"), gran, gs, dynamic=dynamic)
    raise FormatError(f"{w}: this activation data type is not supported by lowbit")


def scheme_from_fields(fields_: Mapping[str, Any], where: str, packing: str = "") -> Scheme | None:
    """The lowbit scheme of auto-round fields (None when bits >= 16: the layer stays float).
    packing: the folder's packing_format (auto_gptq: INT2/4/8 weight-only, full-range if symmetric)."""
    d = fill_defaults(fields_)
    if int(d["bits"]) >= 16:
        return None
    try:
        s = named_scheme(_weight_spec(d, where, packing), _act_spec(d, where),
                         f"auto-round-{d['data_type']}-w{d['bits']}")
    except SchemeError as e:
        raise FormatError(f"{where}: {e}") from None
    if packing == GPTQ_PACKING:
        check_gptq_spec(s, where)
    return s


@dataclass
class AutoRoundConfig(ParsedConfig):
    default_fields: dict[str, Any] = field(default_factory=dict)
    extra_config: dict[str, dict[str, Any]] = field(default_factory=dict)
    blocks: list[str] | None = None
    packing_format: str = ""

    def _extra_for(self, name: str) -> dict[str, Any] | None:
        if name in self.extra_config:
            return self.extra_config[name]
        for k, v in self.extra_config.items():
            try:
                if re.fullmatch(k, name):
                    return v
            except re.error:
                continue
        return None

    def scheme_for(self, name: str, is_linear: bool = True, is_output_embedding: bool = False) -> Scheme | None:
        extra = self._extra_for(name)
        if extra is not None:
            return scheme_from_fields({**self.default_fields, **extra}, f"auto-round extra_config[{name!r}]",
                                      self.packing_format)
        if not is_linear:
            return None
        if self.blocks is not None:
            if not any(name.startswith(b + ".") for b in self.blocks):
                return None
        elif is_output_embedding:
            return None
        return scheme_from_fields(self.default_fields, "auto-round quantization_config", self.packing_format)

    def format_for(self, scheme: Scheme) -> Format:
        if self.format is Format.COMPRESSED_TENSORS:
            return layout_format(scheme)  # nvfp4_v2 layers of an llm_compressor folder: raw E5M3 codes
        return self.format

    def layout_for(self, scheme: Scheme):
        if self.packing_format == GPTQ_PACKING:
            return GPTQ_LAYOUT
        if self.format is Format.FAKE:
            return FAKE_LAYOUT
        return super().layout_for(scheme)


#: the ``quant_method`` values of auto-round's folders
AUTOROUND_METHODS = ("auto-round", "intel/auto-round")


def parse_autoround(qcfg: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> tuple[Format, ParsedConfig]:
    w = "config.json quantization_config (auto-round)"
    packing = qcfg.get("packing_format", "auto_round:auto_gptq")
    if packing not in PACKING:
        raise FormatError(f"{w}: packing_format {packing!r} is not supported; lowbit reads "
                          f"{', '.join(sorted(PACKING))}")
    checkpoint_format = PACKING[packing]
    defaults = {k: qcfg[k] for k in SCHEME_KEYS if k in qcfg}
    if packing == "auto_round:fp8_static":
        defaults.setdefault("data_type", "fp")
        defaults.setdefault("bits", 8)
        defaults.setdefault("group_size", -1)
    extra = qcfg.get("extra_config") or {}
    if not isinstance(extra, dict) or not all(isinstance(v, dict) for v in extra.values()):
        raise FormatError(f"{w}: 'extra_config' must map layer names to field objects")
    blocks = qcfg.get("block_name_to_quantize")
    if isinstance(blocks, str):
        blocks = [b for b in blocks.split(",") if b]
    elif blocks is not None and not isinstance(blocks, list):
        raise FormatError(f"{w}: 'block_name_to_quantize' must be a list or a comma-separated string")
    main = scheme_from_fields(defaults, w, packing)
    parsed = AutoRoundConfig(checkpoint_format, [] if main is None else [(main, ["Linear"])], [], source=f"auto-round {packing}",
                             extra={"packing_format": packing, "filled_defaults": fill_defaults(defaults)},
                             default_fields=defaults, extra_config=dict(extra), blocks=blocks,
                             packing_format=packing)
    for name, e in extra.items():  # validate every override now, with its name in the message
        s = scheme_from_fields({**defaults, **e}, f"{w} extra_config[{name!r}]", packing)
        if s is not None and s not in parsed.schemes():
            parsed.groups.append((s, [name]))
    return checkpoint_format, parsed
