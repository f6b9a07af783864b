"""``smoothquant="auto"``: per mapping, the alpha whose quantized output error is smallest.

For each candidate (every alpha of the grid, and no smoothing at all) the target linears are
quantized as the scheme says (weights RTN, NVFP4 weight global scale shared by the group;
activations with the static scale the candidate implies, or dynamically), and the error
sum_t ||X W_t^T - Q(X/s) Q(W_t diag(s))^T||^2 is measured on sampled calibration rows X.
"""

from __future__ import annotations

import torch

from lowbit.quant.input_scales import qdq_activation
from lowbit.fusion import shared_amax
from lowbit.quant import fake_quantize, global_scale_from_amax
from lowbit.schemes import Scheme
from lowbit.algorithms.smoothquant.fold import smooth_scales


def _qdq_weights(ws: list[torch.Tensor], scheme: Scheme) -> list[torch.Tensor]:
    spec = scheme.weights
    gs = global_scale_from_amax(shared_amax(ws), spec) if spec.global_scale else None
    return [fake_quantize(w, spec, global_scale=gs) for w in ws]


def smoothing_error(x: torch.Tensor, ws: list[torch.Tensor], scheme: Scheme, s: torch.Tensor | None,
                    scale_amax: torch.Tensor) -> float:
    """Relative output error of the targets on rows ``x`` with smoothing ``s`` (None: none).

    scale_amax: per-channel max of |X| over the rows that set static scales."""
    ref = [x @ w.t() for w in ws]
    if s is None:
        xs, wq, amax = x, ws, scale_amax
    else:
        xs, wq, amax = x / s, [w * s for w in ws], scale_amax / s
    xq = qdq_activation(xs, scheme.input_activations, amax.amax().reshape(1))
    num = sum(float((xq @ w.t() - r).pow(2).sum()) for w, r in zip(_qdq_weights(wq, scheme), ref))
    den = sum(float(r.pow(2).sum()) for r in ref)
    return num / max(den, 1e-30)


def search_alpha(x: torch.Tensor, act_max: torch.Tensor, scale_amax: torch.Tensor, ws: list[torch.Tensor],
                 scheme: Scheme, alphas: tuple[float, ...]) -> tuple[float | None, dict]:
    """The best alpha (None: do not smooth) and every candidate's error."""
    x = x.to(torch.float32)
    ws = [w.detach().to(torch.float32) for w in ws]
    errs: dict = {None: smoothing_error(x, ws, scheme, None, scale_amax)}
    for a in alphas:
        errs[a] = smoothing_error(x, ws, scheme, smooth_scales(act_max, ws, a), scale_amax)
    best = min(errs, key=lambda k: errs[k])
    return best, errs
