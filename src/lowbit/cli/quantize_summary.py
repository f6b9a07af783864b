"""``lowbit quantize``'s report of a finished run: what engines serve the folder, then the summary
as JSON or as lines (what was quantized, calibrated, smoothed, rotated; where it went)."""

from __future__ import annotations

import json

from lowbit.cli.app import console
from lowbit.cli.common import human_bytes
from lowbit.cli.quantize_plan import QuantizePlan


def serving_verdicts(plan: QuantizePlan, summary: dict, chosen) -> list:
    """What engines do with the written folder (its layout's ``serving_verdicts``, measured), one
    verdict per distinct line, also written into ``summary["serving"]``."""
    from lowbit.cli.recipe_options import used_schemes
    from lowbit.formats import get_layout
    from lowbit.run_path import RunPath

    if plan.path is RunPath.GGUF:  # llama.cpp runs every type it defines
        return []
    layout = get_layout(plan.checkpoint_format)
    verdicts: list = []
    for s in used_schemes(plan.assignment, chosen):
        verdicts += [v for v in layout.serving_verdicts(plan.output, s) if v.line() not in {w.line() for w in verdicts}]
    if verdicts:
        summary["serving"] = [{"engine": v.engine, "serving": v.serving.value, "detail": v.detail} for v in verdicts]
    return verdicts


def _quantized_line(q: dict) -> str:
    kept = f"; kept in float: {len(q['unquantized_targets'])} weight matrices lowbit cannot quantize" \
        if q["unquantized_targets"] else ""
    kept += "".join(f"; {kind} x{n}" for kind, n in q.get("float_weights", {}).items())
    moe = f", {q['expert_linears']} of them in {q['experts']} experts of {q['moe_blocks']} MoE blocks" \
        if q["moe_blocks"] else ""
    spread = q["expert_input_scale_spread"]
    if spread:
        moe += "; per-expert input scales, max/min: " + ", ".join(f"{k} x{v:.2f}" for k, v in spread.items())
    return (f"quantized {q['linears']} linears{moe} ({q['weight_parameters'] / 1e6:.1f}M weights; "
            f"{q['float_parameters'] / 1e6:.1f}M parameters stay float: embeddings, norms, routers{kept})")


def summary_lines(plan: QuantizePlan, summary: dict, verdicts: list) -> list[str]:
    """The summary as the lines the command prints."""
    lines = []
    q = summary.get("quantized")
    if q is not None:
        lines.append(_quantized_line(q))
    if summary.get("calibration"):
        from lowbit.report.calibration import describe_calibration

        lines.append(describe_calibration(summary["calibration"]))
    if summary.get("smoothing"):
        from lowbit.report.smoothing import describe_smoothing

        lines.append(describe_smoothing(summary["smoothing"]))
    if q is not None and q.get("rotation"):
        lines.append(q["rotation"])
    if summary.get("kv_cache"):
        ks = summary["kv_scales"] or {}
        lines.append(f"KV cache {summary['kv_cache']}: k_scale/v_scale on {len(ks)} attention layers")
    ranks = f" on {summary['ranks']} ranks" if (summary.get("ranks") or 1) > 1 else ""
    streamed = f"; streamed, peak RSS {human_bytes(summary['peak_rss'])}" + (" (rank 0)" if ranks else "") \
        if summary.get("streamed") else ""
    if summary.get("auto_recipe"):
        a = summary["auto_recipe"]
        lines.append(f"chose a scheme per layer for {a['target_bits']:g} average weight bits: "
                     f"{a['average_bits']:.3f} reached, {a['counts']} (predicted loss +{a['predicted_loss']:.3g} nats; "
                     f"measured on {len(a['windows'])} of {a['calibration']['samples']} calibration windows in "
                     f"{a['seconds']:.1f} s)")
    if q is not None and q.get("schemes") and len(q["schemes"]) > 1:
        lines.append("linears per scheme: " + ", ".join(f"{k} {v}" for k, v in q["schemes"].items()) +
                     f"; {q['average_bits']:.3f} average weight bits")
    if summary.get("gguf"):
        g = summary["gguf"]
        lines.append("GGML types: " + ", ".join(f"{k} x{v}" for k, v in g["counts"].items()) +
                     ("; scale search weighted by an importance matrix from the calibration text" if g["importance"]
                      else "; llama.cpp's reference rounding (no importance matrix)"))
    if summary.get("recipe"):
        lines.append(f"recipe used: {summary['recipe']} (reusable with --recipe)")
    what = "file" if summary.get("gguf") else "weights"
    lines.append(f"wrote {plan.output} ({plan.assignment.label}, {plan.checkpoint_format}, {what} "
                 f"{human_bytes(summary['size_bytes'])} on disk) in {summary['seconds']:.1f} s{ranks}{streamed}")
    lines += [f"serving, {v.line()}" for v in verdicts]
    return lines


def print_summary(plan: QuantizePlan, summary: dict, chosen) -> None:
    """Print the run's summary: JSON with ``--json``, else one line per fact."""
    verdicts = serving_verdicts(plan, summary, chosen)
    if plan.as_json:
        print(json.dumps(summary, indent=2, default=str))
        return
    for line in summary_lines(plan, summary, verdicts):
        console.print(line, highlight=False)
