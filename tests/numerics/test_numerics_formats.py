"""Conformance of lowbit.numerics against independent references.

- E4M3 / E5M2: torch's float8 casts (values and code bits).
- E2M1: ml_dtypes.float4_e2m1fn.
- UE4M3 / UE5M3: a brute-force nearest-code search written here (ties to the even code).
- E8M0: the float32 exponent field (floor) and ml_dtypes.float8_e8m0fnu (nearest).

Inputs: every float16 and every bfloat16 bit pattern, plus a million random float32 values
spanning 2^-30 .. 2^21.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from lowbit.numerics import (
    E2M1, E4M3, E5M2, E8M0, INT2, INT3, INT4, INT5, INT6, INT7, INT8, UE4M3, UE5M3, E8M0Format,
    FormatName, IntFormat, MiniFloat, get_format, is_integer,
)

INTS = [INT2, INT3, INT4, INT5, INT6, INT7, INT8]
MINIFLOATS = [E2M1, E4M3, E5M2, UE4M3, UE5M3]


# ---------------------------------------------------------------------------- input sets
def _all_patterns(dtype: torch.dtype) -> torch.Tensor:
    """All 65536 values of a 16-bit float dtype, widened to float32 (NaNs included)."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    return bits.view(dtype).to(torch.float32)


_CACHE: dict[str, torch.Tensor] = {}


def _random_f32() -> torch.Tensor:
    """10^6 float32: sign * 2^uniform(-30, 20) * uniform[1, 2) (fixed seed)."""
    if "random" not in _CACHE:
        g = torch.Generator().manual_seed(1234)
        n = 1_000_000
        sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
        exp = torch.empty(n).uniform_(-30, 20, generator=g).floor()
        man = torch.empty(n).uniform_(1, 2, generator=g)
        _CACHE["random"] = (sign * torch.ldexp(man, exp)).to(torch.float32)
    return _CACHE["random"]


def inputs(kind: str) -> torch.Tensor:
    if kind == "float16":
        return _all_patterns(torch.float16)
    if kind == "bfloat16":
        return _all_patterns(torch.bfloat16)
    return _random_f32()


KINDS = ["float16", "bfloat16", "random_f32"]


def test_input_sets_cover_what_they_claim():
    f16 = inputs("float16")
    assert f16.numel() == 65536
    assert torch.isnan(f16).sum() == 2 * (2**10 - 1)  # every NaN pattern of float16
    assert torch.isinf(f16).sum() == 2
    assert (f16 == 0).sum() == 2 and torch.signbit(f16[f16 == 0]).sum() == 1
    bf = inputs("bfloat16")
    assert bf.numel() == 65536 and torch.isnan(bf).sum() == 2 * (2**7 - 1)
    r = inputs("random_f32")
    assert r.numel() == 1_000_000
    assert float(r.abs().min()) < 2.0**-29 and float(r.abs().max()) > 2.0**19
    assert 0.45 < float((r < 0).float().mean()) < 0.55


# ---------------------------------------------------------------------------- brute force
def brute_force_codes(fmt: MiniFloat, x: torch.Tensor, chunk: int = 16384) -> torch.Tensor:
    """Nearest finite code of each non-negative finite x (ties to the even code), by brute force.

    Every finite magnitude code is decoded from its bit fields here (not through lowbit), the
    distance to every x is computed in float64 and the minimum is taken; of two equidistant
    codes the even one wins. x is first capped at 2 * max value: above the largest value the
    nearest code is the largest code either way, and the cap keeps float64 differences exact
    (for x ~ 1e18 they would round and fake ties).
    """
    m = fmt.man_bits
    codes = torch.arange(fmt.max_code_magnitude + 1, dtype=torch.int64)
    e, f = codes >> m, codes & ((1 << m) - 1)
    vals = torch.where(e == 0, f.double() * 2.0 ** (1 - fmt.bias - m),
                       (1 + f.double() / 2**m) * torch.pow(2.0, (e - fmt.bias).double()))
    last = codes.numel() - 1
    out = []
    xd = torch.clamp(x.to(torch.float64), max=2 * float(vals.max()))
    for start in range(0, xd.numel(), chunk):
        c = xd[start:start + chunk]
        d = (c[:, None] - vals[None, :]).abs_()
        dmin, first = d.min(dim=1)  # first index of the minimum (torch documents this)
        # values increase with the code, so a tie is between `first` and `first + 1`
        nxt = torch.clamp(first + 1, max=last)
        tie = (d.gather(1, nxt[:, None])[:, 0] == dmin) & (nxt != first)
        out.append(torch.where(tie & (first % 2 == 1), nxt, first))
    return torch.cat(out)


