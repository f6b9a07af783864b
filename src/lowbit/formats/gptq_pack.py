"""Reading GPTQ-packed INT weights (auto-round's ``packing_format: "auto_round:auto_gptq"``).

Tensors of one quantized Linear ``P`` [out, in], group size g (group_size -1: g = in), b bits,
per = 32 / b codes per int32 word, in_p = ceil(in / g) * g (the input padded to whole groups):

| tensor | dtype | shape | meaning |
|---|---|---|---|
| ``P.qweight`` | int32 | [in_p / per, out] | unsigned b-bit codes u, low bits first along the input |
| ``P.scales`` | float16 / bfloat16 / float32 | [in_p / g, out] | group scales (symmetric: negative when the group's extreme is positive) |
| ``P.qzeros`` | int32 | [in_p / g, ceil(out / per)] | zero point z - 1, packed the same way along out (columns past out: padding) |
| ``P.g_idx`` | int32 / int64 | [in] or [in_p] | optional; must be the trivial i // g (act-order is refused) |
| ``P.bias`` | model dtype | [out] | |

Dequantization (GPTQ "v1" zero convention, which auto-round's auto_gptq packing writes and its
kernels read: stored zero + 1): w = (u - z) * scale. lowbit holds the same numbers as signed
codes q = u - 2^(b-1) and, for asymmetric specs, an int8 zero point zp = z - 2^(b-1):
(q - zp) * scale = (u - z) * scale exactly. Symmetric files must store z = 2^(b-1) everywhere.

Checked: dtypes and shapes of every tensor, bits in {2, 4, 8} (3-bit GPTQ packing straddles words:
refused), in_p a multiple of per, the padded input columns decoding to 0, zero points within the
format (z = 2^b, the wrap of an original zero 0 under "z - 1", is refused), g_idx trivial.
lowbit reads this packing; it does not write it.
"""

from __future__ import annotations

from typing import Mapping

import torch

from lowbit.errors import FormatError, OptionRef
from lowbit.formats.base import FLOAT_DTYPES, Format, Layout, LinearRead, check_tensor, need, where
from lowbit.formats.lowbit_layout import read_bias
from lowbit.numerics import get_format
from lowbit.quant import QuantizedTensor
from lowbit.kernels.bitpack import unpack_int32
from lowbit.schemes import Granularity, Scheme

PACKING = "auto_round:auto_gptq"
GPTQ_BITS = (2, 4, 8)
ZERO_OFFSET = 1  # stored zero = z - 1 (GPTQ v1)


def check_gptq_spec(scheme: Scheme, where_: str) -> None:
    """FormatError unless ``scheme`` is one the GPTQ packing holds: weight-only INT2/4/8 with
    fp32 scales per group or per channel."""
    s = scheme.weights
    if not s.is_integer or s.is_microscaled:
        raise FormatError(f"{where_}: {PACKING} packing holds INT weights only, not {s.format.value}")
    if s.bits not in GPTQ_BITS:
        raise FormatError(f"{where_}: {PACKING} packing with {s.bits} bits is not supported (lowbit reads "
                          f"{', '.join(map(str, GPTQ_BITS))}; 3-bit GPTQ words straddle int32 boundaries)")
    if s.granularity not in (Granularity.GROUP, Granularity.CHANNEL):
        raise FormatError(f"{where_}: {PACKING} packing needs group_size > 0 or -1 (per channel), "
                          f"not {s.granularity.value} scales")
    if scheme.input_activations is not None:
        raise FormatError(f"{where_}: {PACKING} packing is weight-only; activation quantization "
                          f"(act_bits < 16) has no tensors in it")


def _check_g_idx(tensors, k: str, g_idx: torch.Tensor, in_f: int | None, in_p: int, g: int) -> None:
    check_tensor(tensors, k, g_idx, dtypes=[torch.int32, torch.int64], what="g_idx")
    if g_idx.dim() != 1 or g_idx.shape[0] not in {in_p, in_f if in_f is not None else in_p}:
        raise FormatError(f"tensor {where(tensors, k)} has shape {tuple(g_idx.shape)}, expected "
                          f"({in_f if in_f is not None else in_p},) (or the padded ({in_p},))")
    trivial = torch.arange(g_idx.shape[0], dtype=torch.int64) // g
    if not torch.equal(g_idx.to(torch.int64), trivial):
        bad = int((g_idx.to(torch.int64) != trivial).nonzero()[0, 0])
        raise FormatError(f"tensor {where(tensors, k)}: g_idx[{bad}] = {int(g_idx[bad])}, not {bad} // {g}: "
                          f"act-order (desc_act) group orders are not supported by lowbit")


