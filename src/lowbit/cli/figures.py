"""Figures with their intervals as table text, one style for ``lowbit eval`` and ``lowbit compare``."""

from __future__ import annotations

import math


def _decimals(half: float, least: int = 0) -> int:
    """Decimals that show two significant digits of ``half`` (an interval's half width)."""
    if not half or not math.isfinite(half):
        return max(least, 2)
    return max(least, 1 - math.floor(math.log10(abs(half))))


def plus_minus(iv: dict | None, scale: float = 1.0, unit: str = "") -> str:
    """'0.0612 ±0.0041' for a symmetric interval (``Interval.to_dict()``), values times ``scale``."""
    if iv is None:
        return "-"
    est, half = iv["estimate"] * scale, (iv["high"] - iv["low"]) * scale / 2
    if 0 < abs(est) < 1e-3:  # KLD of 8-bit schemes: significant digits, not a row of zeros
        return f"{est:.3g}{unit} ±{half:.2g}"
    d = _decimals(half)
    return f"{est:.{d}f}{unit} ±{half:.{d}f}"


def bracket(iv: dict | None, scale: float = 1.0, unit: str = "", signed: bool = False) -> str:
    """'+14.56% [+12.1, +17.0]' for an interval that need not be symmetric."""
    if iv is None:
        return "-"
    est, lo, hi = (iv[k] * scale for k in ("estimate", "low", "high"))
    d = _decimals((hi - lo) / 2)
    sign = "+" if signed else ""
    return f"{est:{sign}.{d}f}{unit} [{lo:{sign}.{d}f}, {hi:{sign}.{d}f}]"


def accuracy_cell(row: dict) -> str:
    """Last-word accuracy with its Wilson interval, in %, and the count it rests on."""
    iv = row.get("lastword_interval")
    if iv is None:
        return "-"
    return f"{100 * iv['estimate']:.1f}% [{100 * iv['low']:.0f}, {100 * iv['high']:.0f}] of {row['lastword_examples']}"