def test_brute_force_reference_itself():
    # Sanity of the reference: known UE4M3/UE5M3 answers, computed by hand.
    x = torch.tensor([0.0, 1.0, 1.0625, 1.1875, 448.0, 1e9, 2.0**-9, 2.0**-10, 3 * 2.0**-10])
    # 1.0625 is the tie between 1 (code 0x38) and 1.125 (0x39): even code 0x38.
    # 1.1875 is the tie between 1.125 (0x39) and 1.25 (0x3A): even 0x3A.
    # 2^-10 is the tie between 0 and 2^-9 (code 1): even 0. 3*2^-10 ties 1 and 2: even 2.
    assert brute_force_codes(UE4M3, x).tolist() == [0, 0x38, 0x38, 0x3A, 0x7E, 0x7E, 1, 0, 2]
    assert brute_force_codes(UE5M3, torch.tensor([1.0, 114688.0, 1e9, 2.0**-17])).tolist() == [0x78, 0xFE, 0xFE, 1]


# ---------------------------------------------------------------------------- E4M3 / E5M2 vs torch
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt,tdtype", [(E4M3, torch.float8_e4m3fn), (E5M2, torch.float8_e5m2)], ids=["e4m3", "e5m2"])
def test_fp8_matches_torch_cast(fmt, tdtype, kind):
    x = inputs(kind)
    nan = torch.isnan(x)
    codes = fmt.encode(x)
    vals = fmt.decode(codes)
    ref = x.to(tdtype)
    ref_vals = ref.to(torch.float32)
    ref_codes = ref.view(torch.uint8)

    in_range = torch.isfinite(ref_vals) & ~nan & (x.abs() <= fmt.max_finite)
    assert int(in_range.sum()) > 0.4 * x.numel()
    # codes equal, -0.0 included: a negative value that rounds to zero is 0x80 in both
    assert torch.equal(codes[in_range], ref_codes[in_range])
    assert torch.equal(vals[in_range], ref_vals[in_range])
    assert torch.equal(torch.signbit(vals[in_range]), torch.signbit(ref_vals[in_range]))

    # Just above max_finite torch rounds back to max_finite itself; wherever torch gives a
    # finite value lowbit agrees, and wherever it does not (overflow to Inf / NaN) lowbit
    # saturates to +-max_finite with the sign of the input.
    torch_finite = torch.isfinite(ref_vals) & ~nan
    assert torch.equal(codes[torch_finite], ref_codes[torch_finite])
    over = ~nan & (x.abs() > fmt.max_finite)
    assert int(over.sum()) > 0
    sat = torch.where(x[over] < 0, -fmt.max_finite, fmt.max_finite)
    assert torch.equal(vals[over], sat)
    max_code = fmt.max_code_magnitude
    assert torch.equal(codes[over], torch.where(x[over] < 0, max_code | 0x80, max_code).to(torch.uint8))

    # NaN inputs give a NaN code (the positive NaN pattern)
    if bool(nan.any()):
        assert bool(torch.isnan(vals[nan]).all())
        assert bool((codes[nan] == fmt.nan_code).all())


def test_fp8_infinities_and_zero_signs():
    x = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, -1e-30, 1e-30])
    assert E4M3.encode(x).tolist() == [0x7E, 0xFE, 0x00, 0x80, 0x80, 0x00]
    assert E5M2.encode(x).tolist() == [0x7B, 0xFB, 0x00, 0x80, 0x80, 0x00]
    assert E4M3.decode(torch.tensor([0x7F, 0xFF], dtype=torch.uint8)).isnan().all()
    assert E5M2.decode(torch.tensor([0x7C, 0xFC], dtype=torch.uint8)).tolist() == [math.inf, -math.inf]
    assert E5M2.decode(torch.tensor([0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF], dtype=torch.uint8)).isnan().all()


