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


def _errors(rows: list[dict], key: str, scale: float = 1.0, plain: str | None = None,
            ) -> tuple[list[float], list[list[float]] | None]:
    """Bar heights and matplotlib's [[below...], [above...]] error extents of an interval field;
    without intervals (a report of an older lowbit) the ``plain`` field's values and no error bars."""
    ivs = [r.get(key) for r in rows]
    if not ivs or any(iv is None for iv in ivs):
        return [scale * r.get(plain, 0.0) if plain else 0.0 for r in rows], None
    est = [scale * iv["estimate"] for iv in ivs]
    return est, [[scale * (iv["estimate"] - iv["low"]) for iv in ivs], [scale * (iv["high"] - iv["estimate"]) for iv in ivs]]


def build_figure(report: dict):
    """Four panels, each row against float with its 95% interval as an error bar: KL divergence,
    perplexity change (paired), last-word accuracy (float's interval as a band), and per-layer
    SQNR of the schemes where it was measured (the others, smoothed schemes, named as not measured)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    ok = [r for r in report["schemes"] if r.get("status") == "ok"]
    base = report["float"]
    names = [row_label(r) for r in ok]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.8), gridspec_kw={"width_ratios": [1, 1, 1, 2]})
    ax = axes[0]
    kld, err = _errors(ok, "kld")
    ax.bar(names, kld, yerr=err, capsize=4, color="tab:purple")
    ax.set_title(f"KL(float || scheme), nats/token ({base['tokens_scored']} tokens)")
    ax.tick_params(axis="x", rotation=30)
    ax = axes[1]
    change, err = _errors(ok, "ppl_change_interval", plain="ppl_change_pct")
    bars = ax.bar(names, change, yerr=err, capsize=4, color="tab:blue")
    for b, v in zip(bars, change):
        ax.annotate(f"{v:+.1f}%", (b.get_x() + b.get_width() / 2, max(v, 0)), ha="center", va="bottom", fontsize=8)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_title(f"perplexity change % (float {base['perplexity']:.2f})")
    ax.tick_params(axis="x", rotation=30)
    ax = axes[2]
    if "lastword_accuracy" in base:
        acc, err = _errors(ok, "lastword_interval", 100, plain="lastword_accuracy")
        ax.bar(names, acc, yerr=err, capsize=4, color="tab:green")
        ax.axhline(100 * base["lastword_accuracy"], color="k", ls="--",
                   label=f"float {100 * base['lastword_accuracy']:.1f}%")
        iv = base.get("lastword_interval")
        if iv is not None:
            ax.axhspan(100 * iv["low"], 100 * iv["high"], color="k", alpha=0.08)
        ax.set_title(f"last-word accuracy % ({base['lastword_examples']} examples)")
        ax.legend(loc="lower right")
    ax.tick_params(axis="x", rotation=30)
    ax = axes[3]
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
    fig.suptitle(f"lowbit compare: {report['model']['path']} (error bars: 95% intervals)", fontsize=10)
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
