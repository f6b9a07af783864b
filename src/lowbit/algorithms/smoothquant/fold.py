"""SmoothQuant scales and their folding into the source module and the target weights."""

from __future__ import annotations

import torch
import torch.nn as nn

from lowbit.errors import QuantizationError
from lowbit.algorithms.smoothquant.mappings import SmoothMapping, SourceKind


def smooth_scales(act_max: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """s_j = max|X_j|^alpha / max|W_j|^(1-alpha), max|W_j| over all target weights' column j.

    Channels with a zero activation or weight maximum get s_j = 1 (nothing to balance)."""
    if not 0.0 <= alpha <= 1.0:
        raise QuantizationError(f"SmoothQuant alpha must be in [0, 1], got {alpha}")
    a = act_max.to(torch.float32)
    w = torch.stack([wt.detach().to(torch.float32).abs().amax(0) for wt in weights]).amax(0)
    ok = (a > 0) & (w > 0)
    s = a.clamp_min(1e-12).pow(alpha) / w.clamp_min(1e-12).pow(1.0 - alpha)
    s = torch.where(ok & torch.isfinite(s), s, torch.ones_like(s))
    return s.clamp(1e-5, 1e5)


def _div_param(p: torch.Tensor, s: torch.Tensor) -> None:
    p.data.copy_((p.data.to(torch.float32) / s).to(p.dtype))


@torch.no_grad()
def fold_smoothing(layer: nn.Module, mapping: SmoothMapping, s: torch.Tensor) -> None:
    """Divide the source's output channel j by s_j and multiply the targets' (and the float
    targets') column j by s_j."""
    src = layer.get_submodule(mapping.source)
    s = s.to(torch.float32)
    kind = mapping.kind
    if kind is SourceKind.LINEAR:
        if src.weight.shape[0] != s.numel():
            raise QuantizationError(f"smoothing {mapping.source}: {src.weight.shape[0]} rows, {s.numel()} scales")
        _div_param(src.weight, s.reshape(-1, 1).to(src.weight.device))
        if getattr(src, "bias", None) is not None:
            _div_param(src.bias, s.to(src.bias.device))
    else:
        w = src.weight
        if w.shape != s.shape:
            raise QuantizationError(f"smoothing {mapping.source}: weight shape {tuple(w.shape)}, {s.numel()} scales")
        if kind is SourceKind.RMS_ONE_PLUS:
            w.data.copy_(((1.0 + w.data.to(torch.float32)) / s - 1.0).to(w.dtype))
        else:
            _div_param(w, s)
        if kind is SourceKind.LAYERNORM and getattr(src, "bias", None) is not None:
            _div_param(src.bias, s)
    for t in mapping.targets + mapping.float_targets:
        lin = layer.get_submodule(t)
        lin.weight.data.copy_((lin.weight.data.to(torch.float32) * s.reshape(1, -1)).to(lin.weight.dtype))
