"""Per-layer signal-to-quantization-noise ratio and model size, for the compare report.

SQNR of a quantized linear: run the float model on a sample; at every linear that the
quantized model replaced, feed the float input to both the float linear and the quantized one
(so each layer's error is its own, not accumulated from earlier layers) and take
``10 log10(sum y^2 / sum (y - y_q)^2)`` over the sample. Every MoE expert is fed every token of
the sample (``lowbit.moe.all_tokens``), so that each one is measured, routed to or not.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from lowbit.eval.scoring import hidden_states
from lowbit.modules import QuantLinear
from lowbit.moe import all_tokens
from lowbit.numerics import FormatName


def quantized_linears(model: nn.Module) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def sqnr_db(signal: float, noise: float) -> float:
    if noise <= 0.0:
        return math.inf
    if signal <= 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


@torch.no_grad()
def layer_sqnr(float_model: nn.Module, qmodel: nn.Module, input_ids: torch.Tensor) -> dict[str, float]:
    """SQNR in dB of each QuantLinear of ``qmodel`` against the float linear of the same name,
    both fed the float model's input to that layer. Keys in model order."""
    qmods = quantized_linears(qmodel)
    sums: dict[str, list[float]] = {n: [0.0, 0.0] for n in qmods}
    handles = []
    for name, qm in qmods.items():
        lin = float_model.get_submodule(name)

        def hook(mod, args, out, name=name, qm=qm):
            y = out.double()
            yq = qm(args[0]).double()
            sums[name][0] += float(y.pow(2).sum())
            sums[name][1] += float((y - yq).pow(2).sum())

        handles.append(lin.register_forward_hook(hook))
    try:
        with all_tokens(float_model):  # MoE: every expert is measured on every token, not only its routed ones
            hidden_states(float_model, input_ids)
    finally:
        for h in handles:
            h.remove()
    return {n: sqnr_db(s, e) for n, (s, e) in sums.items()}


def _scale_bytes(fmt: FormatName) -> int:
    return 4 if fmt is FormatName.FP32 else 1


def estimated_size_bytes(model: nn.Module) -> int:
    """Bytes of the model's persistent tensors with quantized weights packed at their bit width
    (4-bit codes two per byte, low-bit block scales one byte each); shared tensors (tied
    embeddings) count once."""
    seen: set[int] = set()
    total = 0
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            spec = mod.scheme.weights
            total += math.ceil(mod.weight_codes.numel() * spec.bits / 8)
            total += mod.weight_scale.numel() * _scale_bytes(spec.scale_format)
            for t in (mod.weight_zero_point, mod.weight_global_scale, mod.input_scale, mod.input_global_scale):
                if t is not None:
                    total += t.numel() * t.element_size()
            if mod.bias is not None:
                total += mod.bias.numel() * mod.bias.element_size()
            continue
        tensors = list(mod.named_parameters(recurse=False))
        skip = getattr(mod, "_non_persistent_buffers_set", set())
        tensors += [(n, b) for n, b in mod.named_buffers(recurse=False) if n not in skip and b is not None]
        for _, t in tensors:
            key = t.data_ptr()
            if key in seen:
                continue
            seen.add(key)
            total += t.numel() * t.element_size()
    return total
