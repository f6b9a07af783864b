"""The tensors of one compressed-tensors Linear, kind by kind (the table in ``ct_layout``'s docstring).

How a compression format stores a weight's element codes (and an asymmetric weight's zero point)
is one ``CodesStore`` (``codes_store(ct_format)``); how a scale format stores the weight scales is
one ``ScaleStore`` (``scale_store(spec)``). Each object writes, declares (``TensorSpec``) and reads
its tensors, so a writer, its declaration and its reader are written side by side and cannot
disagree; ``CompressedTensorsLayout`` looks the stores up and never branches on the kind itself.
Adding a compression format is one store and its line in ``_CODES``.

Names: ``write`` returns full names (``prefix + "." + suffix``), as ``Layout.linear_tensors``;
``specs`` returns suffixes, as ``Layout.tensor_specs``. ``read`` returns the uint8 element codes
[out, in] (codes) or the float32 scales in the model's shape (scales), raising FormatError naming
the tensor when one is missing or malformed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Mapping

import torch

from lowbit.errors import FormatError
from lowbit.formats.base import FLOAT_DTYPES, TensorSpec, check_codes, check_tensor, model_scale_shape, need, where
from lowbit.formats.ct_args import CTFormat
from lowbit.formats.lowbit_layout import file_scale, model_scale, scale_shape
from lowbit.numerics import E8M0, FormatName, get_format
from lowbit.quant import QuantizedTensor, nibbles, pack_int32, pack_sixes, unpack_int32, unpack_nibbles, unpack_sixes
from lowbit.schemes import QuantSpec

Tensors = Mapping[str, torch.Tensor]


def as_shape(tensors: Tensors, name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Accept the equivalent shapes writers use for a scale ([] or [1] for per-tensor, [out] for
    per-channel [out, 1]); anything else is left for check_tensor to report."""
    if tuple(t.shape) != tuple(shape) and t.numel() == torch.Size(shape).numel() and t.dim() <= len(shape):
        return t.reshape(shape)
    return t


