"""What every checkpoint format provides: the per-layer layout interface.

A *layout* turns one quantized Linear into named tensors (and back), and a scheme into the
``quantization_config`` dict stored in ``config.json``. Layouts are pure functions of tensors and
schemes: no model is needed, so model-free quantization writes exactly what ``lowbit.save`` writes.

    from lowbit.formats import Format, get_layout
    layout = get_layout(Format.COMPRESSED_TENSORS)          # or "compressed-tensors"
    layout.check_scheme(scheme)                              # FormatError if it cannot hold it
    tensors = layout.linear_tensors("model.layers.0.self_attn.q_proj", qweight, scheme,
                                    bias=None, input_scale=None, input_global_scale=None,
                                    dtype=torch.bfloat16)   # {"model.layers.0...q_proj.weight_packed": ...}
    qcfg = layout.quantization_config(scheme, ignore=["lm_head"])   # config.json["quantization_config"]

and back, from a folder's tensors (any Mapping[str, Tensor], e.g. ``lowbit.files.folder.SafetensorsFolder``):

    parsed = layout.parse_config(qcfg)                       # ParsedConfig
    scheme = parsed.scheme_for("model.layers.0.self_attn.q_proj")   # None: not quantized
    layer = layout.read_linear(prefix, tensors, scheme, dtype=torch.bfloat16)   # LinearRead
    layer.qweight (QuantizedTensor), layer.input_scale, layer.input_global_scale, layer.bias

Static scales (``input_scale``, ``input_global_scale``) are float32 [1] tensors, exactly as
``QuantLinear`` holds them. ``dtype`` is the model's float dtype (biases, and the scales of formats
that store them in the model dtype).
"""

from __future__ import annotations

import re
import warnings
from abc import abstractmethod
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable, Mapping

import torch

from lowbit.errors import FormatError
from lowbit.formats.checkpoint_format import CheckpointFormat, Container
from lowbit.quant import QuantizedTensor
from lowbit.schemes import Scheme

# tensor name suffixes (``<linear>.<suffix>``) that only quantized layers have, in any layout lowbit
# reads: a layer left float must not carry them (the loader and ``inspect`` flag strays)
QUANT_SUFFIXES = ("weight_packed", "weight_codes", "weight_scale", "weight_zero_point", "weight_global_scale",
                  "weight_shape", "input_scale", "input_global_scale", "qweight", "qzeros", "g_idx")


#: the per-layer scales a format may need shared between layers that runtimes fuse (``check_layers``)
SHARED_SCALES = ("weight_global_scale", "input_scale", "input_global_scale")


class Format(str, Enum):
    """Checkpoint formats lowbit writes (``lowbit.save(..., format=)``) and reads."""

    LOWBIT = "lowbit"
    FAKE = "fake"
    COMPRESSED_TENSORS = "compressed-tensors"
    GGUF = "gguf"  # one file for llama.cpp (lowbit.formats.gguf.format.GgufFormat), not a folder layout

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: "Format | str") -> "Format":
        try:
            return cls(value)
        except ValueError:
            raise FormatError(
                f"unknown checkpoint format {value!r}; choose one of: {', '.join(f.value for f in cls)}"
            ) from None


@dataclass
class LinearRead:
    """One Linear read back from a checkpoint.

    qweight: the quantized weight (None for the ``fake`` format, which stores ``weight``).
    weight: the float weight as stored (``fake`` format only), else None.
    bias: in the stored dtype, or None.
    input_scale / input_global_scale: float32 [1] or None.
    scheme: the scheme the layer runs under when its tensors make it differ from the config's
        (auto-round fake FP8 folders without exported input scales: dynamic inputs), else None.
    """

    qweight: QuantizedTensor | None
    bias: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None
    input_global_scale: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    scheme: Scheme | None = None