# ---------------------------------------------------------------------------- E2M1 vs ml_dtypes
@pytest.mark.parametrize("kind", KINDS)
def test_e2m1_matches_ml_dtypes(kind):
    x = inputs(kind)
    x = x[~torch.isnan(x)]
    codes = E2M1.encode(x)
    vals = E2M1.decode(codes)
    ref = x.numpy().astype(ml_dtypes.float4_e2m1fn)
    ref_vals = torch.from_numpy(ref.astype(np.float32))
    ref_codes = torch.from_numpy(ref.view(np.uint8).copy()) & 0x0F
    in_range = x.abs() <= 6.0
    assert int(in_range.sum()) > 0.2 * x.numel()
    assert torch.equal(vals[in_range], ref_vals[in_range])
    assert torch.equal(torch.signbit(vals[in_range]), torch.signbit(ref_vals[in_range]))
    assert torch.equal(codes[in_range], ref_codes[in_range])
    over = ~in_range
    assert int(over.sum()) > 0
    assert torch.equal(vals[over], torch.where(x[over] < 0, -6.0, 6.0))
    assert torch.equal(codes[over], torch.where(x[over] < 0, 0xF, 0x7).to(torch.uint8))
    # ml_dtypes saturates too (no Inf in the format): full agreement on all non-NaN input
    assert torch.equal(vals, ref_vals)
    assert int(codes.max()) <= 0xF


