"""Write a compare report: ``report.json`` and ``report.png`` (matplotlib), each atomically
(lowbit.files.writer.atomic_path); a write the system refuses is an OutputError naming the file
(lowbit.files.refused)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from lowbit.errors import LowbitError
from lowbit.files.refused import write_failure
from lowbit.files.writer import atomic_path, write_text_atomic


def row_label(row: dict) -> str:
    """A scheme row's name in tables and plots: the scheme, plus ``+kv-<kv_cache>`` with a KV cache."""
    return row["scheme"] + (f"+kv-{row['kv_cache']}" if row.get("kv_cache") else "")


def _clean(obj):
    """JSON without NaN/Infinity (strict parsers refuse them)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def report_json(report: dict) -> str:
    return json.dumps(_clean(report), indent=2, allow_nan=False)


def write_report(report: dict, output_dir: str | os.PathLike) -> dict[str, Path]:
    """``report.json`` and ``report.png`` written into ``output_dir`` (made if missing); returns their
    paths. A refused write (disk full, read-only, no permission) is an OutputError naming the file,
    and leaves that file as it was (never half-written)."""
    out = Path(output_dir)
    jpath, ppath = out / "report.json", out / "report.png"
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(jpath, report_json(report) + "\n")
        plot_report(report, ppath)
    except OSError as e:
        if isinstance(e, LowbitError):
            raise
        raise write_failure(e, out) from e
    return {"json": jpath, "png": ppath}


def _ppl_limits(values: list[float]) -> tuple[float, float]:
    """A perplexity axis around the values (float's included), not from 0: the differences show."""
    lo, hi = min(values), max(values)
    pad = max(hi - lo, 0.02 * hi) * 0.15
    return max(lo - pad, 0.0), hi + 2 * pad


def build_figure(report: dict):
    """Three panels: perplexity (axis around the values, change vs float on each bar), last-word
    accuracy (float as a line), per-layer SQNR of the schemes where it was measured (the others,
    smoothed schemes, are named in the panel as not measured)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    ok = [r for r in report["schemes"] if r.get("status") == "ok"]
    base = report["float"]
    names = [row_label(r) for r in ok]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), gridspec_kw={"width_ratios": [1, 1, 2]})
    ax = axes[0]
    ppls = [r["perplexity"] for r in ok]
    bars = ax.bar(names, ppls, color="tab:blue")
    for b, r in zip(bars, ok):
        ax.annotate(f"{r['ppl_change_pct']:+.1f}%", (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.axhline(base["perplexity"], color="k", ls="--", label=f"float {base['perplexity']:.2f}")
    ax.set_ylim(*_ppl_limits(ppls + [base["perplexity"]]))
    ax.set_title(f"perplexity ({base['tokens_scored']} tokens)")
    ax.legend(loc="upper left")
    ax.tick_params(axis="x", rotation=30)
    ax = axes[1]
    if "lastword_accuracy" in base:
        ax.bar(names, [100 * r.get("lastword_accuracy", 0.0) for r in ok], color="tab:green")
        ax.axhline(100 * base["lastword_accuracy"], color="k", ls="--",
                   label=f"float {100 * base['lastword_accuracy']:.1f}%")
        ax.set_title(f"last-word accuracy % ({base['lastword_examples']} examples)")
        ax.legend(loc="lower right")
    ax.tick_params(axis="x", rotation=30)
    ax = axes[2]
    measured = [r for r in ok if r.get("layers")]
    for r in measured:
        vals = [v if v is not None else float("nan") for v in r["layers"].values()]
        ax.plot(range(len(vals)), vals, marker=".", lw=1, label=row_label(r))
    missing = [row_label(r) for r in ok if not r.get("layers")]
    if missing:
        ax.text(0.01, 0.02, f"not measured (SmoothQuant changes each layer's input): {', '.join(missing)}",
                transform=ax.transAxes, fontsize=8, va="bottom")
    ax.set_title("per-layer output SQNR (dB), model order; low = hurts")
    ax.set_xlabel("quantized linear #")
    ax.set_ylabel("SQNR dB")
    ax.grid(alpha=0.3)
    if measured:
        ax.legend(fontsize=8)
    fig.suptitle(f"lowbit compare: {report['model']['path']}", fontsize=10)
    fig.tight_layout()
    return fig


def plot_report(report: dict, path: str | os.PathLike) -> Path:
    """``build_figure`` written to ``path`` (PNG) atomically."""
    import matplotlib.pyplot as plt

    path = Path(path)
    fig = build_figure(report)
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
    finally:
        plt.close(fig)
    return path
