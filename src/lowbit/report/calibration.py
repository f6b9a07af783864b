"""What a calibration ran on, in one line (``lowbit quantize``'s summary), from the report's
``data`` (``lowbit.calibration.inputs.CalibrationInfo.as_dict``)."""

from __future__ import annotations


def _source(s: dict) -> str:
    convs = f", {s['conversations']} conversations" if s["conversations"] else ""
    share = f", weight {s['weight']:g}" if s.get("weight", 1.0) != 1.0 else ""
    return f"{s['source']} ({s['kind']}, {s['samples']} samples{convs}{share}: {s['windows']} windows)"


def describe_calibration(data: dict) -> str:
    """``calibrated on SOURCE (kind, samples): N windows x T tokens, packing, chat template: X``."""
    sources = "; ".join(_source(s) for s in data["sources"])
    return (f"calibrated on {sources}: {data['samples']} windows of up to {data['seq_len']} tokens, "
            f"{data['tokens']} tokens counted, {data['packing']}, chat template: {data['chat_template']}")
