"""Schemes and quantization specs: presets, JSON round trips, validation."""

from __future__ import annotations

import json

import pytest
import torch

from lowbit.errors import SchemeError
from lowbit.numerics import FormatName as F
from lowbit.schemes import PRESETS, Dynamic, Granularity as G, QuantSpec, Scheme, get_scheme

SPEC_FIELDS = {"format", "granularity", "group_size", "symmetric", "dynamic", "scale_format", "global_scale",
               "observer", "scale_floor"}
EXPECTED_PRESETS = {
    "w8a8-int8", "w8a8-int8-dynamic", "w8a8-fp8", "w8a8-fp8-dynamic", "nvfp4", "nvfp4a16",
    "nvfp4-e5m3", "mxfp4", "mxfp8", "w4a16", "w8a16", "w4a16-asym", "w4a8-int8", "w4a8-fp8",
    "mxfp6-e2m3", "mxfp6-e3m2", "mxfp6-mxfp8", "mxfp4-mxfp8", "fp8-block",
}


def _valid_dict(**overrides):
    d = QuantSpec(F.INT4, G.GROUP, 128).to_dict()
    d.update(overrides)
    return d


# ---------------------------------------------------------------------------- presets
def test_preset_names():
    assert set(PRESETS) == EXPECTED_PRESETS
    for name, s in PRESETS.items():
        assert s.name == name
        assert get_scheme(name) is s


@pytest.mark.parametrize("name", sorted(EXPECTED_PRESETS))
def test_preset_round_trips_dict_and_json(name):
    s = PRESETS[name]
    d = s.to_dict()
    assert set(d) == {"name", "weights", "input_activations"}
    assert set(d["weights"]) == SPEC_FIELDS
    if s.input_activations is not None:
        assert set(d["input_activations"]) == SPEC_FIELDS
    else:
        assert d["input_activations"] is None
    assert Scheme.from_dict(d) == s
    text = json.dumps(d)
    back = Scheme.from_dict(json.loads(text))
    assert back == s and back.to_dict() == d
    assert json.dumps(back.to_dict()) == text
    # JSON-native values only (enums written as their strings)
    for spec in (d["weights"], d["input_activations"] or {}):
        for v in spec.values():
            assert v is None or type(v) in (str, int, bool)


@pytest.mark.parametrize("name", sorted(EXPECTED_PRESETS))
def test_preset_specs_round_trip_individually(name):
    s = PRESETS[name]
    for spec in (s.weights, s.input_activations):
        if spec is None:
            continue
        d = spec.to_dict()
        assert QuantSpec.from_dict(d) == spec
        assert QuantSpec.from_dict(json.loads(json.dumps(d))) == spec
    assert s.weights.dynamic is Dynamic.STATIC


def test_preset_contents():
    nv = PRESETS["nvfp4"]
    assert nv.weights.to_dict() == {"format": "e2m1", "granularity": "group", "group_size": 16, "symmetric": True,
                                    "dynamic": "static", "scale_format": "ue4m3", "global_scale": True,
                                    "observer": "mse", "scale_floor": None}
    assert nv.input_activations.dynamic is Dynamic.LOCAL and nv.input_activations.global_scale
    assert nv.needs_calibration and not nv.weight_only
    e5 = PRESETS["nvfp4-e5m3"]
    assert e5.weights.scale_format is F.UE5M3 and not e5.weights.global_scale and e5.weights.group_size == 16
    assert e5.input_activations.dynamic is Dynamic.DYNAMIC and not e5.needs_calibration
    for mx, elem in (("mxfp4", F.E2M1), ("mxfp8", F.E4M3)):
        w = PRESETS[mx].weights
        assert (w.format, w.group_size, w.scale_format, w.global_scale) == (elem, 32, F.E8M0, False)
    assert PRESETS["w4a16"].weight_only and PRESETS["w4a16"].weights.group_size == 128
    assert PRESETS["w4a16"].weights.bits == 4 and PRESETS["nvfp4a16"].weight_only
    assert PRESETS["w8a8-int8"].needs_calibration and not PRESETS["w8a8-int8-dynamic"].needs_calibration
    assert PRESETS["w8a8-fp8-dynamic"].input_activations.granularity is G.TOKEN
    assert PRESETS["w8a8-int8"].weights.is_integer and not PRESETS["w8a8-fp8"].weights.is_integer
    assert nv.weights.is_microscaled and not PRESETS["w8a16"].weights.is_microscaled
    assert not PRESETS["w8a16"].needs_calibration


