"""What SmoothQuant folded and what it could not, as ``lowbit quantize`` reports it."""

from __future__ import annotations


def smoothing_summary(report) -> dict | None:
    """From a ``CalibrationReport``: the fused groups given a SmoothQuant alpha (``smoothed``) and,
    per decoder layer, the sources that could not be folded and why (``unsmoothed``); None when
    the run did not smooth."""
    if report is None or report.smoothquant is None:
        return None
    smoothed = sum(1 for g in report.groups.values() if g.alpha is not None)
    return {"smoothed": smoothed, "unsmoothed": dict(report.unsmoothed)}


def describe_smoothing(s: dict) -> str:
    """``SmoothQuant folded into N groups; not folded in L layers: layer source (why), ...``."""
    line = f"SmoothQuant folded into {s['smoothed']} linear groups"
    un = s["unsmoothed"]
    if un:
        shown = [f"{layer} {src} ({why})" if src != "*" else f"{layer} ({why})"
                 for layer, srcs in list(un.items())[:2] for src, why in list(srcs.items())[:1]]
        line += f"; not folded in {len(un)} layers, e.g. " + "; ".join(shown)
    return line