@dataclass(frozen=True)
class TensorSpec:
    """What a layout writes for one tensor: its shape and dtype (``Layout.tensor_specs``)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def model_scale_shape(spec, out_f: int, in_f: int) -> tuple[int, ...]:
    """The shape of a QuantizedTensor's scale (and zero point) for an [out, in] weight: one per
    row and group (BLOCK: per row of its tile, groups along the input), one per row (CHANNEL),
    one (TENSOR)."""
    from lowbit.quant import num_groups
    from lowbit.schemes import Granularity

    if spec.granularity is Granularity.TENSOR:
        return (1, 1)
    return (out_f, num_groups(in_f, spec, "weight", (out_f, in_f)))


def matches_ignore_entry(name: str, entry: str) -> bool:
    """compressed-tensors ignore/target matching: an exact name, or ``re:<regex>`` (re.match)."""
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    return name == entry


@dataclass
class ParsedConfig:
    """A checkpoint's quantization_config resolved into typed schemes.

    groups: (scheme, targets) pairs; a target is an exact module name, ``re:<regex>``, or the
        class name ``"Linear"`` (every Linear not ignored).
    ignore: exact names or ``re:<regex>`` entries.
    static_scales: per-layer static input scales kept in the config (``fake`` format only).
    extra: format-specific facts (e.g. the packing format of an auto-round folder).
    kv_cache: None, or "fp8": a calibrated FP8 KV cache (``lowbit.formats.kv_layout``).
    kv_scales: the ``fake`` format's KV scales from the config, {attention module: {"k_scale",
        "v_scale"}} (the other formats store them as tensors).
    """

    format: Format
    groups: list[tuple[Scheme, list[str]]]
    ignore: list[str] = field(default_factory=list)
    static_scales: dict[str, dict[str, float]] = field(default_factory=dict)
    source: str = "lowbit"
    extra: dict[str, Any] = field(default_factory=dict)
    kv_cache: str | None = None
    kv_scales: dict[str, dict[str, float]] = field(default_factory=dict)
    warned: set[str] = field(default_factory=set, repr=False, compare=False)

    def warn_once(self, key: str, message: str) -> None:
        """A UserWarning the first time ``key`` comes up while this folder is read."""
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(message, UserWarning, stacklevel=3)

    def is_ignored(self, name: str) -> bool:
        return any(matches_ignore_entry(name, e) for e in self.ignore)

    def scheme_for(self, name: str, is_linear: bool = True, is_output_embedding: bool = False) -> Scheme | None:
        """The scheme of layer ``name``, or None when it is not quantized.

        Explicit names and regexes win over the class target ``"Linear"``. ``is_output_embedding``
        matters to configs that leave the output embedding out implicitly (auto-round)."""
        if self.is_ignored(name):
            return None
        for scheme, targets in self.groups:
            if any(t != "Linear" and matches_ignore_entry(name, t) for t in targets):
                return scheme
        if is_linear:
            for scheme, targets in self.groups:
                if "Linear" in targets:
                    return scheme
        return None

    def format_for(self, scheme: Scheme) -> Format:
        """The layout that holds a layer of this scheme (one per folder, except auto-round)."""
        return self.format

    def layout_for(self, scheme: Scheme) -> "Layout":
        """The layout to read a layer of this scheme with (auto-round's GPTQ packing has one
        that lowbit only reads, outside ``Format``)."""
        from lowbit.formats import get_layout

        return get_layout(self.format_for(scheme))

    def schemes(self) -> list[Scheme]:
        return [s for s, _ in self.groups]


def need(tensors: Mapping[str, torch.Tensor], name: str, what: str) -> torch.Tensor:
    """tensors[name], or a FormatError naming the tensor and why it is needed."""
    if name not in tensors:
        raise FormatError(f"tensor {name!r} is missing: {what} needs it")
    return tensors[name]


def where(tensors: Mapping[str, torch.Tensor], name: str) -> str:
    d = getattr(tensors, "describe", None)
    return d(name) if d else repr(name)


def check_tensor(tensors: Mapping[str, torch.Tensor], name: str, t: torch.Tensor, *,
                 shape: Iterable[int] | None = None, dtypes: Iterable[torch.dtype] | None = None,
                 what: str = "") -> torch.Tensor:
    """Check a stored tensor's shape and dtype against what its scheme implies."""
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise FormatError(f"tensor {where(tensors, name)} has shape {tuple(t.shape)}, "
                          f"expected {tuple(shape)}{' for ' + what if what else ''}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise FormatError(f"tensor {where(tensors, name)} has dtype {t.dtype}, expected "
                              f"{' or '.join(str(d) for d in dtypes)}{' for ' + what if what else ''}")
    return t


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_codes(tensors: Mapping[str, torch.Tensor], name: str, codes: torch.Tensor, spec, what: str) -> None:
    """Element codes must be finite values of the spec's format (a NaN pattern means the config's
    element format does not match the stored tensor)."""
    from lowbit.numerics import get_format

    fmt = get_format(spec.format)
    if spec.is_integer:
        if spec.bits < 8 and bool((codes >> spec.bits).any()):
            raise FormatError(f"tensor {where(tensors, name)}: codes exceed {spec.bits} bits for {spec.format.value} "
                              f"({what})")
        return
    if spec.bits == 8 and bool(torch.isnan(fmt.decode(codes)).any()):
        raise FormatError(f"tensor {where(tensors, name)} holds NaN patterns of {spec.format.value}: the config's "
                          f"element format does not match the stored weights ({what})")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str, option: str = "dtype") -> torch.dtype:
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    key = str(name).removeprefix("torch.")
    if key not in table:
        raise FormatError(f"unsupported {option} {name!r}; expected one of {sorted(table)}")
    return table[key]