def test_get_scheme_unknown_and_passthrough():
    with pytest.raises(SchemeError, match="nvfp4"):  # lists the known names
        get_scheme("int3-magic")
    custom = Scheme("custom", QuantSpec(F.INT8, G.CHANNEL))
    assert get_scheme(custom) is custom


@pytest.mark.parametrize("value,kind", [(torch.zeros(300, 300), "Tensor"), (["nvfp4"], "list"), (None, "NoneType"),
                                        (torch.nn.Linear(64, 64), "Linear")])
def test_get_scheme_of_another_object_is_one_line_naming_its_type(value, kind):
    """Not its repr (a tensor or a model prints thousands of characters), and a SchemeError for
    unhashable values too."""
    with pytest.raises(SchemeError) as e:
        get_scheme(value)
    assert str(e.value) == f"scheme must be a scheme name or a Scheme, not {kind}"


def test_describe():
    assert PRESETS["nvfp4"].weights.describe() == "e2m1, group 16, ue4m3 scales, + fp32 global, mse observer"
    assert QuantSpec(F.INT8, G.CHANNEL, symmetric=False).describe() == "int8, per channel, asymmetric"
    assert PRESETS["mxfp4"].weights.describe() == "e2m1, group 32, e8m0 scales"


def test_strings_normalised_to_enums():
    s = QuantSpec("int8", "token", dynamic="dynamic")
    assert s == QuantSpec(F.INT8, G.TOKEN, dynamic=Dynamic.DYNAMIC)
    assert s.format is F.INT8 and s.granularity is G.TOKEN and s.dynamic is Dynamic.DYNAMIC
    assert s.scale_format is F.FP32


# ---------------------------------------------------------------------------- from_dict errors
@pytest.mark.parametrize("field", sorted(SPEC_FIELDS - {"scale_floor"}))  # absent scale_floor: files before it
def test_missing_field_refused(field):
    d = _valid_dict()
    del d[field]
    with pytest.raises(SchemeError, match=field):
        QuantSpec.from_dict(d)


def test_unknown_field_refused():
    with pytest.raises(SchemeError, match="clip_ratio"):
        QuantSpec.from_dict(_valid_dict(clip_ratio=0.9))


@pytest.mark.parametrize("field,value", [
    ("format", "int9"), ("format", "fp4"), ("granularity", "row"), ("dynamic", "sometimes"),
    ("scale_format", "e9m9"), ("dynamic", True), ("observer", "minmax"), ("observer", "percentile"),
    ("observer", None), ("observer", True),
])
def test_bad_enum_value_refused(field, value):
    with pytest.raises(SchemeError):
        QuantSpec.from_dict(_valid_dict(**{field: value}))


@pytest.mark.parametrize("field,value", [
    ("symmetric", "false"), ("symmetric", 0), ("global_scale", "yes"), ("group_size", "128"),
    ("group_size", 128.0), ("group_size", True),
])
def test_bad_field_types_refused(field, value):
    with pytest.raises(SchemeError, match=field):
        QuantSpec.from_dict(_valid_dict(**{field: value}))


