"""Quantize a model in memory: ``lowbit.quantize(model, scheme, ...)``.

Without calibration this is plain round-to-nearest of every target linear (the model-free
path must reproduce it bit for bit). NVFP4 weight global scales are shared across fused
siblings (q/k/v, gate/up): the amax is taken over the group.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

from lowbit.errors import QuantizationError
from lowbit.fusion import fused_groups, shared_amax
from lowbit.modules import QuantLinear
from lowbit.quant import global_scale_from_amax
from lowbit.schemes import Scheme, get_scheme
from lowbit.targets import quantizable_linears


def set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def shared_weight_global_scales(weights: dict[str, torch.Tensor], scheme: Scheme) -> dict[str, torch.Tensor]:
    """NVFP4-style weight global scales, one per fused group (empty if the spec has none)."""
    spec = scheme.weights
    if not spec.global_scale:
        return {}
    out: dict[str, torch.Tensor] = {}
    for group in fused_groups(list(weights)):
        gs = global_scale_from_amax(shared_amax([weights[n] for n in group]), spec)
        for n in group:
            out[n] = gs
    return out


@torch.no_grad()
def quantize_rtn(model: nn.Module, scheme: Scheme | str, *, ignore: Iterable[str] = (),
                 include_lm_head: bool = False, names: list[str] | None = None) -> nn.Module:
    """Replace target linears with QuantLinear by round-to-nearest (no activation scales)."""
    scheme = get_scheme(scheme)
    if names is None:
        names = quantizable_linears(model, ignore, include_lm_head)
    linears = {n: model.get_submodule(n) for n in names}
    gscales = shared_weight_global_scales({n: m.weight for n, m in linears.items()}, scheme)
    for n, lin in linears.items():
        q = QuantLinear.from_linear(lin, scheme, name=n, weight_global_scale=gscales.get(n))
        set_submodule(model, n, q)
    return model


def quantize(model: nn.Module, scheme: Scheme | str, calibration=None, *, ignore: Iterable[str] = (),
             include_lm_head: bool = False, **kwargs) -> nn.Module:
    """Quantize ``model`` in place and return it.

    Schemes that need no calibration (weight-only, dynamic activations) are round-to-nearest
    when ``calibration`` is None.
    """
    scheme = get_scheme(scheme)
    if calibration is None and not kwargs:
        if scheme.needs_calibration:
            raise QuantizationError(
                f"scheme {scheme.name} has static activation scales and needs calibration data "
                f"(pass calibration=...)"
            )
        return quantize_rtn(model, scheme, ignore=ignore, include_lm_head=include_lm_head)
    raise NotImplementedError("calibrated quantization is provided by lowbit.calibration")
