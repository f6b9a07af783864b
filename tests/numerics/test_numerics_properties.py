"""Property tests (hypothesis) of the number formats: monotonic, sign-symmetric, idempotent,
nearest, and INTn round-half-to-even with saturation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowbit.numerics import (
    E2M1, E4M3, E5M2, E8M0, INT2, INT3, INT4, INT5, INT6, INT7, INT8, UE4M3, UE5M3,
)

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SIGNED = [E2M1, E4M3, E5M2]
UNSIGNED = [UE4M3, UE5M3]
MINIFLOATS = SIGNED + UNSIGNED
INTS = [INT2, INT3, INT4, INT5, INT6, INT7, INT8]

f32 = st.floats(width=32, allow_nan=False, allow_infinity=True)
f32_nonneg = st.floats(min_value=0.0, width=32, allow_nan=False, allow_infinity=True)
f32_lists = st.lists(f32, min_size=1, max_size=64)
f32_nonneg_lists = st.lists(f32_nonneg, min_size=1, max_size=64)
# values near the formats' ranges are the interesting ones: mix in scaled small floats
near = st.builds(lambda m, e: m * 2.0**e, st.floats(-2, 2, width=32), st.integers(-20, 18))
near_nonneg = st.builds(lambda m, e: m * 2.0**e, st.floats(0, 2, width=32), st.integers(-20, 18))
mixed = st.lists(st.one_of(f32, near), min_size=1, max_size=64)
mixed_nonneg = st.lists(st.one_of(f32_nonneg, near_nonneg), min_size=1, max_size=64)


def t(xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


def _ids(fmts):
    return [f.name for f in fmts]


# ---------------------------------------------------------------------------- monotonic
@pytest.mark.parametrize("fmt", SIGNED, ids=_ids(SIGNED))
@SETTINGS
@given(xs=mixed)
def test_signed_encode_is_monotonic(fmt, xs):
    x = torch.sort(t(xs)).values
    v = fmt.qdq(x)
    assert bool((v[1:] >= v[:-1]).all()), (x.tolist(), v.tolist())


@pytest.mark.parametrize("fmt", UNSIGNED, ids=_ids(UNSIGNED))
@SETTINGS
@given(xs=mixed_nonneg)
def test_unsigned_encode_is_monotonic(fmt, xs):
    x = torch.sort(t(xs)).values
    v = fmt.qdq(x)
    codes = fmt.encode(x)
    assert bool((v[1:] >= v[:-1]).all())
    assert bool((codes[1:] >= codes[:-1]).all())  # unsigned codes order like their values


@pytest.mark.parametrize("fmt", INTS, ids=_ids(INTS))
@SETTINGS
@given(xs=st.lists(st.floats(-300, 300, width=32), min_size=1, max_size=64))
def test_int_round_is_monotonic(fmt, xs):
    x = torch.sort(t(xs)).values
    v = fmt.qdq(x)
    assert bool((v[1:] >= v[:-1]).all())


@pytest.mark.parametrize("rounding", ["floor", "nearest"])
@SETTINGS
@given(xs=st.lists(st.floats(min_value=0.0, width=32, allow_nan=False), min_size=1, max_size=64))
def test_e8m0_is_monotonic(rounding, xs):
    x = torch.sort(t(xs)).values
    codes = E8M0.encode(x, rounding)
    assert bool((codes[1:] >= codes[:-1]).all())


# ---------------------------------------------------------------------------- sign symmetry
@pytest.mark.parametrize("fmt", SIGNED, ids=_ids(SIGNED))
@SETTINGS
@given(xs=mixed)
def test_signed_formats_are_sign_symmetric(fmt, xs):
    x = t(xs)
    v, vn = fmt.qdq(x), fmt.qdq(-x)
    assert torch.equal(vn, -v)
    assert torch.equal(torch.signbit(vn), ~torch.signbit(v))
    assert torch.equal(fmt.encode(-x), fmt.encode(x) ^ fmt.sign_bit)


@pytest.mark.parametrize("fmt", INTS, ids=_ids(INTS))
@SETTINGS
@given(data=st.data())
def test_int_is_sign_symmetric_within_range(fmt, data):
    # saturation is asymmetric (qmin = -qmax - 1), so symmetry holds for |x| <= qmax
    xs = data.draw(st.lists(st.floats(-fmt.qmax, fmt.qmax, width=32), min_size=1, max_size=64))
    x = t(xs)
    assert torch.equal(fmt.qdq(-x), -fmt.qdq(x))


# ---------------------------------------------------------------------------- idempotence / nearest
@pytest.mark.parametrize("fmt", SIGNED, ids=_ids(SIGNED))
@SETTINGS
@given(xs=mixed)
def test_signed_qdq_idempotent(fmt, xs):
    v = fmt.qdq(t(xs))
    assert torch.equal(fmt.qdq(v), v)
    assert torch.equal(fmt.encode(v), fmt.encode(t(xs)))


@pytest.mark.parametrize("fmt", UNSIGNED, ids=_ids(UNSIGNED))
@SETTINGS
@given(xs=mixed_nonneg)
def test_unsigned_qdq_idempotent(fmt, xs):
    v = fmt.qdq(t(xs))
    assert torch.equal(fmt.qdq(v), v)


@pytest.mark.parametrize("fmt", INTS, ids=_ids(INTS))
@SETTINGS
@given(xs=st.lists(st.floats(-1e4, 1e4, width=32), min_size=1, max_size=64))
def test_int_qdq_idempotent(fmt, xs):
    v = fmt.qdq(t(xs))
    assert torch.equal(fmt.qdq(v), v)
    assert bool((v == torch.round(v)).all())


@pytest.mark.parametrize("rounding", ["floor", "nearest"])
@SETTINGS
@given(xs=st.lists(st.floats(min_value=0.0, width=32, allow_nan=False), min_size=1, max_size=64))
def test_e8m0_qdq_idempotent_and_bounds(rounding, xs):
    x = t(xs)
    v = E8M0.qdq(x, rounding)
    assert torch.equal(E8M0.qdq(v, rounding), v)
    normal = (x >= 2.0**-126) & (x < 2.0**127)
    xn, vn = x[normal].double(), v[normal].double()
    if rounding == "floor":
        assert bool(((vn <= xn) & (xn < 2 * vn)).all())
    else:  # nearest power of two, linear domain: within [x/1.5, x*4/3]
        assert bool(((vn * 1.5 >= xn) & (vn * 0.75 <= xn)).all())


@pytest.mark.parametrize("fmt", MINIFLOATS, ids=_ids(MINIFLOATS))
@SETTINGS
@given(xs=mixed_nonneg)
def test_minifloat_result_is_a_nearest_value(fmt, xs):
    """No representable value is strictly closer than the one encode picks."""
    x = t(xs)
    v = fmt.qdq(x).double()
    vals = fmt.values().double()
    xd = torch.clamp(x.double(), max=2 * fmt.max_finite)
    best = (xd[:, None] - vals[None, :]).abs().min(dim=1).values
    assert torch.equal((xd - v).abs(), best)


# ---------------------------------------------------------------------------- INTn rounding
@pytest.mark.parametrize("fmt", INTS, ids=_ids(INTS))
@SETTINGS
@given(data=st.data())
def test_int_round_half_to_even(fmt, data):
    k = data.draw(st.integers(fmt.qmin, fmt.qmax - 1))
    x = t([k + 0.5, -(k + 0.5)])
    r = fmt.round(x).tolist()
    even_up = k + 1 if (k + 1) % 2 == 0 else k  # the even one of k, k+1
    assert r[0] == even_up
    if fmt.qmin <= -even_up <= fmt.qmax:
        assert r[1] == -even_up
    else:  # -(k + 0.5) rounds to qmax + 1: saturated
        assert r[1] == fmt.qmax
    # off the tie it is plain nearest
    eps = data.draw(st.floats(1e-3, 0.49))
    assert fmt.round(t([k + 0.5 - eps, k + 0.5 + eps])).tolist() == [k, k + 1]


@pytest.mark.parametrize("fmt", INTS, ids=_ids(INTS))
@SETTINGS
@given(x=st.floats(width=32, allow_nan=False, allow_infinity=True))
def test_int_saturates(fmt, x):
    r = float(fmt.round(t([x])))
    if x >= fmt.qmax + 0.5:
        assert r == fmt.qmax
    elif x <= fmt.qmin - 0.5:
        assert r == fmt.qmin
    else:
        assert abs(r - x) <= 0.5 and fmt.qmin <= r <= fmt.qmax
    code = int(fmt.encode(t([x])))
    assert 0 <= code < 2**fmt.bits
    assert float(fmt.decode(torch.tensor([code], dtype=torch.uint8))) == r


@pytest.mark.parametrize("fmt", MINIFLOATS, ids=_ids(MINIFLOATS))
@SETTINGS
@given(x=st.floats(min_value=0.0, width=32, allow_nan=False, allow_infinity=True))
def test_minifloat_saturates_never_overflows(fmt, x):
    v = float(fmt.qdq(t([x])))
    assert math.isfinite(v) and 0.0 <= v <= fmt.max_finite
    if x >= fmt.max_finite:
        assert v == fmt.max_finite
