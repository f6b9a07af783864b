"""Confidence intervals for evaluation figures: pure functions on arrays, no model.

Per-token figures (a token's KL divergence, its NLL, whether its top token agrees) are not
independent: neighbouring tokens share context, so a per-token standard error understates the
uncertainty of their mean. ``mean_interval`` therefore uses **batch means**: the scored tokens,
in text order, are cut into ``blocks`` contiguous blocks of (nearly) equal length, the mean of
each block is taken, and the interval is ``mean ± t(0.975, B - 1) · sd(block means) / √B`` with
Student's t quantile. With independent tokens it has the width of the per-token interval (up to
the t quantile); with correlated ones it widens as it should (tested by simulation in
tests/eval/test_intervals.py). The estimate is always the plain mean of all tokens.

A paired comparison (two models scored on the same tokens) is ``mean_interval`` of the
per-token differences, which cancels the text's own variation.

Last-word accuracy counts independent examples: ``wilson_interval`` (Wilson's score interval),
which stays inside [0, 1] and is not degenerate at 0 or n correct.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist

import numpy as np

#: contiguous blocks of scored tokens whose means give the interval (fewer when fewer tokens)
DEFAULT_BLOCKS = 32
#: the confidence level of every interval lowbit reports
LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """An estimate with its ``level`` confidence interval [low, high]."""

    estimate: float
    low: float
    high: float
    level: float = LEVEL

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high

    def map(self, f) -> "Interval":
        """The interval of ``f(x)`` for an increasing ``f`` (exact for a monotone transform)."""
        return Interval(f(self.estimate), f(self.low), f(self.high), self.level)

    def to_dict(self) -> dict:
        return asdict(self)


def _two_sided_t_mass(t: float, df: int) -> float:
    """P(|T| <= t) for Student's t with integer ``df`` >= 1 (closed form, finite sums)."""
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2 == 1:
        if df == 1:
            return 2 * theta / math.pi
        term, s = 1.0, 1.0
        for k in range(1, (df - 1) // 2):  # 1 + 2/3 c2 + (2*4)/(3*5) c2^2 + ...
            term *= (2 * k) / (2 * k + 1) * c2
            s += term
        return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * s)
    term, s = 1.0, 1.0
    for k in range(1, df // 2):  # 1 + 1/2 c2 + (1*3)/(2*4) c2^2 + ...
        term *= (2 * k - 1) / (2 * k) * c2
        s += term
    return math.sin(theta) * s


def t_quantile(level: float, df: int) -> float:
    """The t with P(|T| <= t) = ``level`` for Student's t with ``df`` degrees of freedom
    (bisection on the exact distribution; ``df`` >= 1)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    lo, hi = 0.0, 1.0
    while _two_sided_t_mass(hi, df) < level:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if _two_sided_t_mass(mid, df) < level:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * hi:
            break
    return (lo + hi) / 2


def block_means(x: np.ndarray, blocks: int = DEFAULT_BLOCKS) -> np.ndarray:
    """Means of ``min(blocks, len(x))`` contiguous blocks of ``x`` whose lengths differ by at most one."""
    x = np.asarray(x, dtype=np.float64)
    b = min(int(blocks), len(x))
    return np.array([part.mean() for part in np.array_split(x, b)])


def mean_interval(x, blocks: int = DEFAULT_BLOCKS, level: float = LEVEL) -> Interval:
    """The mean of ``x`` (per-token values in text order) with its batch-means interval (see the
    module docstring). One value gives a zero-width interval; none is a ValueError."""
    x = np.asarray(x, dtype=np.float64).ravel()
    if x.size == 0:
        raise ValueError("no values to take the mean of")
    if not np.all(np.isfinite(x)):
        raise ValueError("a per-token value is not finite")
    mean = float(x.mean())
    means = block_means(x, blocks)
    if len(means) < 2:
        return Interval(mean, mean, mean, level)
    half = t_quantile(level, len(means) - 1) * float(means.std(ddof=1)) / math.sqrt(len(means))
    return Interval(mean, mean - half, mean + half, level)


def wilson_interval(correct: int, n: int, level: float = LEVEL) -> Interval:
    """Accuracy ``correct / n`` with Wilson's score interval (independent examples)."""
    if n <= 0 or not 0 <= correct <= n:
        raise ValueError(f"need 0 <= correct <= n and n > 0, got {correct} of {n}")
    z = NormalDist().inv_cdf(0.5 + level / 2)
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return Interval(p, max(0.0, centre - half), min(1.0, centre + half), level)


def percentiles(x, qs=(50, 90, 99)) -> dict[str, float]:
    """``{"p50": ..., ...}`` of ``x`` (linear interpolation), plus ``"max"``."""
    x = np.asarray(x, dtype=np.float64)
    out = {f"p{q:g}": float(np.percentile(x, q)) for q in qs}
    out["max"] = float(x.max())
    return out
