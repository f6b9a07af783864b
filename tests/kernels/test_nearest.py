"""lowbit.kernels.rounding: in-place nearest rounding (GPTQ's columns, the mse search) equals the
reference qdq, up to the sign of zero, on adversarial values."""

import pytest
import torch

from lowbit.numerics import E2M1, E4M3, E5M2, E8M0, UE4M3, IntFormat
from lowbit.kernels.rounding import column_rounder, round_nearest_
from helpers.patterns import finite_half_patterns, ties, wide_random


def _intties(fmt: IntFormat) -> torch.Tensor:
    """Every integer in range and past it, every half-way point, each one float32 ulp up and down."""
    k = torch.arange(fmt.qmin - 3, fmt.qmax + 4, dtype=torch.float32)
    base = torch.cat([k, k + 0.5, torch.tensor([1e6, -1e6, 3.4028235e38, -3.4028235e38])])
    x = torch.cat([base, torch.nextafter(base, torch.tensor(float("inf"))),
                   torch.nextafter(base, torch.tensor(float("-inf")))])
    return x


def _round(fmt, x: torch.Tensor) -> torch.Tensor:
    """The column rounder's result, checked equal to round_nearest_'s on the same values."""
    y, f = column_rounder(fmt, x.numel())
    y.copy_(x)
    out = f()
    assert out.data_ptr() == y.data_ptr()  # in place
    t = x.clone().reshape(-1, 2) if x.numel() % 2 == 0 else x.clone()  # any shape
    t2 = round_nearest_(t, fmt)
    assert t2.data_ptr() == t.data_ptr()
    assert torch.equal(t2.reshape(-1).view(torch.int32), out.view(torch.int32))
    return out.clone()


def _assert_same_up_to_zero_sign(got: torch.Tensor, ref: torch.Tensor) -> None:
    zero = ref == 0
    assert torch.equal(got == 0, zero)
    diff = (got.view(torch.int32) != ref.view(torch.int32)) & ~zero
    assert not bool(diff.any()), f"{int(diff.sum())} differ, e.g. got {got[diff][:4]} want {ref[diff][:4]}"


@pytest.mark.parametrize("fmt", [E2M1, E4M3, E5M2], ids=lambda f: f.name)
def test_minifloat_column_rounding_equals_qdq(fmt):
    x = torch.cat([finite_half_patterns(), ties(fmt), wide_random(100_000, 4),
                   torch.tensor([0.0, -0.0, 1e-45, -1e-45, 2.0**-126, 3.4028235e38, -3.4028235e38,
                                 fmt.min_subnormal / 2, -fmt.min_subnormal / 2, fmt.min_subnormal * 0.75,
                                 -fmt.min_subnormal * 0.75, fmt.min_normal, -fmt.max_finite])])
    _assert_same_up_to_zero_sign(_round(fmt, x), fmt.qdq(x))


def test_e2m1_ties_go_to_even_codes():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.75, -2.5, -3.5, -5.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, -2.0, -4.0, -4.0])
    assert torch.equal(_round(E2M1, x), want)


@pytest.mark.parametrize("bits", [4, 8])
def test_int_column_rounding_equals_qdq(bits):
    fmt = IntFormat(bits)
    x = torch.cat([_intties(fmt), wide_random(20_000, 5)])
    _assert_same_up_to_zero_sign(_round(fmt, x), fmt.qdq(x))


def test_rounders_do_not_share_buffers():
    ya, fa = column_rounder(E2M1, 3)
    yb, fb = column_rounder(E2M1, 3)
    ya.copy_(torch.tensor([0.3, 2.6, -5.1]))
    yb.copy_(torch.tensor([0.8, -1.3, 9.0]))
    assert torch.equal(fa(), torch.tensor([0.5, 3.0, -6.0]))
    assert torch.equal(fb(), torch.tensor([1.0, -1.5, 6.0]))


def test_unsupported_format_is_refused():
    with pytest.raises(ValueError, match="e8m0"):
        column_rounder(E8M0, 4)
    with pytest.raises(ValueError, match="e8m0"):
        round_nearest_(torch.ones(4), E8M0)


def test_unsigned_format_rounds_non_negative_values():
    x = torch.cat([finite_half_patterns().abs(), ties(UE4M3).abs(), torch.tensor([0.0, 1e-45, 3.4028235e38])])
    assert torch.equal(round_nearest_(x.clone(), UE4M3).view(torch.int32), UE4M3.qdq(x).view(torch.int32))
