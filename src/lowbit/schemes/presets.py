"""The named preset schemes. One name per scheme everywhere: API, CLI, files and docs.

Weight observer (``QuantSpec.observer``) of each preset, chosen on SmolLM2-135M perplexity
(weight-only RTN; the figures, with their dates, in bench/quantize/RESULTS-quantize.md, "Weight observer"):

- ``full-range`` for INT4 (w4a16): scale = the group's signed extreme / -8, auto-round's symmetric
  INT4 rule (codes -8..7, the signed extreme exact at -8, so the scale is negative when the
  extreme is positive; every format stores fp32 scales with their sign);
- ``mse`` (per-group scale search, lowbit.quant.mse_scales) for nvfp4a16 and nvfp4 (one weight spec);
- ``half-step`` for the INT8 weights of w8a8-int8-dynamic and w8a16 (scale = amax / 127.5: the
  symmetric rule of compressed-tensors' minmax and torchao);
- ``max`` for every other preset.

The search costs time at quantization only; files and every backend are unchanged by it.
Activation specs always keep ``max``.
"""

from __future__ import annotations

from lowbit.errors import SchemeError
from lowbit.numerics import FormatName as F
from lowbit.schemes.spec import Dynamic, Granularity as G, WeightObserver, QuantSpec, Scheme

MAX, MSE, FULL_RANGE, HALF_STEP = WeightObserver.MAX, WeightObserver.MSE, WeightObserver.FULL_RANGE, WeightObserver.HALF_STEP


def _nvfp4(dynamic: Dynamic = Dynamic.STATIC, observer: WeightObserver = MAX) -> QuantSpec:
    return QuantSpec(F.E2M1, G.GROUP, 16, dynamic=dynamic, scale_format=F.UE4M3, global_scale=True,
                     observer=observer)


def _e5m3(dynamic: Dynamic = Dynamic.STATIC, observer: WeightObserver = MAX) -> QuantSpec:
    return QuantSpec(F.E2M1, G.GROUP, 16, dynamic=dynamic, scale_format=F.UE5M3, observer=observer)


def _mx(elem: F, dynamic: Dynamic = Dynamic.STATIC, observer: WeightObserver = MAX) -> QuantSpec:
    return QuantSpec(elem, G.GROUP, 32, dynamic=dynamic, scale_format=F.E8M0, observer=observer)


PRESETS: dict[str, Scheme] = {
    s.name: s
    for s in [
        Scheme("w8a8-int8", QuantSpec(F.INT8, G.CHANNEL), QuantSpec(F.INT8, G.TENSOR, dynamic=Dynamic.STATIC)),
        Scheme("w8a8-int8-dynamic", QuantSpec(F.INT8, G.CHANNEL, observer=HALF_STEP),
               QuantSpec(F.INT8, G.TOKEN, dynamic=Dynamic.DYNAMIC)),
        Scheme("w8a8-fp8", QuantSpec(F.E4M3, G.CHANNEL), QuantSpec(F.E4M3, G.TENSOR, dynamic=Dynamic.STATIC)),
        Scheme("w8a8-fp8-dynamic", QuantSpec(F.E4M3, G.CHANNEL), QuantSpec(F.E4M3, G.TOKEN, dynamic=Dynamic.DYNAMIC)),
        Scheme("fp8-block", QuantSpec(F.E4M3, G.BLOCK, 128), QuantSpec(F.E4M3, G.GROUP, 128, dynamic=Dynamic.DYNAMIC)),
        Scheme("nvfp4", _nvfp4(observer=MSE), _nvfp4(Dynamic.LOCAL)),
        Scheme("nvfp4a16", _nvfp4(observer=MSE), None),
        Scheme("nvfp4-e5m3", _e5m3(), _e5m3(Dynamic.DYNAMIC)),
        Scheme("mxfp4", _mx(F.E2M1), _mx(F.E2M1, Dynamic.DYNAMIC)),
        Scheme("mxfp8", _mx(F.E4M3), _mx(F.E4M3, Dynamic.DYNAMIC)),
        Scheme("mxfp6-e2m3", _mx(F.E2M3), None),
        Scheme("mxfp6-e3m2", _mx(F.E3M2), None),
        Scheme("mxfp6-mxfp8", _mx(F.E2M3), _mx(F.E4M3, Dynamic.DYNAMIC)),
        Scheme("mxfp4-mxfp8", _mx(F.E2M1), _mx(F.E4M3, Dynamic.DYNAMIC)),
        Scheme("w4a16", QuantSpec(F.INT4, G.GROUP, 128, observer=FULL_RANGE), None),
        Scheme("w4a16-asym", QuantSpec(F.INT4, G.GROUP, 128, symmetric=False), None),
        Scheme("w4a8-int8", QuantSpec(F.INT4, G.GROUP, 128, observer=FULL_RANGE),
               QuantSpec(F.INT8, G.TOKEN, dynamic=Dynamic.DYNAMIC)),
        Scheme("w4a8-fp8", QuantSpec(F.INT4, G.GROUP, 128, observer=FULL_RANGE),
               QuantSpec(F.E4M3, G.TOKEN, dynamic=Dynamic.DYNAMIC)),
        Scheme("w8a16", QuantSpec(F.INT8, G.CHANNEL, observer=HALF_STEP), None),
    ]
}


def get_scheme(scheme: str | Scheme) -> Scheme:
    """A preset by name (or a Scheme passed through). SchemeError for an unknown name (listing the
    known ones) or anything else (one line naming its type, never its repr: it may be a tensor or
    a whole model)."""
    if isinstance(scheme, Scheme):
        return scheme
    if not isinstance(scheme, str):
        raise SchemeError(f"scheme must be a scheme name or a Scheme, not {type(scheme).__name__}")
    try:
        return PRESETS[scheme]
    except KeyError:
        raise SchemeError(f"unknown scheme {scheme!r}; known: {', '.join(PRESETS)}") from None
