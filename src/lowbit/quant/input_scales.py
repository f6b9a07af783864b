"""Static input (activation) scales from a calibrated amax, and the activation QDQ they imply."""

from __future__ import annotations

import torch

from lowbit.quant.qdq import fake_quantize, global_scale_from_amax, static_scale_from_amax
from lowbit.schemes import Dynamic, QuantSpec


def input_scales_from_amax(spec: QuantSpec | None, amax: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """QuantLinear.set_input_scales kwargs: ``input_scale`` (static per-tensor INT8/FP8) and/or
    ``input_global_scale`` (NVFP4 inputs, 448*6/amax). Empty for dynamic or absent inputs."""
    if spec is None or amax is None:
        return {}
    a = amax.to(torch.float32).reshape(-1).amax().reshape(1)
    out: dict[str, torch.Tensor] = {}
    if spec.dynamic is Dynamic.STATIC:
        out["input_scale"] = static_scale_from_amax(a, spec)
    if spec.global_scale:
        out["input_global_scale"] = global_scale_from_amax(a, spec)
    return out


def qdq_activation(x: torch.Tensor, spec: QuantSpec | None, amax: torch.Tensor | None = None) -> torch.Tensor:
    """x as a layer with calibrated amax ``amax`` would see it (dynamic specs ignore amax)."""
    if spec is None:
        return x.to(torch.float32)
    sc = input_scales_from_amax(spec, amax) if spec.needs_calibration else {}
    return fake_quantize(x, spec, scale=sc.get("input_scale"), global_scale=sc.get("input_global_scale"))