def read_gptq_linear(prefix: str, tensors: Mapping[str, torch.Tensor], scheme: Scheme,
                     shape: tuple[int, int] | None = None) -> LinearRead:
    """One Linear from its GPTQ tensors. ``shape``: the model's (out, in), which crops the padded
    input (without it, g_idx's length, else the padded width, is the input size)."""
    spec = scheme.weights
    what = f"layer {prefix!r} ({scheme.name}, {PACKING})"
    check_gptq_spec(scheme, what)
    bits, per = spec.bits, 32 // spec.bits
    half = 1 << (bits - 1)
    qk, sk, zk, gk = (f"{prefix}.{s}" for s in ("qweight", "scales", "qzeros", "g_idx"))
    qweight = check_tensor(tensors, qk, need(tensors, qk, what), dtypes=[torch.int32], what=what)
    if qweight.dim() != 2:
        raise FormatError(f"tensor {where(tensors, qk)} must be 2-D [in / {per}, out], has shape "
                          f"{tuple(qweight.shape)}")
    in_p, out_f = qweight.shape[0] * per, qweight.shape[1]
    in_f = None
    if shape is not None:
        if shape[0] != out_f:
            raise FormatError(f"tensor {where(tensors, qk)} has shape {tuple(qweight.shape)}: {out_f} output "
                              f"columns, the model config says {shape[0]} ({what})")
        in_f = shape[1]
    elif gk in tensors:
        in_f = int(tensors[gk].shape[0])
    g = spec.group_size if spec.granularity is Granularity.GROUP else (in_f or in_p)
    n_in = in_f if in_f is not None else in_p
    want_in_p = -(-n_in // g) * g
    if want_in_p % per:
        raise FormatError(f"{what}: the padded input {want_in_p} is not a multiple of {per} codes per word")
    check_tensor(tensors, qk, qweight, shape=(want_in_p // per, out_f),
                 what=f"{what}, {n_in} inputs padded to {want_in_p} (group size {g})")
    groups = want_in_p // g
    scales = check_tensor(tensors, sk, need(tensors, sk, what), shape=(groups, out_f), dtypes=FLOAT_DTYPES,
                          what=what)
    scale = scales.to(torch.float32).t().contiguous()
    if not bool(torch.isfinite(scale).all()):
        raise FormatError(f"tensor {where(tensors, sk)} holds non-finite scales")
    qzeros = check_tensor(tensors, zk, need(tensors, zk, what), shape=(groups, -(-out_f // per)),
                          dtypes=[torch.int32], what=what)
    # words along out, low bits first, stored unsigned: unpack_int32's signed values + half
    z = (unpack_int32(qzeros, bits, out_f).to(torch.int64) + half + ZERO_OFFSET).t()  # [out, groups], 1 .. 2^bits
    if spec.symmetric:
        if not bool((z == half).all()):
            bad = z[z != half][0]
            raise FormatError(f"tensor {where(tensors, zk)}: zero point {int(bad)} (stored {int(bad) - ZERO_OFFSET}) "
                              f"under a symmetric config, which stores {half} (stored {half - ZERO_OFFSET}) "
                              f"everywhere ({what})")
        zp = None
    else:
        if bool((z > (1 << bits) - 1).any()):
            raise FormatError(f"tensor {where(tensors, zk)}: zero point {1 << bits} (stored {(1 << bits) - 1}, "
                              f"the wrap of a zero point 0 under GPTQ's 'zero - 1' convention) is outside "
                              f"{bits}-bit codes ({what})")
        zp = (z - half).to(torch.int8).contiguous()
    if gk in tensors:
        _check_g_idx(tensors, gk, tensors[gk], in_f, want_in_p, g)
    q = unpack_int32(qweight.t().contiguous(), bits, want_in_p).to(torch.int64)  # [out, in_p]: u - half
    pad = q[:, n_in:]
    if pad.numel():
        zero = torch.zeros_like(pad) if zp is None else z.repeat_interleave(g, dim=1)[:, n_in:] - half
        if not torch.equal(pad, zero):
            raise FormatError(f"tensor {where(tensors, qk)}: the padded inputs {n_in}..{want_in_p - 1} hold nonzero "
                              f"weights ({what})")
    values = q[:, :n_in].to(torch.float32)
    codes = get_format(spec.format).encode(values)
    return LinearRead(QuantizedTensor(codes, scale, spec, zp), read_bias(prefix, tensors, out_f))


class GptqLayout(Layout):
    """The read-only layout of GPTQ-packed folders (see the module docstring)."""

    format = Format.LOWBIT  # the lowbit scheme it reads into; lowbit never writes this layout
    weights_stem = "model"

    def check_scheme(self, scheme: Scheme) -> None:
        check_gptq_spec(scheme, f"scheme {scheme.name}")

    def linear_tensors(self, prefix, qweight, scheme, bias=None, input_scale=None, input_global_scale=None,
                       dtype=torch.bfloat16):
        raise FormatError(f"lowbit reads {PACKING} packing but does not write it (layer {prefix!r}); save with "
                          "{ct} or {lowbit}", ct=OptionRef("format", "compressed-tensors"),
                          lowbit=OptionRef("format", "lowbit"))

    def tensor_specs(self, scheme, out_features, in_features, *, dtype, bias=False, input_scale=False,
                     input_global_scale=False, prefix="layer"):
        raise FormatError(f"lowbit reads {PACKING} packing but does not write it")

    def quantization_config_groups(self, groups, ignore=(), *, static_scales=None):
        raise FormatError(f"lowbit does not write {PACKING} checkpoints")

    def kv_tensors(self, scales, dtype):
        raise FormatError(f"lowbit does not write {PACKING} checkpoints")

    def add_kv_config(self, qcfg, kv_cache, scales):
        raise FormatError(f"lowbit does not write {PACKING} checkpoints")

    def reads(self, qcfg):
        return False  # read through an auto-round quantization_config (lowbit.formats.autoround)

    def parse_config(self, qcfg):
        raise FormatError(f"{PACKING} folders are read through their auto-round quantization_config")

    def read_linear(self, prefix, tensors, scheme, dtype=torch.bfloat16, config=None, shape=None):
        return read_gptq_linear(prefix, tensors, scheme, shape)

