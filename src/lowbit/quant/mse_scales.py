"""MSE-optimal weight scales (the ``mse`` observer): a pure function on tensors.

Per scale group (channel, group, block or whole tensor), the candidate scale whose
quantize-dequantize has the smallest squared error on the group's own values. The first
candidate is always the ``max`` rule's scale, and a later candidate replaces the running best
only when its error is strictly smaller: a group that the max rule already quantizes exactly
keeps its scale, and a search never has a larger error than the max rule.

Candidates, by scale format:

- FP32 scales (INT or FP elements), symmetric: scale_r = (amax * r) / elem_max for r in
  ``RATIOS`` (1.0 first); for INTn, from r = qmax / (qmax + 1) down, a negative extreme
  can use the code -2^(n-1) (the clamp saturates there). Asymmetric INT: the range
  (min * r, max * r) through the asymmetric rule. The ``full-range-mse`` observer (symmetric
  INT): the full-range rule's signed scale (extreme / qmin) times r, so every candidate keeps
  the extreme's side on the code qmin (clipped there for r < 1).
- UE4M3 / UE5M3 block scales (with or without the NVFP4 global scale, which stays
  amax-based): the max rule's code c, then c-1, c-2, c-3 (never below the smallest positive
  code) and c+1 (never above the largest finite code), ``CODE_STEPS``.
- E8M0 block scales (MX): the OCP floor exponent, then exponent + 1 (the floor rule
  saturates the top of the block; one binade up may do better), ``E8M0_STEPS``.

The error of a candidate is sum((qdq(x / eff) * eff - x)^2) over the group (each square times
a given per-element weight when the caller passes one: GPTQ weights by the Hessian diagonal), computed exactly
as the quantizer does in float32; the squares are summed in float64 so that near-ties do not
depend on how many rows are quantized at once (the model-free path quantizes row bands).
The search is vectorized over all groups and evaluates one candidate at a time (memory: a
few float32 copies of the tensor), so it is deterministic and bounded.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import torch

from lowbit.numerics import E8M0, FormatName, IntFormat, get_format
from lowbit.quant.groups import reduce_groups
from lowbit.kernels.rounding import round_nearest_, supports
from lowbit.quant.scale_rules import asymmetric_from_range, effective_scale, group_range, scales_from_amax
from lowbit.schemes import Dynamic, QuantSpec, WeightObserver

RATIOS: tuple[float, ...] = tuple(round(1.0 - 0.02 * i, 2) for i in range(16))  # 1.00, 0.98, ... 0.70
CODE_STEPS: tuple[int, ...] = (0, -1, -2, -3, 1)
E8M0_STEPS: tuple[int, ...] = (0, 1)

Candidate = tuple[torch.Tensor, "torch.Tensor | None"]

def searching(spec: QuantSpec) -> QuantSpec:
    """``spec`` with the observer that searches around its rule (max -> mse, full-range ->
    full-range-mse); a spec that already searches, whose rule has no searched variant
    (half-step), whose scales are not chosen from the weights (dynamic) or that floors its
    scales is returned as it is."""
    obs = next((o for o in WeightObserver if o.searches and o.rule is spec.observer), None)
    if obs is None or spec.dynamic is not Dynamic.STATIC or spec.scale_floor is not None:
        return spec
    return dataclasses.replace(spec, observer=obs)


def search_scales(
    v: torch.Tensor,
    spec: QuantSpec,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    global_scale: torch.Tensor | None,
    weights: torch.Tensor | None = None,
) -> Candidate:
    """The per-group (scale, zero_point) with the smallest squared error.

    v: the float32 group view [..., G, g] of a finite tensor (lowbit.quant.groups.group_view).
    scale, zero_point: the max rule's scales (and asymmetric zero points) of ``v`` under
        ``spec``: the first candidate, kept on ties.
    global_scale: the NVFP4 divisor when the spec has one (unchanged by the search).
    weights: None (plain squared error) or non-negative float32 weights broadcastable to ``v``,
        one per element (GPTQ: each input column's Hessian diagonal, so that an error counts by
        the energy of the input it multiplies); each squared error is multiplied by its weight.
    """
    best_s, best_zp = scale, zero_point
    best_err = group_error(v, spec, scale, zero_point, global_scale, weights)
    for s, zp in _candidates(v, spec, scale):
        err = group_error(v, spec, s, zp, global_scale, weights)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better, s, best_s)
        if zp is not None:
            best_zp = torch.where(better, zp, best_zp)
    return best_s, best_zp


def group_error(
    v: torch.Tensor,
    spec: QuantSpec,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    global_scale: torch.Tensor | None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Squared quantize-dequantize error of each scale group of ``v`` (float64, scale shape),
    each element's square times its entry of ``weights`` when given (see ``search_scales``)."""
    fmt = get_format(spec.format)
    eff = effective_scale(scale.to(torch.float32), spec, global_scale)
    divisor = torch.where(eff != 0, eff, torch.ones_like(eff)).unsqueeze(-1)
    t = v / divisor
    if isinstance(fmt, IntFormat):  # IntFormat.round (v is finite: no NaN check), in place
        if zero_point is None:
            t.round_().clamp_(fmt.qmin, fmt.qmax)
        else:
            zp = zero_point.to(torch.float32).unsqueeze(-1)
            t.round_().add_(zp).clamp_(fmt.qmin, fmt.qmax).sub_(zp)
    elif supports(fmt):  # fmt.qdq up to the sign of zero, which the squares do not see
        round_nearest_(t, fmt)
    else:
        t = fmt.qdq(t)
    t.mul_(eff.unsqueeze(-1)).sub_(v)  # a zero scale dequantizes to zero, as quantize does
    t.mul_(t)
    if weights is not None:
        t.mul_(weights)
    return reduce_groups(t, spec, lambda x, dim: x.sum(dim, dtype=torch.float64))


def _candidates(v: torch.Tensor, spec: QuantSpec, scale: torch.Tensor) -> Iterator[Candidate]:
    """The candidates after the first one (the observer's rule, ``scale``), one at a time."""
    sf = spec.scale_format
    if sf is FormatName.FP32:
        fmt = get_format(spec.format)
        full_range = spec.observer.rule is WeightObserver.FULL_RANGE
        if spec.symmetric and not full_range:
            a = reduce_groups(v.abs(), spec, lambda t, d: t.amax(d))
        elif not spec.symmetric:
            lo, hi = group_range(v, spec)
        for r in RATIOS[1:]:
            rt = torch.tensor([r], dtype=torch.float32, device=v.device)
            if full_range:  # ``scale``: the full-range rule's, signed
                yield scale * rt, None
            elif spec.symmetric:
                yield scales_from_amax(a * rt, spec), None
            else:
                assert isinstance(fmt, IntFormat)
                yield asymmetric_from_range(lo * rt, hi * rt, fmt)
    elif sf is FormatName.E8M0:
        code = E8M0.encode(scale).to(torch.int32)
        for k in E8M0_STEPS[1:]:
            c = torch.clamp(code + k, 0, E8M0.max_code_magnitude)
            yield E8M0.decode(c.to(torch.uint8)), None
    else:  # UE4M3 / UE5M3
        sfmt = get_format(sf)
        code = sfmt.encode(scale).to(torch.int32)
        for k in CODE_STEPS[1:]:
            if k < 0:  # not below the smallest positive code (a zero scale stays zero)
                c = torch.where(code > 0, torch.clamp(code + k, min=1), code)
            else:
                c = torch.clamp(code + k, max=sfmt.max_code_magnitude)
            yield sfmt.decode(c.to(torch.uint8)), None
