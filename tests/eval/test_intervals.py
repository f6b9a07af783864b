"""lowbit.eval.intervals: exact quantiles, and intervals that cover the truth as often as they say.

Coverage is checked by simulation: a test fails if an interval is too narrow (the usual failure:
a per-token standard error on correlated tokens) or needlessly wide."""

from __future__ import annotations

from math import comb

import numpy as np
import pytest

from lowbit.eval.intervals import (Interval, block_means, mean_interval, percentiles, t_quantile,
                                   wilson_interval)


@pytest.mark.parametrize("df,expected", [(1, 12.7062047), (2, 4.3026527), (3, 3.1824463), (4, 2.7764451),
                                         (9, 2.2621572), (31, 2.0395134), (120, 1.9799304)])
def test_t_quantile_matches_the_tables(df, expected):
    assert t_quantile(0.95, df) == pytest.approx(expected, abs=2e-7)


def test_t_quantile_other_levels_and_errors():
    assert t_quantile(0.90, 10) == pytest.approx(1.8124611, abs=2e-7)
    assert t_quantile(0.99, 5) == pytest.approx(4.0321430, abs=2e-7)
    with pytest.raises(ValueError):
        t_quantile(0.95, 0)
    with pytest.raises(ValueError):
        t_quantile(1.0, 3)


def test_block_means_split_in_order_and_cover_every_value():
    x = np.arange(10.0)
    assert block_means(x, 3).tolist() == [1.5, 5.0, 8.0]  # [0..3], [4..6], [7..9]
    assert block_means(x, 32).tolist() == x.tolist()      # fewer values than blocks: one each


def test_mean_interval_estimate_is_the_plain_mean_and_degenerate_cases():
    x = np.array([1.0, 2.0, 3.0, 10.0])
    iv = mean_interval(x, blocks=2)
    assert iv.estimate == pytest.approx(4.0)
    # block means 1.5 and 6.5: sd 3.5355, t(1) = 12.706
    assert iv.high - iv.estimate == pytest.approx(12.7062047 * 3.5355339 / 2 ** 0.5, rel=1e-6)
    assert mean_interval([2.5]) == Interval(2.5, 2.5, 2.5)
    assert mean_interval(np.zeros(100)) == Interval(0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="no values"):
        mean_interval([])
    with pytest.raises(ValueError, match="not finite"):
        mean_interval([1.0, float("nan")])


def _coverage(draw, truth: float, sims: int, blocks: int | None) -> float:
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(sims):
        x = draw(rng)
        iv = mean_interval(x, blocks=len(x) if blocks is None else blocks)
        hits += iv.contains(truth)
    return hits / sims


def _ar1_exponential(rng, n=1024, rho=0.6):
    """Correlated, skewed per-token values like KLD: exp of an AR(1) Gaussian; mean exp(1/2)."""
    z = np.empty(n)
    z[0] = rng.standard_normal()
    e = rng.standard_normal(n) * np.sqrt(1 - rho * rho)
    for i in range(1, n):
        z[i] = rho * z[i - 1] + e[i]
    return np.exp(z)


def test_batch_means_cover_independent_skewed_values():
    cov = _coverage(lambda rng: rng.exponential(0.05, 1024), 0.05, 2000, 32)
    assert 0.935 <= cov <= 0.965


def test_batch_means_cover_correlated_values_where_a_per_token_interval_does_not():
    truth = float(np.exp(0.5))
    cov = _coverage(_ar1_exponential, truth, 1000, 32)
    assert cov >= 0.92
    # the per-token interval (one block per token) is far too narrow here: the test above can fail
    naive = _coverage(_ar1_exponential, truth, 300, None)
    assert naive < 0.85


def test_paired_differences_cover_a_shared_text_effect():
    """Two models on one text: each token's difficulty is shared (it cancels in the paired
    difference), the models' true mean difference is 0.01."""
    rng = np.random.default_rng(1)
    hits = 0
    for _ in range(1000):
        text = rng.exponential(3.0, 1024)
        a = text + rng.normal(0.01, 0.05, 1024)
        b = text + rng.normal(0.0, 0.05, 1024)
        hits += mean_interval(a - b).contains(0.01)
    assert 0.93 <= hits / 1000 <= 0.97


@pytest.mark.parametrize("n", [16, 64, 256])
def test_wilson_interval_covers_on_average_exactly(n):
    """Exact coverage (a binomial sum, no simulation) over p in 0.01..0.99."""
    covs = []
    for i in range(1, 100):
        p = i / 100
        covs.append(sum(comb(n, k) * p ** k * (1 - p) ** (n - k) for k in range(n + 1)
                        if wilson_interval(k, n).contains(p)))
    assert np.mean(covs) >= 0.945
    assert min(covs) >= (0.85 if n == 16 else 0.93)


def test_wilson_interval_values_and_edges():
    iv = wilson_interval(3, 16)
    assert iv.estimate == 3 / 16
    assert (iv.low, iv.high) == pytest.approx((0.065916, 0.430089), abs=5e-6)  # by hand: centre 0.248003, half 0.182088
    assert wilson_interval(0, 16).low == 0.0 and wilson_interval(0, 16).high > 0.15
    assert wilson_interval(16, 16).high == 1.0 and wilson_interval(16, 16).low < 0.85
    with pytest.raises(ValueError):
        wilson_interval(5, 4)


def test_percentiles_and_map():
    p = percentiles(np.arange(101.0))
    assert p == {"p50": 50.0, "p90": 90.0, "p99": 99.0, "max": 100.0}
    iv = Interval(0.0, -1.0, 2.0).map(np.exp)
    assert (iv.estimate, iv.low, iv.high) == pytest.approx((1.0, np.exp(-1), np.exp(2)))
