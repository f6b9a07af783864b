"""The ``native`` implementation of quantize groups: the reference ``lowbit.quant.qdq.quantize``
in C, reached only through ``quantize`` and ``quantize_into``, which choose it (lowbit.kernels.select).

Group and channel specs (with the global scale given, where the spec has one) take one C call per
band (lowbit.kernels.native.quantize): per-group extremes with a NaN/Inf flag, the scale rule,
the scale codes and the element codes, a few rows at a time. The rule's constants come from
lowbit.quant.scale_rules (``scale_rule``: the divisor, the scale format's key table and code values,
the MX exponent), so each rule keeps one definition; the C loop applies it operation for
operation in float32. Otherwise (tensor-wide specs, a global scale still to compute) two C passes:
the extremes, then the torch rules of lowbit.quant.scale_rules on them (1/16 to 1/128 of the data),
then division by the effective scale and encoding in one pass. Bit-identical to the torch path
(tests/quant/test_native_encode.py). It takes CPU tensors of float32/bfloat16/float16, symmetric specs
with the ``max``, ``half-step`` or ``full-range`` observer, element formats encoded by a key table
or INTn, and no given scale; ``quantize_native`` returns None for anything else (or when the
library is unavailable, or an input needs the reference's error), and the caller runs the torch
path.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from lowbit.kernels import native
from lowbit.numerics import E8M0, FormatName, IntFormat, get_format
from lowbit.quant.groups import check_finite, num_groups
from lowbit.quant.qtensor import PackedQuantizedTensor, QuantizedTensor
from lowbit.quant.scale_rules import (
    amax_divisor, effective_scale, elem_max, full_range_from_range, global_scale_from_amax, mx_emax,
    scales_and_codes_from_amax,
)
from lowbit.schemes import Granularity, WeightObserver, QuantSpec

OBSERVERS = (WeightObserver.MAX, WeightObserver.HALF_STEP, WeightObserver.FULL_RANGE)  # half-step: max's extremes


def supports(x: torch.Tensor, spec: QuantSpec) -> bool:
    """Whether ``quantize_native`` takes ``x`` under ``spec`` (before trying the library)."""
    fmt = get_format(spec.format)
    return (spec.symmetric and spec.observer in OBSERVERS and spec.scale_floor is None and x.dim() >= 1 and x.numel() > 0
            and spec.granularity is not Granularity.BLOCK  # tile extremes span rows: the reference computes them
            and (native.has_table(fmt) or isinstance(fmt, IntFormat)) and native.usable(x))


@lru_cache(maxsize=None)
def scale_rule(spec: QuantSpec) -> native.ScaleRule | None:
    """``spec``'s scale rule as the one-call kernel (native.quantize) applies it: the constants of
    lowbit.quant.scale_rules for the observer and scale format (None: not one it applies)."""
    if spec.observer is WeightObserver.FULL_RANGE:
        return native.ScaleRule(native.RULE_FULL_RANGE, float(get_format(spec.format).qmin))
    sf = spec.scale_format
    if sf is FormatName.FP32:
        return native.ScaleRule(native.RULE_DIVIDE, amax_divisor(spec))
    if sf is FormatName.E8M0:
        return native.ScaleRule(native.RULE_E8M0, scale_values=E8M0.code_values(), e8m0_emax=mx_emax(spec),
                                e8m0_max=E8M0.max_code_magnitude)
    fmt = get_format(sf)
    if not native.has_table(fmt):
        return None
    return native.ScaleRule(native.RULE_TABLE, elem_max(spec), fmt.key_table, fmt.code_values())


def _quantize_fused(x2: torch.Tensor, spec: QuantSpec, rule: native.ScaleRule, g: int,
                    global_scale: torch.Tensor | None, name: str, pack: bool, out: torch.Tensor | None,
                    x: torch.Tensor) -> QuantizedTensor | None:
    r = native.quantize(x2, g, rule, global_scale if spec.global_scale else None, get_format(spec.format),
                        pack=pack, out=out)
    if r is None:
        return None
    if r == 1:
        check_finite(x, name)  # NaN/Inf: raises the QuantizationError naming the tensor
        return None  # a value the reference encoder refuses: the torch path gives its error
    codes, scale, scale_codes = r
    return _result(x, spec, codes, scale, scale_codes, global_scale, pack)


def _result(x: torch.Tensor, spec: QuantSpec, codes: torch.Tensor, scale: torch.Tensor,
            scale_codes: torch.Tensor | None, global_scale: torch.Tensor | None, pack: bool) -> QuantizedTensor:
    """The QuantizedTensor of x from the 2-D results of the kernels (codes [rows, ...], scales and
    their codes [rows, G], or [1] for a tensor-wide spec): x's leading dimensions restored."""
    lead = tuple(x.shape[:-1])
    if spec.granularity is not Granularity.TENSOR:
        scale = scale.reshape(*lead, scale.shape[-1])
        scale_codes = None if scale_codes is None else scale_codes.reshape(*lead, scale.shape[-1])
    gs = global_scale.reshape(1).to(torch.float32) if spec.global_scale else None
    return (PackedQuantizedTensor if pack else QuantizedTensor)(codes.reshape(*lead, codes.shape[-1]), scale, spec,
                                                              None, gs, scale_codes)