def float_scale(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A scale compressed-tensors keeps in the model dtype, through float32 (as llm-compressor casts it)."""
    return scale.to(torch.float32).to(dtype).contiguous()


# ---------------------------------------------------------------------------- element codes
class CodesStore(ABC):
    """How one compression format stores an [out, in] weight's element codes.

    nibble_packed: whether the codes are stored nibble-packed (a PackedQuantizedTensor is then
    written as it is, ``Layout.nibble_packed``)."""

    nibble_packed: bool = False

    @abstractmethod
    def write(self, prefix: str, qweight: QuantizedTensor) -> dict[str, torch.Tensor]:
        """The tensors holding ``qweight``'s codes, by full name."""

    @abstractmethod
    def specs(self, spec: QuantSpec, out_f: int, in_f: int) -> dict[str, TensorSpec]:
        """What ``write`` writes for an [out_f, in_f] weight of ``spec``, by suffix, in order."""

    @abstractmethod
    def read(self, prefix: str, tensors: Tensors, spec: QuantSpec, what: str) -> torch.Tensor:
        """The uint8 codes [out, in] stored under ``prefix``; ``what`` names the layer in errors."""

    def write_zero_point(self, zero_point: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
        """The zero point as stored: int8 in the scale's shape."""
        return zero_point.to(torch.int8).contiguous()

    def zero_point_spec(self, spec: QuantSpec, stored: TensorSpec) -> TensorSpec:
        """The zero point's spec, given the int8 one in the scale's shape (``Layout.common_specs``)."""
        return stored

    def read_zero_point(self, prefix: str, tensors: Tensors, spec: QuantSpec, sshape: tuple[int, ...],
                        what: str) -> torch.Tensor:
        """The int8 zero point in the scale's shape ``sshape``."""
        zk = f"{prefix}.weight_zero_point"
        zraw = as_shape(tensors, zk, need(tensors, zk, what), sshape)
        return check_tensor(tensors, zk, zraw, shape=sshape, dtypes=[torch.int8], what=what)


def _weight_2d(prefix: str, tensors: Tensors, dtype: torch.dtype, what: str) -> tuple[str, torch.Tensor]:
    k = f"{prefix}.weight"
    wt = check_tensor(tensors, k, need(tensors, k, what), dtypes=[dtype], what=what)
    if wt.dim() != 2:
        raise FormatError(f"tensor {where(tensors, k)} must be 2-D, has shape {tuple(wt.shape)}")
    return k, wt


class Int8Codes(CodesStore):
    """int-quantized: ``weight`` int8 [out, in], the integer values (INT2..INT8)."""

    def write(self, prefix, qweight):
        return {f"{prefix}.weight": get_format(qweight.spec.format).codes_to_int(qweight.codes).to(torch.int8)
                .contiguous()}

    def specs(self, spec, out_f, in_f):
        return {"weight": TensorSpec((out_f, in_f), torch.int8)}

    def read(self, prefix, tensors, spec, what):
        k, wt = _weight_2d(prefix, tensors, torch.int8, what)
        fmt_i = get_format(spec.format)
        if spec.bits < 8 and bool(((wt < fmt_i.qmin) | (wt > fmt_i.qmax)).any()):
            raise FormatError(f"tensor {where(tensors, k)}: values outside {spec.format.value}")
        return fmt_i.encode(wt.to(torch.float32))


class Fp8Codes(CodesStore):
    """float-quantized, mxfp8-quantized: ``weight`` float8_e4m3fn [out, in], the codes' bits."""

    def write(self, prefix, qweight):
        return {f"{prefix}.weight": qweight.codes.contiguous().view(torch.float8_e4m3fn)}

    def specs(self, spec, out_f, in_f):
        return {"weight": TensorSpec((out_f, in_f), torch.float8_e4m3fn)}

    def read(self, prefix, tensors, spec, what):
        k, wt = _weight_2d(prefix, tensors, torch.float8_e4m3fn, what)
        codes = wt.contiguous().view(torch.uint8)
        check_codes(tensors, k, codes, spec, what)
        return codes


class SixBitCodes(CodesStore):
    """mxfp6-pack-quantized: ``weight_packed`` uint8 [out, 3*in/4], four E2M3 codes in 3 bytes."""

    def write(self, prefix, qweight):
        return {f"{prefix}.weight_packed": pack_sixes(qweight.codes)}

    def specs(self, spec, out_f, in_f):
        return {"weight_packed": TensorSpec((out_f, in_f * 3 // 4), torch.uint8)}

    def read(self, prefix, tensors, spec, what):
        k = f"{prefix}.weight_packed"
        packed = check_tensor(tensors, k, need(tensors, k, what), dtypes=[torch.uint8], what=what)
        if packed.dim() != 2 or packed.shape[1] % 3:
            raise FormatError(f"tensor {where(tensors, k)} must be [out, 3 * in / 4], has shape {tuple(packed.shape)}")
        return unpack_sixes(packed)


class NibbleCodes(CodesStore):
    """nvfp4-pack-quantized, mxfp4-pack-quantized: ``weight_packed`` uint8 [out, in/2], element
    2i in the low nibble."""

    nibble_packed = True

    def write(self, prefix, qweight):
        return {f"{prefix}.weight_packed": nibbles(qweight, f"{prefix}.weight")}

    def specs(self, spec, out_f, in_f):
        return {"weight_packed": TensorSpec((out_f, in_f // 2), torch.uint8)}

    def read(self, prefix, tensors, spec, what):
        k = f"{prefix}.weight_packed"
        packed = check_tensor(tensors, k, need(tensors, k, what), dtypes=[torch.uint8], what=what)
        if packed.dim() != 2:
            raise FormatError(f"tensor {where(tensors, k)} must be 2-D, has shape {tuple(packed.shape)}")
        return unpack_nibbles(packed)


class Int32PackedCodes(CodesStore):
    """pack-quantized (weight-only INT2/4/8): ``weight_packed`` int32 [out, ceil(in*bits/32)]
    (+2^(bits-1) offset, lowest first) and ``weight_shape`` int64 [2]; the zero point int32
    [ceil(out*bits/32), G], packed alike along the output dimension (``packed_dim=0``)."""

    def write(self, prefix, qweight):
        spec = qweight.spec
        out_f, in_f = qweight.shape
        vals = get_format(spec.format).codes_to_int(qweight.codes)
        return {f"{prefix}.weight_packed": pack_int32(vals, spec.bits),
                f"{prefix}.weight_shape": torch.tensor([out_f, in_f], dtype=torch.int64)}

    def specs(self, spec, out_f, in_f):
        return {"weight_packed": TensorSpec((out_f, -(-in_f * spec.bits // 32)), torch.int32),
                "weight_shape": TensorSpec((2,), torch.int64)}

    def read(self, prefix, tensors, spec, what):
        k, sk_ = f"{prefix}.weight_packed", f"{prefix}.weight_shape"
        packed = check_tensor(tensors, k, need(tensors, k, what), dtypes=[torch.int32], what=what)
        shape_t = check_tensor(tensors, sk_, need(tensors, sk_, what), shape=(2,),
                               dtypes=[torch.int64, torch.int32], what=what)
        out_f, in_f = (int(v) for v in shape_t.tolist())
        per = 32 // spec.bits
        check_tensor(tensors, k, packed, shape=(out_f, -(-in_f // per)), what=f"{what}, weight_shape {[out_f, in_f]}")
        return get_format(spec.format).encode(unpack_int32(packed, spec.bits, in_f).to(torch.float32))

    def write_zero_point(self, zero_point, spec):
        return pack_int32(zero_point.t(), spec.bits).t().contiguous()

    def zero_point_spec(self, spec, stored):
        out_f, groups = stored.shape
        return TensorSpec((-(-out_f * spec.bits // 32), groups), torch.int32)

    def read_zero_point(self, prefix, tensors, spec, sshape, what):
        zk = f"{prefix}.weight_zero_point"
        per = 32 // spec.bits
        zraw = check_tensor(tensors, zk, need(tensors, zk, what), shape=(-(-sshape[0] // per), sshape[1]),
                            dtypes=[torch.int32], what=what)
        return unpack_int32(zraw.t().contiguous(), spec.bits, sshape[0]).t().to(torch.int8).contiguous()


#: the store of every compression format lowbit writes (``ct_args.ct_format_of``'s answers)
_CODES: dict[CTFormat, CodesStore] = {
    CTFormat.INT_QUANTIZED: Int8Codes(),
    CTFormat.FLOAT_QUANTIZED: Fp8Codes(),
    CTFormat.MXFP8_QUANTIZED: Fp8Codes(),
    CTFormat.MXFP6_PACK_QUANTIZED: SixBitCodes(),
    CTFormat.PACK_QUANTIZED: Int32PackedCodes(),
    CTFormat.NVFP4_PACK_QUANTIZED: NibbleCodes(),
    CTFormat.MXFP4_PACK_QUANTIZED: NibbleCodes(),
}


def codes_store(ct_format: CTFormat) -> CodesStore:
    """How ``ct_format`` stores element codes; FormatError for a format lowbit neither writes nor
    reads with this layout (naive-quantized; nvfp4-e5m3-pack-quantized is read with lowbit's)."""
    try:
        return _CODES[ct_format]
    except KeyError:
        raise FormatError(f"compression format {ct_format.value!r} has no compressed-tensors weight layout "
                          "in lowbit") from None


# ---------------------------------------------------------------------------- weight scales
class ScaleStore(ABC):
    """How one scale format stores the weight scales of an [out, in] weight."""

    @abstractmethod
    def write(self, qweight: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
        """``weight_scale`` as stored; ``dtype``: the model's float dtype."""

    @abstractmethod
    def spec(self, spec: QuantSpec, out_f: int, in_f: int, dtype: torch.dtype) -> TensorSpec:
        """What ``write`` writes for an [out_f, in_f] weight of ``spec``."""

    @abstractmethod
    def read(self, tensors: Tensors, name: str, raw: torch.Tensor, spec: QuantSpec, sshape: tuple[int, ...],
             out_f: int, what: str) -> torch.Tensor:
        """The float32 scales in the model's shape (``QuantizedTensor.scale`` of an [out_f, in]
        weight) from the stored tensor ``raw`` (named ``name``), whose file shape is ``sshape``
        (``lowbit_layout.scale_shape``)."""


class Fp8BlockScales(ScaleStore):
    """UE4M3 block scales (NVFP4): float8_e4m3fn, one per row and group."""

    def write(self, qweight, dtype):
        return qweight.scale.to(torch.float32).to(torch.float8_e4m3fn).contiguous()

    def spec(self, spec, out_f, in_f, dtype):
        return TensorSpec(model_scale_shape(spec, out_f, in_f), torch.float8_e4m3fn)

    def read(self, tensors, name, raw, spec, sshape, out_f, what):
        scale = check_tensor(tensors, name, raw, shape=sshape, dtypes=[torch.float8_e4m3fn], what=what).to(torch.float32)
        if bool((scale < 0).any()):
            raise FormatError(f"tensor {where(tensors, name)} has negative block scales")
        return scale


class E8M0Scales(ScaleStore):
    """E8M0 block scales (MX formats): uint8 codes, one per row and group."""

    def write(self, qweight, dtype):
        return qweight.scale_codes().contiguous()

    def spec(self, spec, out_f, in_f, dtype):
        return TensorSpec(model_scale_shape(spec, out_f, in_f), torch.uint8)

    def read(self, tensors, name, raw, spec, sshape, out_f, what):
        return E8M0.decode(check_tensor(tensors, name, raw, shape=sshape, dtypes=[torch.uint8], what=what))


class ModelDtypeScales(ScaleStore):
    """Plain (fp32) scales: kept in the model dtype, in the file's shape (BLOCK: one per tile)."""

    def write(self, qweight, dtype):
        return float_scale(file_scale(qweight.scale, qweight.spec), dtype)

    def spec(self, spec, out_f, in_f, dtype):
        return TensorSpec(scale_shape(spec, out_f, in_f), dtype)

    def read(self, tensors, name, raw, spec, sshape, out_f, what):
        raw = as_shape(tensors, name, raw, sshape)
        return model_scale(check_tensor(tensors, name, raw, shape=sshape, dtypes=FLOAT_DTYPES, what=what)
                           .to(torch.float32), spec, out_f)


_SCALES: dict[FormatName, ScaleStore] = {FormatName.UE4M3: Fp8BlockScales(), FormatName.E8M0: E8M0Scales()}
_PLAIN_SCALES = ModelDtypeScales()


def scale_store(spec: QuantSpec) -> ScaleStore:
    """How the weight scales of ``spec`` are stored: by its scale format, plain scales otherwise."""
    return _SCALES.get(spec.scale_format, _PLAIN_SCALES)
