"""The named preset schemes. One name per scheme everywhere: API, CLI, files and docs."""

from __future__ import annotations

from lowbit.errors import SchemeError
from lowbit.numerics import FormatName as F
from lowbit.schemes.spec import Dynamic, Granularity as G, QuantSpec, Scheme


def _nvfp4(dynamic: Dynamic = Dynamic.STATIC) -> QuantSpec:
    return QuantSpec(F.E2M1, G.GROUP, 16, dynamic=dynamic, scale_format=F.UE4M3, global_scale=True)


def _e5m3(dynamic: Dynamic = Dynamic.STATIC) -> QuantSpec:
    return QuantSpec(F.E2M1, G.GROUP, 16, dynamic=dynamic, scale_format=F.UE5M3)


def _mx(elem: F, dynamic: Dynamic = Dynamic.STATIC) -> QuantSpec:
    return QuantSpec(elem, G.GROUP, 32, dynamic=dynamic, scale_format=F.E8M0)


PRESETS: dict[str, Scheme] = {
    s.name: s
    for s in [
        Scheme("w8a8-int8", QuantSpec(F.INT8, G.CHANNEL), QuantSpec(F.INT8, G.TENSOR, dynamic=Dynamic.STATIC)),
        Scheme("w8a8-int8-dynamic", QuantSpec(F.INT8, G.CHANNEL), QuantSpec(F.INT8, G.TOKEN, dynamic=Dynamic.DYNAMIC)),
        Scheme("w8a8-fp8", QuantSpec(F.E4M3, G.CHANNEL), QuantSpec(F.E4M3, G.TENSOR, dynamic=Dynamic.STATIC)),
        Scheme("w8a8-fp8-dynamic", QuantSpec(F.E4M3, G.CHANNEL), QuantSpec(F.E4M3, G.TOKEN, dynamic=Dynamic.DYNAMIC)),
        Scheme("nvfp4", _nvfp4(), _nvfp4(Dynamic.LOCAL)),
        Scheme("nvfp4a16", _nvfp4(), None),
        Scheme("nvfp4-e5m3", _e5m3(), _e5m3(Dynamic.DYNAMIC)),
        Scheme("mxfp4", _mx(F.E2M1), _mx(F.E2M1, Dynamic.DYNAMIC)),
        Scheme("mxfp8", _mx(F.E4M3), _mx(F.E4M3, Dynamic.DYNAMIC)),
        Scheme("w4a16", QuantSpec(F.INT4, G.GROUP, 128), None),
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