class Layout(CheckpointFormat):
    """Per-layer tensor layout and config of one folder checkpoint format (pure functions, no model).

    weights_stem: the stem of the folder's weight file names (lowbit.files.folder.WeightFiles),
        given to CheckpointWriter: ``"model"`` for formats stock loaders read correctly,
        ``"lowbit-model"`` for the ``lowbit`` format, which they must not find (they would load
        uninitialised weights for its layers and only warn)."""

    format: Format
    container = Container.FOLDER
    weights_stem: str
    #: tensor suffixes that mark a layer as quantized in this format (a layer the config leaves in
    #: float must carry none); the fake format stores quantized layers as plain ``weight``: none
    quant_suffixes: tuple[str, ...] = QUANT_SUFFIXES
    #: whether the format holds dequantized weights (a model loaded from it can be saved only in it)
    holds_dequantized: bool = False
    #: what stock loaders (transformers) do with this format's folder whose weight files are not
    #: named ``weights_stem``* (``lowbit inspect`` says it)
    misnamed_weights: str = "find no weights"

    def serving_verdicts(self, folder, scheme: Scheme) -> list:
        """What inference engines do with a folder of this format written under ``scheme``
        (``lowbit.formats.ct_serving.EngineVerdict``s, measured); none by default."""
        return []

    @abstractmethod
    def check_scheme(self, scheme: Scheme) -> None:
        """Raise FormatError (naming the scheme and the format) if this format cannot hold it."""

    def nibble_packed(self, scheme: Scheme, in_features: int) -> bool:
        """Whether this layout stores the weight codes of ``scheme`` nibble-packed (then a
        PackedQuantizedTensor is written as it is, without unpacking)."""
        return False

    @abstractmethod
    def linear_tensors(self, prefix: str, qweight: QuantizedTensor, scheme: Scheme, bias: torch.Tensor | None = None,
                       input_scale: torch.Tensor | None = None, input_global_scale: torch.Tensor | None = None,
                       dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """The tensors of one quantized Linear, keyed by full name (``prefix + "." + field``)."""

    def quantization_config(self, scheme: Scheme, ignore: Iterable[str] = (), *,
                            targets: Iterable[str] | None = None,
                            static_scales: Mapping[str, Mapping[str, float]] | None = None) -> dict[str, Any]:
        """The ``quantization_config`` dict for a model whose quantized Linears all use ``scheme``.

        ignore: exact names of EVERY Linear left in float (e.g. ``["lm_head"]``, MoE routers,
            vision towers): with the default targets the loader quantizes every other Linear.
        targets: exact layer names (default ``["Linear"]``: every Linear not ignored).
        static_scales: ``{layer: {"input_scale": float, "input_global_scale": float}}`` of every
            layer with static input scales, given to every layout: the ``fake`` format keeps them in
            its config, the others store them as tensors and ignore them here."""
        return self.quantization_config_groups([(scheme, list(targets) if targets is not None else ["Linear"])],
                                               ignore, static_scales=static_scales)

    def check_layers(self, scales: Mapping[str, Mapping[str, torch.Tensor | None]]) -> None:
        """The format's rules over a model's quantized layers taken together: ``scales`` maps each
        layer's name to its ``SHARED_SCALES`` (None where it has none). FormatError naming the
        layers if the format cannot hold them; by default every combination is held."""
        return None

    @abstractmethod
    def tensor_specs(self, scheme: Scheme, out_features: int, in_features: int, *, dtype: torch.dtype,
                     bias: bool = False, input_scale: bool = False, input_global_scale: bool = False,
                     prefix: str = "layer") -> dict[str, TensorSpec]:
        """What ``linear_tensors`` writes for an [out, in] weight of ``scheme``, without any data:
        {suffix: TensorSpec} in the order it writes them (the full names are ``prefix + "." +
        suffix``), or the FormatError / QuantizationError (naming ``prefix``) that writing such a
        weight would raise. Model-free lays out every output file from these before quantizing anything;
        tests/formats/test_tensor_specs.py holds each layout to its writer, scheme by scheme."""

    def common_specs(self, scheme: Scheme, out_f: int, in_f: int, *, dtype: torch.dtype, bias: bool,
                     input_scale: torch.dtype | None, input_global_scale: bool) -> dict[str, TensorSpec]:
        """The specs of ``common_tensors``' tensors; ``input_scale``: the dtype the layout stores it
        in, None when there is none."""
        spec = scheme.weights
        t: dict[str, TensorSpec] = {}
        if not spec.symmetric and spec.is_integer:
            t["weight_zero_point"] = TensorSpec(model_scale_shape(spec, out_f, in_f), torch.int8)
        if spec.global_scale:
            t["weight_global_scale"] = TensorSpec((1,), torch.float32)
        if input_scale is not None:
            t["input_scale"] = TensorSpec((1,), input_scale)
        if input_global_scale:
            t["input_global_scale"] = TensorSpec((1,), torch.float32)
        if bias:
            t["bias"] = TensorSpec((out_f,), dtype)
        return t

    @abstractmethod
    def kv_tensors(self, scales: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The tensors of a calibrated FP8 KV cache with ``scales`` {attention module: (k_scale,
        v_scale)}, keyed by full name (none for formats that keep the scales in their config);
        ``dtype``: the model's float dtype (``lowbit.formats.kv_layout``)."""

    @abstractmethod
    def add_kv_config(self, qcfg: dict[str, Any], kv_cache: str | None,
                      scales: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
        """``qcfg`` (this layout's ``quantization_config``) with its KV-cache entry for ``kv_cache``
        ("fp8") and ``scales``; unchanged for ``kv_cache=None``."""

    def read_kv_scales(self, parsed: ParsedConfig, tensors: Mapping[str, torch.Tensor],
                       modules: list[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{attention module: (k_scale, v_scale)} float32 [1] for every module in ``modules`` of a
        folder whose config has a KV cache (``parsed.kv_cache``), {} otherwise; a missing scale is a
        FormatError naming it. By default the ``A.k_scale`` / ``A.v_scale`` tensors."""
        from lowbit.formats.kv_layout import tensor_kv_scales

        return tensor_kv_scales(parsed, tensors, modules)

    @abstractmethod
    def quantization_config_groups(self, groups: list[tuple[Scheme, list[str]]], ignore: Iterable[str] = (), *,
                                   static_scales: Mapping[str, Mapping[str, float]] | None = None) -> dict[str, Any]:
        """As quantization_config, for several schemes each on named layers (mixed precision)."""

    @staticmethod
    def common_tensors(prefix: str, qweight: QuantizedTensor, *, input_scale: torch.Tensor | None,
                       input_global_scale: torch.Tensor | None, bias: torch.Tensor | None,
                       dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The tensors every layout stores alike: int8 zero point, float32 [1] NVFP4 global scales,
        the input scale as the caller converted it, the bias in the model dtype."""
        t: dict[str, torch.Tensor] = {}
        if qweight.zero_point is not None:
            t[f"{prefix}.weight_zero_point"] = qweight.zero_point.to(torch.int8).contiguous()
        if qweight.global_scale is not None:
            t[f"{prefix}.weight_global_scale"] = qweight.global_scale.to(torch.float32).reshape(1).clone()
        if input_scale is not None:
            t[f"{prefix}.input_scale"] = input_scale.reshape(1).clone()
        if input_global_scale is not None:
            t[f"{prefix}.input_global_scale"] = input_global_scale.to(torch.float32).reshape(1).clone()
        if bias is not None:
            t[f"{prefix}.bias"] = bias.detach().to(dtype).contiguous()
        return t

    @abstractmethod
    def reads(self, qcfg: Mapping[str, Any]) -> bool:
        """Whether a ``quantization_config`` is this format's (its ``quant_method``, and for formats
        that share one, its ``format`` key): how a folder's format is found (``detect``)."""

    @abstractmethod
    def parse_config(self, qcfg: Mapping[str, Any]) -> ParsedConfig:
        """The typed reading of a ``quantization_config`` of this format (every default explicit)."""

    @abstractmethod
    def read_linear(self, prefix: str, tensors: Mapping[str, torch.Tensor], scheme: Scheme,
                    dtype: torch.dtype = torch.bfloat16, config: ParsedConfig | None = None,
                    shape: tuple[int, int] | None = None) -> LinearRead:
        """Rebuild one Linear from its stored tensors, checking shapes, dtypes and presence.

        config: the folder's ParsedConfig (the ``fake`` format keeps static scales there).
        shape: the model's (out, in) when known; layouts that store the input padded (GPTQ
            packing) crop to it, the others ignore it (the loader checks the shape read)."""