def test_scheme_from_dict_errors():
    good = PRESETS["nvfp4"].to_dict()
    for key in list(good):
        d = dict(good)
        del d[key]
        with pytest.raises(SchemeError):
            Scheme.from_dict(d)
    with pytest.raises(SchemeError):
        Scheme.from_dict({**good, "extra": 1})
    with pytest.raises(SchemeError):
        Scheme.from_dict({**good, "weights": None})
    with pytest.raises(SchemeError):
        Scheme.from_dict([1, 2, 3])
    bad_w = dict(good["weights"], format="e7m7")
    with pytest.raises(SchemeError):
        Scheme.from_dict({**good, "weights": bad_w})
    # weights must be static
    dyn_w = PRESETS["w8a8-int8-dynamic"].input_activations.to_dict()
    with pytest.raises(SchemeError, match="statically"):
        Scheme.from_dict({**good, "weights": dyn_w})


# ---------------------------------------------------------------------------- invalid combinations
@pytest.mark.parametrize("kwargs,match", [
    (dict(format=F.UE4M3, granularity=G.CHANNEL), "scale format"),
    (dict(format=F.E8M0, granularity=G.CHANNEL), "scale format"),
    (dict(format=F.FP32, granularity=G.CHANNEL), "scale format"),
    (dict(format=F.INT4, granularity=G.GROUP), "group_size"),
    (dict(format=F.INT4, granularity=G.GROUP, group_size=0), "group_size"),
    (dict(format=F.INT4, granularity=G.GROUP, group_size=-16), "group_size"),
    (dict(format=F.INT8, granularity=G.CHANNEL, group_size=128), "group_size"),
    (dict(format=F.E2M1, granularity=G.CHANNEL, scale_format=F.UE4M3), "group"),
    (dict(format=F.E2M1, granularity=G.GROUP, group_size=16, scale_format=F.INT8), "scale format"),
    (dict(format=F.E2M1, granularity=G.GROUP, group_size=16, scale_format=F.E4M3), "scale format"),
    (dict(format=F.E2M1, granularity=G.GROUP, group_size=16, global_scale=True), "global"),
    (dict(format=F.E2M1, granularity=G.GROUP, group_size=32, scale_format=F.E8M0, global_scale=True), "global"),
    (dict(format=F.E4M3, granularity=G.CHANNEL, symmetric=False), "asymmetric"),
    (dict(format=F.INT4, granularity=G.GROUP, group_size=32, symmetric=False, scale_format=F.E8M0), "asymmetric"),
    (dict(format=F.INT4, granularity=G.GROUP, group_size=16, symmetric=False, scale_format=F.UE4M3,
          global_scale=True), "asymmetric"),
    (dict(format=F.E2M1, granularity=G.GROUP, group_size=16, scale_format=F.UE5M3, dynamic=Dynamic.LOCAL), "local"),
    (dict(format=F.INT8, granularity=G.TOKEN), "per-token"),
    (dict(format=F.INT8, granularity=G.TOKEN, dynamic=Dynamic.STATIC), "per-token"),
])
def test_invalid_combinations_refused(kwargs, match):
    with pytest.raises(SchemeError, match=match):
        QuantSpec(**kwargs)
    # and the same through from_dict
    d = QuantSpec(F.INT8, G.CHANNEL).to_dict()
    d.update({k: (v.value if hasattr(v, "value") else v) for k, v in kwargs.items()})
    if "group_size" not in kwargs:
        d["group_size"] = None
    with pytest.raises(SchemeError):
        QuantSpec.from_dict(d)


def test_valid_non_preset_combinations_accepted():
    # integer elements with microscaled symmetric scales, E5M2 groups, asymmetric INT groups
    for spec in [
        QuantSpec(F.INT4, G.GROUP, 32, scale_format=F.E8M0),
        QuantSpec(F.E5M2, G.GROUP, 64),
        QuantSpec(F.INT4, G.GROUP, 64, symmetric=False),
        QuantSpec(F.E2M1, G.GROUP, 32, scale_format=F.UE5M3, dynamic=Dynamic.DYNAMIC),
    ]:
        assert QuantSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_specs_are_frozen_and_hashable():
    s = PRESETS["nvfp4"].weights
    with pytest.raises(AttributeError):
        s.group_size = 32  # type: ignore[misc]
    assert len({s, QuantSpec.from_dict(s.to_dict())}) == 1
