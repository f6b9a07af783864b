"""compressed-tensors QuantizationArgs <-> lowbit QuantSpec, and the compression format of a scheme.

Typed both ways (no name matching): a QuantSpec maps to the ARGS dict that llm-compressor writes
(every key of the schema explicit), and an ARGS dict from any compressed-tensors version (0.19
writes every field, 0.20 drops null ones) maps back with every omitted default filled in as the
compressed-tensors schema defines it.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Mapping

from lowbit.errors import FormatError, OptionRef, SchemeError
from lowbit.formats.base import Format
from lowbit.numerics import FormatName
from lowbit.schemes import PRESETS, Dynamic, Granularity, WeightObserver, QuantSpec, Scheme


class CTFormat(str, Enum):
    INT_QUANTIZED = "int-quantized"
    FLOAT_QUANTIZED = "float-quantized"
    NAIVE_QUANTIZED = "naive-quantized"
    PACK_QUANTIZED = "pack-quantized"
    NVFP4_PACK_QUANTIZED = "nvfp4-pack-quantized"
    MXFP4_PACK_QUANTIZED = "mxfp4-pack-quantized"
    MXFP6_PACK_QUANTIZED = "mxfp6-pack-quantized"  # E2M3 only: compressed-tensors' FP6
    MXFP8_QUANTIZED = "mxfp8-quantized"
    # read, never written: auto-round's llm_compressor export of NVFP4-E5M3 (provider "auto-round"),
    # args as NVFP4's (tensor_group, group 16) but UE5M3 block scales and no global scales; stock
    # compressed-tensors has no such format and reads those tensors as NVFP4 (see spec_to_args)
    NVFP4_E5M3_PACK_QUANTIZED = "nvfp4-e5m3-pack-quantized"


ARGS_KEYS = ("num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
             "actorder", "scale_dtype", "zp_dtype", "observer", "observer_kwargs")

# compressed-tensors' weight observer names. Reading: llm-compressor's MSE observers give "mse",
# lowbit's own names ("full-range", "full-range-mse", "half-step") themselves, every other name (minmax,
# static/memoryless variants, none) gives "max", the scales in the file being what they are; the
# observer only says how lowbit would quantize the weights again. (compressed-tensors' minmax
# rule for symmetric INT is amax / ((qmax - qmin) / 2), lowbit's half-step; files written by
# llm-compressor read as max, as lowbit's w8a8-int8 preset quantizes.)
_CT_WEIGHT_OBSERVER = {WeightObserver.MAX: "minmax", WeightObserver.MSE: "mse", WeightObserver.FULL_RANGE: "full-range",
                       WeightObserver.FULL_RANGE_MSE: "full-range-mse", WeightObserver.HALF_STEP: "half-step"}
_MSE_OBSERVERS = frozenset({"mse", "memoryless_mse", "static_mse"})

_SCALE_DTYPE = {FormatName.UE4M3: "torch.float8_e4m3fn", FormatName.E8M0: "torch.uint8"}


def _read_weight_observer(name: Any) -> WeightObserver:
    if name in _MSE_OBSERVERS:
        return WeightObserver.MSE
    if name in (_CT_WEIGHT_OBSERVER[WeightObserver.FULL_RANGE], _CT_WEIGHT_OBSERVER[WeightObserver.FULL_RANGE_MSE],
                _CT_WEIGHT_OBSERVER[WeightObserver.HALF_STEP]):
        return WeightObserver(name)
    return WeightObserver.MAX


def _refuse(scheme: Scheme, why: str) -> FormatError:
    return FormatError(f"format 'compressed-tensors' cannot hold scheme {scheme.name!r}: {why}. "
                       "Save it with {lowbit} (exact for every scheme) instead.", lowbit=OptionRef("format", "lowbit"))


def spec_to_args(spec: QuantSpec, scheme: Scheme, is_weight: bool) -> dict[str, Any]:
    """The compressed-tensors ARGS dict of one spec (weights or input activations)."""
    if spec.is_integer:
        typ, bits = "int", spec.bits
    elif spec.format in (FormatName.E4M3, FormatName.E2M1, FormatName.E2M3):
        typ, bits = "float", spec.bits
    elif spec.format is FormatName.E3M2:
        raise _refuse(scheme, "compressed-tensors' 6-bit float is E2M3; it has no E3M2")
    else:
        raise _refuse(scheme, f"element format {spec.format.value} has no compressed-tensors type")
    if spec.scale_floor is not None:
        raise _refuse(scheme, f"its scale floor ({spec.scale_floor:.6g}) has no compressed-tensors field")
    if spec.scale_format is FormatName.UE5M3:
        raise _refuse(scheme, "UE5M3 block scales (NVFP4-E5M3) have no standard compressed-tensors layout: stock "
                              "transformers + compressed-tensors read auto-round's non-standard "
                              "'nvfp4-e5m3-pack-quantized' as standard NVFP4 (wrong values, NaN logits) without an "
                              "error")
    block = None
    if spec.granularity is Granularity.GROUP:
        strategy = "tensor_group" if spec.global_scale else "group"
    elif spec.granularity is Granularity.BLOCK:
        strategy, block = "block", [spec.group_size, spec.group_size]
    else:
        strategy = spec.granularity.value
    dynamic: bool | str = {Dynamic.STATIC: False, Dynamic.DYNAMIC: True, Dynamic.LOCAL: "local"}[spec.dynamic]
    if is_weight:
        observer = _CT_WEIGHT_OBSERVER[spec.observer]
    else:
        observer = {Dynamic.STATIC: "minmax", Dynamic.DYNAMIC: None, Dynamic.LOCAL: "static_minmax"}[spec.dynamic]
    return {
        "num_bits": bits, "type": typ, "symmetric": spec.symmetric,
        "group_size": None if block else spec.group_size,
        "strategy": strategy, "block_structure": block, "dynamic": dynamic, "actorder": None,
        "scale_dtype": _SCALE_DTYPE.get(spec.scale_format), "zp_dtype": None if spec.symmetric else "torch.int8",
        "observer": observer, "observer_kwargs": {},
    }


def layout_format(scheme: Scheme) -> Format:
    """The layout a layer of ``scheme`` is read with in a compressed-tensors-style folder:
    NVFP4-E5M3 (UE5M3 block scales: ``nvfp4-e5m3-pack-quantized``, auto-round's
    ``llm_compressor_nvfp4_e5m3``) stores ``weight_packed`` uint8 [out, in/2] (low nibble first)
    and ``weight_scale`` uint8 UE5M3 codes [out, in/16], byte for byte lowbit's own layout;
    every other scheme the compressed-tensors layout."""
    return Format.LOWBIT if scheme.weights.scale_format is FormatName.UE5M3 else Format.COMPRESSED_TENSORS


def ct_format_of(scheme: Scheme) -> CTFormat:
    """The compression format of a scheme, or FormatError if compressed-tensors cannot hold it."""
    w, a = scheme.weights, scheme.input_activations
    for s in (w, a):
        if s is not None:
            spec_to_args(s, scheme, s is w)  # element/scale formats representable at all
    if w.format is FormatName.E2M1:
        if w.scale_format is FormatName.UE4M3 and w.global_scale and w.group_size == 16:
            if a is not None and not (a.format is FormatName.E2M1 and a.scale_format is FormatName.UE4M3
                                      and a.global_scale and a.group_size == 16):
                raise _refuse(scheme, "nvfp4-pack-quantized takes NVFP4 input activations or none")
            return CTFormat.NVFP4_PACK_QUANTIZED
        if w.scale_format is FormatName.E8M0 and w.group_size == 32:
            return CTFormat.MXFP4_PACK_QUANTIZED
        raise _refuse(scheme, "FP4 weights need NVFP4 (group 16, UE4M3 + global) or MXFP4 (group 32, E8M0) scales")
    if w.format is FormatName.E2M3:
        if w.scale_format is FormatName.E8M0 and w.group_size == 32:
            return CTFormat.MXFP6_PACK_QUANTIZED
        raise _refuse(scheme, "FP6 weights need MXFP6 scales (group 32, E8M0)")
    if w.format is FormatName.E4M3:
        if w.scale_format is FormatName.E8M0:
            if w.group_size != 32:
                raise _refuse(scheme, "MXFP8 weights need group 32")
            return CTFormat.MXFP8_QUANTIZED
        if w.granularity is Granularity.GROUP:
            raise _refuse(scheme, "FP8 weights with plain group scales have no compressed-tensors compressor")
        if a is not None and a.granularity is Granularity.GROUP and a.scale_format is FormatName.FP32 \
                and not (w.granularity is Granularity.BLOCK and a.dynamic is Dynamic.DYNAMIC):
            raise _refuse(scheme, "FP8 per-group input activations with fp32 scales go with FP8 block weights")
        return CTFormat.FLOAT_QUANTIZED
    if w.is_integer:
        if w.is_microscaled:
            raise _refuse(scheme, "integer weights with block-format scales")
        if a is None:
            if 32 % w.bits:
                raise _refuse(scheme, f"pack-quantized packs 2-, 4- or 8-bit integers, not {w.bits}-bit")
            return CTFormat.PACK_QUANTIZED
        return CTFormat.INT_QUANTIZED
    raise _refuse(scheme, f"weights in {w.format.value}")


# ---------------------------------------------------------------------------- reading
def _dtype_key(v: Any) -> str | None:
    return None if v is None else str(v).removeprefix("torch.")


def args_to_spec(args: Mapping[str, Any], ct_format: str | None, where: str, is_weight: bool) -> QuantSpec:
    """A QuantSpec from a compressed-tensors ARGS dict, filling the schema's defaults explicitly:
    num_bits 8, type int, symmetric true, group_size null, strategy inferred from group_size
    (null: tensor, -1: channel, > 0: group), dynamic false, scale_dtype by format; the weight
    observer as described at _CT_WEIGHT_OBSERVER above (mse, full-range, full-range-mse, half-step, else max);
    input activations always read as max."""
    if not isinstance(args, Mapping):
        raise FormatError(f"{where}: quantization args must be a mapping, got {args!r}")
    unknown = set(args) - set(ARGS_KEYS)
    if unknown:
        raise FormatError(f"{where}: unknown quantization args {sorted(unknown)} (the compressed-tensors "
                          f"schema forbids extra keys)")
    bits = args.get("num_bits", 8)
    typ = str(args.get("type", "int")).lower()
    symmetric = args.get("symmetric", True)
    group_size = args.get("group_size")
    strategy = args.get("strategy")
    dynamic = args.get("dynamic", False)
    scale_dtype = _dtype_key(args.get("scale_dtype"))
    observer = WeightObserver.MAX
    if is_weight:
        observer = _read_weight_observer(args.get("observer"))
    block = args.get("block_structure")
    if block is not None or strategy == "block":
        if not (is_weight and strategy == "block" and isinstance(block, list) and len(block) == 2
                and block[0] == block[1] and isinstance(block[0], int) and block[0] > 0):
            raise FormatError(f"{where}: block-wise scales need strategy 'block' with a square block_structure "
                              f"[b, b] on weights, got strategy {strategy!r}, block_structure {block!r}")
        group_size = block[0]
    if strategy is None:
        strategy = "tensor" if group_size is None else ("channel" if group_size == -1 else "group")
    strategy = str(strategy).lower()
    if group_size == -1:
        group_size = None
    dyn = {False: Dynamic.STATIC, True: Dynamic.DYNAMIC, "local": Dynamic.LOCAL}.get(
        dynamic if isinstance(dynamic, bool) else str(dynamic).lower())
    if dyn is None:
        raise FormatError(f"{where}: option 'dynamic' must be true, false or \"local\", got {dynamic!r}")
    if is_weight and dyn is not Dynamic.STATIC:
        raise FormatError(f"{where}: dynamic weights (dynamic={dynamic!r}) are not supported")
    if not is_weight and not symmetric and dyn is not Dynamic.DYNAMIC:
        raise FormatError(f"{where}: asymmetric static input activations (an input_zero_point) are not supported")
    gran = {"tensor": Granularity.TENSOR, "channel": Granularity.CHANNEL, "token": Granularity.TOKEN,
            "group": Granularity.GROUP, "tensor_group": Granularity.GROUP, "block": Granularity.BLOCK}.get(strategy)
    if gran is None:
        raise FormatError(f"{where}: strategy {strategy!r} is not supported by lowbit")
    scale_format, global_scale = FormatName.FP32, False
    if typ == "int":
        try:
            fmt = FormatName(f"int{int(bits)}")
        except ValueError:
            raise FormatError(f"{where}: num_bits {bits} for type int is not supported (2..8)") from None
    elif typ == "float" and bits == 8:
        fmt = FormatName.E4M3
        if gran is Granularity.GROUP and (scale_dtype == "uint8" or (scale_dtype is None and group_size == 32)):
            if group_size != 32:
                raise FormatError(f"{where}: E8M0 (MXFP8) group scales need group_size 32, got {group_size}")
            scale_format = FormatName.E8M0
        elif gran is Granularity.GROUP and (is_weight or scale_dtype not in (None, "float32", "bfloat16", "float16")):
            raise FormatError(f"{where}: FP8 group scales other than MXFP8 (group 32, uint8 E8M0) or FP32 scales on "
                              f"input activations (FP8 block's per-token groups) are not supported")
    elif typ == "float" and bits == 6:
        fmt = FormatName.E2M3
        if not (gran is Granularity.GROUP and group_size == 32 and scale_dtype in (None, "uint8")):
            raise FormatError(f"{where}: FP6 needs MXFP6 scales (group 32, uint8 E8M0), got strategy {strategy!r}, "
                              f"group_size {group_size}, scale_dtype {scale_dtype}")
        scale_format = FormatName.E8M0
    elif typ == "float" and bits == 4:
        fmt = FormatName.E2M1
        if ct_format == CTFormat.NVFP4_E5M3_PACK_QUANTIZED.value:
            if strategy != "tensor_group" or group_size != 16 or scale_dtype not in (None, "uint8"):
                raise FormatError(f"{where}: {ct_format} needs strategy tensor_group, group_size 16 and uint8 "
                                  f"scales, got {strategy}, {group_size}, {scale_dtype}")
            scale_format = FormatName.UE5M3
            if dyn is Dynamic.LOCAL:  # auto-round writes NVFP4's "local": with no global scale, all dynamic
                dyn = Dynamic.DYNAMIC
        elif strategy == "tensor_group":
            if group_size != 16 or scale_dtype not in (None, "float8_e4m3fn"):
                raise FormatError(f"{where}: NVFP4 needs group_size 16 and float8_e4m3fn scales, got "
                                  f"group_size {group_size}, scale_dtype {scale_dtype}")
            scale_format, global_scale = FormatName.UE4M3, True
        elif gran is Granularity.GROUP and group_size == 32 and (scale_dtype in (None, "uint8")) and \
                ct_format in (None, CTFormat.MXFP4_PACK_QUANTIZED.value):
            scale_format = FormatName.E8M0
        else:
            raise FormatError(f"{where}: FP4 with strategy {strategy!r}, group_size {group_size}, scale_dtype "
                              f"{scale_dtype} is neither NVFP4 nor MXFP4")
    else:
        raise FormatError(f"{where}: type {typ!r} with num_bits {bits} is not supported")
    try:
        return QuantSpec(fmt, gran, group_size if gran in (Granularity.GROUP, Granularity.BLOCK) else None,
                         bool(symmetric), dyn, scale_format, global_scale, observer)
    except SchemeError as e:
        raise FormatError(f"{where}: {e}") from e


def named_scheme(weights: QuantSpec, acts: QuantSpec | None, fallback: str) -> Scheme:
    """The preset with exactly these specs (so names stay the same everywhere), else ``fallback``."""
    for p in PRESETS.values():
        if p.weights == weights and p.input_activations == acts:
            return p
    return Scheme(fallback, weights, acts)