def quantize_native(x: torch.Tensor, spec: QuantSpec, global_scale: torch.Tensor | None = None,
                    name: str = "tensor", *, pack: bool = False,
                    out: torch.Tensor | None = None) -> QuantizedTensor | None:
    """What ``quantize(x, spec, global_scale=...)`` gives, or None (then the torch path decides).

    ``pack``: the codes nibble-packed as they are encoded (a 4-bit format, even last dimension),
    returned as a PackedQuantizedTensor. ``out``: where the (packed) codes go, contiguous uint8,
    e.g. a slice of a whole-tensor buffer being filled band by band."""
    if not supports(x, spec):
        return None
    n = x.shape[-1]
    num_groups(n, spec, name, tuple(x.shape))  # the torch path's error for a ragged micro block
    g = spec.group_size if spec.granularity is Granularity.GROUP else n
    x2 = x.reshape(-1, n).contiguous()
    tensor_wide = spec.granularity is Granularity.TENSOR
    if not tensor_wide and (global_scale is not None or not spec.global_scale):
        rule = scale_rule(spec)
        if rule is not None:  # one call: extremes, scales and codes
            return _quantize_fused(x2, spec, rule, g, global_scale, name, pack, out, x)
    if spec.observer is WeightObserver.FULL_RANGE:
        r = native.group_minmax(x2, g)
        if r is None:
            return None
        lo, hi, bad = r
    else:
        r = native.group_amax(x2, g)
        if r is None:
            return None
        a, bad = r
    if bad:
        check_finite(x, name)  # raises the QuantizationError naming the tensor
        return None  # pragma: no cover - the flag and check_finite agree
    scale_codes = None
    if spec.observer is WeightObserver.FULL_RANGE:
        if tensor_wide:
            lo, hi = lo.amin().reshape(1), hi.amax().reshape(1)
        scale = full_range_from_range(lo, hi, spec)
    else:
        if spec.global_scale and global_scale is None:
            global_scale = global_scale_from_amax(a.amax(), spec)
        scale, scale_codes = scales_and_codes_from_amax(a.amax().reshape(1) if tensor_wide else a, spec, global_scale)
    eff = effective_scale(scale, spec, global_scale).to(torch.float32)
    eff2 = eff.expand(x2.shape[0], 1) if tensor_wide else eff
    codes = native.encode(x2, g, eff2.contiguous(), get_format(spec.format), pack=pack, out=out)
    if codes is None:
        return None
    return _result(x, spec, codes, scale, scale_codes, global_scale, pack)
