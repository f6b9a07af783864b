"""The named preset schemes. One name per scheme everywhere: API, CLI, files and docs.

Weight observer (``QuantSpec.observer``): ``mse`` (per-group scale search, lowbit.quant.search)
where it measurably helped on SmolLM2-135M, ``max`` where it did not or was not measured
(bench/bench_weight_observer.py, bench/RESULTS-quantize.md "Weight observer"; perplexity change
vs float32 on 8 x 512 held-out tokens of Persuasion, float ppl 47.492, weight-only RTN):

    scheme       max        mse        default
    w4a16        +53.16 %   +46.79 %   mse
    nvfp4a16     +20.74 %   +18.96 %   mse (also nvfp4: the same weight spec)
    others       (not measured in time: loaded machine)    max, as before

A better INT4 rule exists: auto-round's full-range symmetric INT4 (scale = signed extreme / -8,
codes -8..7, the extreme exact at -8) measured +26.95 % on the same windows, far ahead of the
search; it needs negative fp32 scales, which lowbit's formats do not allow today.

The search costs time at quantization only (RTN of the whole model, loaded machine: w4a16
45 s -> 296 s, nvfp4a16 219 s -> 311 s); files and every backend are unchanged by it.
Activation specs always keep ``max``.
"""

from __future__ import annotations

from lowbit.errors import SchemeError
from lowbit.numerics import FormatName as F
from lowbit.schemes.spec import Dynamic, Granularity as G, ObserverKind, QuantSpec, Scheme

MAX, MSE = ObserverKind.MAX, ObserverKind.MSE


def _nvfp4(dynamic: Dynamic = Dynamic.STATIC, observer: ObserverKind = MAX) -> QuantSpec:
    return QuantSpec(F.E2M1, G.GROUP, 16, dynamic=dynamic, scale_format=F.UE4M3, global_scale=True,
                     observer=observer)


def _e5m3(dynamic: Dynamic = Dynamic.STATIC, observer: ObserverKind = MAX) -> QuantSpec:
    return QuantSpec(F.E2M1, G.GROUP, 16, dynamic=dynamic, scale_format=F.UE5M3, observer=observer)


def _mx(elem: F, dynamic: Dynamic = Dynamic.STATIC, observer: ObserverKind = MAX) -> QuantSpec:
    return QuantSpec(elem, G.GROUP, 32, dynamic=dynamic, scale_format=F.E8M0, observer=observer)


PRESETS: dict[str, Scheme] = {
    s.name: s
    for s in [
        Scheme("w8a8-int8", QuantSpec(F.INT8, G.CHANNEL), QuantSpec(F.INT8, G.TENSOR, dynamic=Dynamic.STATIC)),
        Scheme("w8a8-int8-dynamic", QuantSpec(F.INT8, G.CHANNEL), QuantSpec(F.INT8, G.TOKEN, dynamic=Dynamic.DYNAMIC)),
        Scheme("w8a8-fp8", QuantSpec(F.E4M3, G.CHANNEL), QuantSpec(F.E4M3, G.TENSOR, dynamic=Dynamic.STATIC)),
        Scheme("w8a8-fp8-dynamic", QuantSpec(F.E4M3, G.CHANNEL), QuantSpec(F.E4M3, G.TOKEN, dynamic=Dynamic.DYNAMIC)),
        Scheme("nvfp4", _nvfp4(observer=MSE), _nvfp4(Dynamic.LOCAL)),
        Scheme("nvfp4a16", _nvfp4(observer=MSE), None),
        Scheme("nvfp4-e5m3", _e5m3(), _e5m3(Dynamic.DYNAMIC)),
        Scheme("mxfp4", _mx(F.E2M1), _mx(F.E2M1, Dynamic.DYNAMIC)),
        Scheme("mxfp8", _mx(F.E4M3), _mx(F.E4M3, Dynamic.DYNAMIC)),
        Scheme("w4a16", QuantSpec(F.INT4, G.GROUP, 128, observer=MSE), None),
        Scheme("w8a16", QuantSpec(F.INT8, G.CHANNEL), None),
    ]
}


def get_scheme(scheme: str | Scheme) -> Scheme:
    """A preset by name (or a Scheme passed through)."""
    if isinstance(scheme, Scheme):
        return scheme
    try:
        return PRESETS[scheme]
    except KeyError:
        raise SchemeError(f"unknown scheme {scheme!r}; known: {', '.join(PRESETS)}") from None
