"""auto-round ``auto_round:fake`` folders: the ``fake`` layout plus auto-round's ``act_max_scale``.

auto-round saves a fake-quantized model with ``save_pretrained``: each quantized Linear ``P``
keeps ``P.weight`` (already quantized-dequantized, model dtype) and ``P.bias``; a layer with
static activations also keeps ``P.act_max_scale`` (float32 [1]), the clip multiplier auto-round
tunes (1.0 after RTN), which is not a scale. The calibrated static scales (``act_max``) are not
exported, and auto-round's own loader (FakeActQuantLinear) ignores ``act_dynamic: false``: it
quantizes every input at run time. For FP8 E4M3 inputs per tensor (FP8_STATIC) that is
scale = max(max|x| / 448, 1 / (448 * 512)) over the whole input of each call.

Read here the same way: a static per-tensor E4M3 input spec with ``act_max_scale`` and no
``P.input_scale`` tensor becomes ``dynamic_tensor_inputs(scheme)`` (dynamic per tensor, that
floor), with a warning once per folder; a folder that does hold ``P.input_scale`` tensors keeps
those static scales. ``act_max_scale`` is checked (one finite float) and otherwise unused, as
auto-round's loader leaves it unused.
"""

from __future__ import annotations

import dataclasses

import torch

from lowbit.errors import FormatError
from lowbit.formats.base import FLOAT_DTYPES, ParsedConfig, check_tensor, where
from lowbit.formats.fake_layout import FakeLayout
from lowbit.numerics import E4M3, FormatName
from lowbit.schemes import Dynamic, Granularity, Scheme

CLIP_SUFFIX = "act_max_scale"

#: the smallest dynamic FP8 input scale auto-round's loader uses (its quant_fp8_sym)
FP8_DYNAMIC_SCALE_FLOOR = 1.0 / (E4M3.max_finite * 512.0)


def is_static_fp8_tensor(scheme: Scheme) -> bool:
    a = scheme.input_activations
    return (a is not None and a.format is FormatName.E4M3 and a.granularity is Granularity.TENSOR
            and a.dynamic is Dynamic.STATIC)


def dynamic_tensor_inputs(scheme: Scheme) -> Scheme:
    """``scheme`` with its static per-tensor FP8 inputs made dynamic per tensor, scales floored
    as auto-round's loader floors them."""
    a = dataclasses.replace(scheme.input_activations, dynamic=Dynamic.DYNAMIC, scale_floor=FP8_DYNAMIC_SCALE_FLOOR)
    return Scheme(f"{scheme.name}-dynamic-tensor-inputs", scheme.weights, a)


class AutoRoundFakeLayout(FakeLayout):
    """Reads auto-round fake folders (only reads: lowbit writes its own ``fake`` format)."""

    def read_linear(self, prefix, tensors, scheme, dtype=torch.bfloat16, config: ParsedConfig | None = None,
                    shape=None):
        k = f"{prefix}.{CLIP_SUFFIX}"
        if k not in tensors:
            return super().read_linear(prefix, tensors, scheme, dtype, config, shape)
        clip = check_tensor(tensors, k, tensors[k], dtypes=FLOAT_DTYPES, what=f"layer {prefix!r} (auto-round fake)")
        if clip.numel() != 1 or not bool(torch.isfinite(clip).all()):
            raise FormatError(f"tensor {where(tensors, k)} must hold one finite float (auto-round's clip "
                              f"multiplier), has shape {tuple(clip.shape)}")
        if not is_static_fp8_tensor(scheme) or f"{prefix}.input_scale" in tensors:
            return super().read_linear(prefix, tensors, scheme, dtype, config, shape)
        dyn = dynamic_tensor_inputs(scheme)
        if config is not None:
            config.warn_once(CLIP_SUFFIX, f"auto-round fake checkpoint: the static FP8 input scales were not exported "
                                          f"(layer {prefix!r} holds only {CLIP_SUFFIX!r}, a clip multiplier); inputs "
                                          f"are quantized dynamically per tensor, as auto-round's loader does "
                                          f"(scale = max|x| / 448 per call, at least 1/(448*512))")
        return dataclasses.replace(super().read_linear(prefix, tensors, dyn, dtype, config, shape), scheme=dyn)


LAYOUT = AutoRoundFakeLayout()