def test_e2m1_ties_and_saturation():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 100.0, float("inf")])
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0]
    assert E2M1.qdq(x).tolist() == expected
    assert E2M1.qdq(-x).tolist() == [-v for v in expected]
    # code = sign<<3 | index into (0, 0.5, 1, 1.5, 2, 3, 4, 6)
    assert E2M1.encode(x).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 7, 7]
    assert E2M1.encode(-x).tolist() == [8, 10, 10, 12, 12, 14, 14, 15, 15, 15]
    table = E2M1.decode(torch.arange(16, dtype=torch.uint8)).tolist()
    assert table[:8] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert table[8:] == [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    # codes 16..255 are outside a 4-bit format
    assert E2M1.decode(torch.tensor([16, 255], dtype=torch.uint8)).isnan().all()
    # just off the ties, plain nearest
    assert E2M1.qdq(torch.tensor([0.2500001, 0.7499999, 2.5000002, 4.9999995, 5.0000005])).tolist() == [
        0.5, 0.5, 3.0, 4.0, 6.0]


def test_e2m1_refuses_nan():
    with pytest.raises(ValueError, match="NaN"):
        E2M1.encode(torch.tensor([1.0, float("nan")]))


# ---------------------------------------------------------------------------- UE4M3 / UE5M3 brute force
def _nonneg(kind: str) -> torch.Tensor:
    x = inputs(kind)
    x = x[torch.isfinite(x)].abs()
    return x


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", [UE4M3, UE5M3], ids=["ue4m3", "ue5m3"])
def test_unsigned_scale_formats_match_brute_force(fmt, kind):
    x = _nonneg(kind)
    codes = fmt.encode(x)
    ref = brute_force_codes(fmt, x)
    mismatch = codes.to(torch.int64) != ref
    assert not bool(mismatch.any()), (
        f"{fmt.name}: {int(mismatch.sum())} mismatches, e.g. x={x[mismatch][:5].tolist()} "
        f"lowbit={codes[mismatch][:5].tolist()} brute={ref[mismatch][:5].tolist()}")
    # decoded values are the brute-force values, exactly
    assert torch.equal(fmt.decode(codes).double(), fmt.decode(ref.to(torch.uint8)).double())
    # the input set exercises saturation, flush to zero and subnormals
    if float(x.max()) > fmt.max_finite:  # float16 tops out at 65504 < UE5M3's 114688
        assert bool((ref == fmt.max_code_magnitude).any())
    assert bool((ref == 0).any()) and bool(((ref > 0) & (ref < 8)).any())


def test_ue4m3_equals_e4m3_on_nonnegative_input():
    x = _nonneg("random_f32")
    assert torch.equal(UE4M3.encode(x), E4M3.encode(x))
    assert torch.equal(UE4M3.encode(x), x.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("fmt", [UE4M3, UE5M3], ids=["ue4m3", "ue5m3"])
def test_unsigned_formats_infinity_nan_negative(fmt):
    assert fmt.encode(torch.tensor([float("inf")])).tolist() == [fmt.max_code_magnitude]
    assert fmt.encode(torch.tensor([float("nan")])).tolist() == [fmt.nan_code]
    assert fmt.encode(torch.tensor([-0.0])).tolist() == [0]
    with pytest.raises(ValueError, match="unsigned"):
        fmt.encode(torch.tensor([1.0, -1e-30]))
    with pytest.raises(ValueError, match="unsigned"):
        fmt.encode(torch.tensor([-float("inf")]))


# ---------------------------------------------------------------------------- UE5M3 specifics
def test_ue4m3_is_e4m3_with_sign_forced_zero():
    assert UE4M3.bits == 8 and E4M3.bits == 8 and E2M1.bits == 4
    codes = torch.arange(128, dtype=torch.uint8)
    assert torch.equal(UE4M3.decode(codes[:127]), E4M3.decode(codes[:127]))
    assert bool(torch.isnan(UE4M3.decode(torch.tensor([0x7F, 0x80, 0xB8, 0xFF], dtype=torch.uint8))).all())


def test_ue5m3_constants():
    assert UE5M3.bits == 8
    assert UE5M3.max_finite == 114688.0 == 1.75 * 2**16
    assert UE5M3.min_normal == 2.0**-14
    assert UE5M3.min_subnormal == 2.0**-17
    assert UE5M3.nan_code == 0xFF
    assert UE5M3.finite_codes().tolist() == list(range(255))


def test_ue5m3_carry_into_next_binade():
    for k in range(-14, 16):
        x = torch.tensor([1.9375 * 2.0**k])
        code = int(UE5M3.encode(x))
        assert code == (k + 1 + 15) << 3, (k, hex(code))
        assert float(UE5M3.qdq(x)) == 2.0 ** (k + 1)
        # just below the tie stays in the binade (mantissa 7)
        below = torch.tensor([1.9375 * 2.0**k]).nextafter(torch.tensor([0.0]))
        assert int(UE5M3.encode(below)) == ((k + 15) << 3) | 7
    # 1.8125 (tie between mantissa 6 and 7) goes to the even mantissa 6
    assert float(UE5M3.qdq(torch.tensor([1.8125]))) == 1.75


def test_ue5m3_saturation():
    x = torch.tensor([114688.0, 114689.0, 122879.0, 122880.0, 131072.0, 1e6, 3e38, float("inf")])
    assert UE5M3.encode(x).tolist() == [0xFE] * len(x)
    assert UE5M3.qdq(x).tolist() == [114688.0] * len(x)
    # E = 31 is finite: 0xF8 = 2^16, 0xFD = 1.625 * 2^16
    assert UE5M3.decode(torch.tensor([0xF8, 0xFD, 0xFE], dtype=torch.uint8)).tolist() == [65536.0, 106496.0, 114688.0]
    assert UE5M3.encode(torch.tensor([65536.0, 106496.0, 110591.0, 110592.0])).tolist() == [0xF8, 0xFD, 0xFD, 0xFE]


def test_ue5m3_subnormals_and_flush():
    codes = torch.arange(8, dtype=torch.uint8)
    assert UE5M3.decode(codes).tolist() == [m / 8 * 2.0**-14 for m in range(8)]
    assert UE5M3.decode(codes)[1] == 2.0**-17
    assert UE5M3.encode(torch.tensor([m / 8 * 2.0**-14 for m in range(8)])).tolist() == list(range(8))
    half = 2.0**-18
    x = torch.tensor([half])
    assert UE5M3.encode(x).tolist() == [0]  # exact tie between 0 and code 1: even code 0
    assert UE5M3.encode(x.nextafter(torch.tensor([1.0]))).tolist() == [1]
    assert UE5M3.encode(x.nextafter(torch.tensor([0.0]))).tolist() == [0]
    assert UE5M3.encode(torch.tensor([2.0**-20, 1e-30, 1e-45])).tolist() == [0, 0, 0]
    assert UE5M3.encode(torch.tensor([3 * 2.0**-18, 5 * 2.0**-18])).tolist() == [2, 2]  # ties to even
    # the subnormal / normal boundary: code 7 -> 8 at 2^-14
    assert UE5M3.encode(torch.tensor([15 * 2.0**-18, 2.0**-14])).tolist() == [8, 8]


def test_ue5m3_only_0xff_is_nan():
    v = UE5M3.decode(torch.arange(256, dtype=torch.uint8))
    assert bool(torch.isfinite(v[:255]).all())
    assert bool(torch.isnan(v[255]))
    assert not bool(torch.isinf(v).any())
    assert bool((v[1:255] > v[:254]).all())  # strictly increasing codes


# ---------------------------------------------------------------------------- E8M0
def test_e8m0_exact_on_powers_of_two():
    k = torch.arange(-127, 128)
    x = torch.ldexp(torch.ones(255), k.float())
    for rounding in ("floor", "nearest"):
        codes = E8M0.encode(x, rounding)
        assert codes.tolist() == list(range(255))
    assert torch.equal(E8M0.decode(torch.arange(255, dtype=torch.uint8)), x)
    assert E8M0.decode(torch.tensor([127, 0, 254], dtype=torch.uint8)).tolist() == [1.0, 2.0**-127, 2.0**127]


def _positive_normal_f32() -> torch.Tensor:
    parts = [inputs("float16"), inputs("bfloat16"), inputs("random_f32")]
    g = torch.Generator().manual_seed(7)
    # plus the whole float32 exponent range
    wide = torch.ldexp(torch.empty(200_000).uniform_(1, 2, generator=g),
                       torch.randint(-126, 128, (200_000,), generator=g).float())
    x = torch.cat(parts + [wide]).abs()
    return x[torch.isfinite(x) & (x >= 2.0**-126)]


def test_e8m0_floor_is_float32_exponent():
    x = _positive_normal_f32()
    codes = E8M0.encode(x)  # default rounding: floor
    biased_exponent = (x.view(torch.int32) >> 23) & 0xFF  # = floor(log2 x) + 127 for normal x
    assert torch.equal(codes.to(torch.int32), biased_exponent)
    v = E8M0.decode(codes)
    assert bool((v <= x).all()) and bool((x < 2 * v.double()).all())
    # a handful checked against math.log2
    for val in [1.0, 1.5, 2.9999, 3.0, 1000.0, 0.3, 2.0**-100 * 1.7]:
        assert int(E8M0.encode(torch.tensor([val]))) == math.floor(math.log2(val)) + 127


def test_e8m0_nearest_matches_ml_dtypes():
    x = _positive_normal_f32()
    x = x[x < 1.5 * 2.0**127]  # ml_dtypes overflows to NaN from the tie at 1.5*2^127 up
    codes = E8M0.encode(x, rounding="nearest")
    ref = torch.from_numpy(x.numpy().astype(ml_dtypes.float8_e8m0fnu).view(np.uint8).copy())
    assert torch.equal(codes, ref)
    # ties (1.5 * 2^k) round up
    assert E8M0.encode(torch.tensor([1.5, 3.0, 0.75, 1.4999999]), rounding="nearest").tolist() == [128, 129, 127, 127]
    # lowbit saturates where ml_dtypes overflows
    assert E8M0.encode(torch.tensor([1.5 * 2.0**127, 3.4e38]), rounding="nearest").tolist() == [254, 254]


def test_e8m0_special_values():
    x = torch.tensor([0.0, -0.0, 2.0**-127, 2.0**-140, 1e-45, 3.4e38, float("inf"), float("nan")])
    assert E8M0.encode(x).tolist() == [0, 0, 0, 0, 0, 254, 254, 0xFF]
    assert E8M0.encode(x, rounding="nearest").tolist() == [0, 0, 0, 0, 0, 254, 254, 0xFF]
    assert bool(torch.isnan(E8M0.decode(torch.tensor([0xFF], dtype=torch.uint8))).all())
    with pytest.raises(ValueError, match="negative"):
        E8M0.encode(torch.tensor([1.0, -2.0]))
    with pytest.raises(ValueError, match="rounding"):
        E8M0.encode(torch.tensor([1.0]), rounding="up")
    assert E8M0.encode_exponent(torch.tensor([-200, -127, 0, 5, 127, 300])).tolist() == [0, 0, 127, 132, 254, 254]
    assert E8M0.exponent_floor(torch.tensor([1.0, 6.0, 448.0, 0.49])).tolist() == [0, 2, 8, -2]
    assert E8M0.max_finite == 2.0**127 and E8M0.min_value == 2.0**-127


# ---------------------------------------------------------------------------- constants (spec table)
@pytest.mark.parametrize("fmt,bits,max_finite,min_normal,min_sub", [
    (E2M1, 4, 6.0, 1.0, 0.5),
    (E4M3, 8, 448.0, 2.0**-6, 2.0**-9),
    (E5M2, 8, 57344.0, 2.0**-14, 2.0**-16),
    (UE4M3, 8, 448.0, 2.0**-6, 2.0**-9),
    (UE5M3, 8, 114688.0, 2.0**-14, 2.0**-17),
], ids=lambda v: getattr(v, "name", None))
def test_minifloat_constants(fmt, bits, max_finite, min_normal, min_sub):
    assert fmt.bits == bits
    assert fmt.max_finite == max_finite
    assert fmt.min_normal == min_normal
    assert fmt.min_subnormal == min_sub
    vals = fmt.values()
    assert float(vals.max()) == max_finite
    assert float(vals[1]) == min_sub
    assert bool((vals[1:] > vals[:-1]).all())


def test_e2m1_values_list():
    assert E2M1.values().tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


@pytest.mark.parametrize("fmt", INTS, ids=lambda f: f.name)
def test_int_constants(fmt):
    n = fmt.bits
    assert (fmt.qmin, fmt.qmax) == (-(2 ** (n - 1)), 2 ** (n - 1) - 1)
    assert fmt.max_finite == 2 ** (n - 1) - 1
    assert fmt.name == f"int{n}"
    with pytest.raises(ValueError):
        IntFormat(9)
    with pytest.raises(ValueError):
        IntFormat(1)


# ---------------------------------------------------------------------------- round trip on every code
ALL_FORMATS = MINIFLOATS + [E8M0] + INTS


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
def test_decode_encode_round_trip_every_finite_code(fmt):
    codes = fmt.finite_codes()
    vals = fmt.decode(codes)
    assert bool(torch.isfinite(vals).all())
    # decode(encode(v)) == v, and the code itself comes back (-0.0 keeps its sign code)
    back = fmt.encode(vals)
    assert torch.equal(fmt.decode(back), vals)
    assert torch.equal(torch.signbit(fmt.decode(back)), torch.signbit(vals))
    assert torch.equal(back, codes)
    assert torch.equal(fmt.qdq(vals), vals)
    expected_n = {"e2m1": 16, "e4m3": 254, "e5m2": 248, "ue4m3": 127, "ue5m3": 255, "e8m0": 255}
    assert codes.numel() == expected_n.get(fmt.name, 2 ** getattr(fmt, "bits", 0))


@pytest.mark.parametrize("fmt", MINIFLOATS, ids=lambda f: f.name)
def test_decode_matches_bit_fields(fmt):
    """Every code's value from its sign/exponent/mantissa fields, computed independently."""
    n = 1 << (fmt.exp_bits + fmt.man_bits + (1 if fmt.signed else 0))  # codes of the layout
    vals = fmt.decode(torch.arange(256, dtype=torch.uint8)).tolist()
    # codes beyond the layout (UE4M3's forced-0 sign bit set, E2M1 codes >= 16) are not values
    assert all(math.isnan(v) for v in vals[n:])
    m, b = fmt.man_bits, fmt.bias
    for c in range(n):
        mag = c & ((1 << (fmt.exp_bits + m)) - 1)
        sign = -1.0 if fmt.signed and c >> (fmt.exp_bits + m) else 1.0
        e, f = mag >> m, mag & ((1 << m) - 1)
        expect = sign * (f * 2.0 ** (1 - b - m) if e == 0 else (1 + f / 2**m) * 2.0 ** (e - b))
        if mag > fmt.max_code_magnitude:
            assert math.isnan(vals[c]) or (math.isinf(vals[c]) and fmt.has_inf), (fmt.name, c)
        else:
            assert vals[c] == expect, (fmt.name, c)


@pytest.mark.parametrize("fmt", MINIFLOATS + INTS + [E8M0], ids=lambda f: f.name)
def test_decode_requires_uint8(fmt):
    with pytest.raises(TypeError):
        fmt.decode(torch.tensor([1, 2], dtype=torch.int32))


# ---------------------------------------------------------------------------- INTn
def test_int_round_half_to_even_and_saturation():
    x = torch.tensor([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, 6.5, 6.51, 7.4, 7.5, 8.0, 100.0, -7.5, -8.5, -9.0,
                      float("inf"), -float("inf")])
    assert INT4.round(x).tolist() == [0, 2, 2, 4, -0.0, -2, -2, 6, 7, 7, 7, 7, 7, -8, -8, -8, 7, -8]
    assert INT8.round(torch.tensor([126.5, 127.5, 1e9, -127.5, -128.5, -1e9])).tolist() == [126, 127, 127, -128, -128, -128]
    assert INT2.round(torch.tensor([-3.0, -1.5, -0.5, 0.5, 1.5, 9.0])).tolist() == [-2, -2, 0, 0, 1, 1]


@pytest.mark.parametrize("fmt", INTS, ids=lambda f: f.name)
def test_int_codes_are_twos_complement(fmt):
    ints = torch.arange(fmt.qmin, fmt.qmax + 1)
    codes = fmt.encode(ints.float())
    mask = (1 << fmt.bits) - 1
    assert codes.tolist() == [i & mask for i in ints.tolist()]
    assert fmt.codes_to_int(codes).tolist() == ints.tolist()
    assert fmt.to_int(ints.float()).dtype == torch.int8
    assert fmt.to_int(ints.float()).tolist() == ints.tolist()
    # INTn codes only use the low n bits; high bits are ignored when decoding
    assert fmt.decode(codes | (0xFF ^ mask)).tolist() == ints.float().tolist()


def test_int8_codes_equal_int8_bit_pattern():
    x = torch.tensor([-128.0, -1.0, 0.0, 1.0, 127.0, -300.0])
    assert torch.equal(INT8.encode(x).view(torch.int8), INT8.to_int(x))
    assert INT8.encode(x).tolist() == [0x80, 0xFF, 0, 1, 0x7F, 0x80]


def test_int_refuses_nan():
    with pytest.raises(ValueError, match="NaN"):
        INT8.encode(torch.tensor([float("nan")]))


# ---------------------------------------------------------------------------- names
def test_format_names_and_lookup():
    assert get_format("e2m1") is E2M1
    assert get_format(FormatName.UE5M3) is UE5M3
    assert get_format("int4") is INT4
    assert isinstance(get_format("e8m0"), E8M0Format)
    with pytest.raises(KeyError):
        get_format("fp32")
    with pytest.raises(ValueError):
        get_format("e9m9")
    assert is_integer(FormatName.INT3) and not is_integer(FormatName.E4M3) and not is_integer(FormatName.FP32)
    assert str(FormatName.E5M2) == "e5m2"
    for name in FormatName:
        if name is not FormatName.FP32:
            assert get_format(name).name == name.value
