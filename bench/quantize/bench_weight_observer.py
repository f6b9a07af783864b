"""Weight observers (``max``, ``mse``, ``full-range``) on the real SmolLM2-135M: perplexity vs float and RTN time.

For each scheme, the preset with its weight spec's observer set to "max" and to "mse" (every
other field unchanged), in one process side by side with the float model, on the same
held-out windows of *Persuasion* (``--windows`` x ``--window`` tokens, the first token of each
window not scored). Schemes with static activation scales (nvfp4: the static input global
scale) are calibrated on the packaged Emma text (``--samples`` x 512 tokens, the same for both
observers); the others are plain RTN. ``rtn s``: seconds to quantize every linear of the model
(``quantize_rtn`` on a copy: scales, codes, packing), the extra cost of the search.

``--observers`` picks among max, mse and full-range (symmetric INT weights only: scale = signed
extreme / -8, the rule auto-round uses for symmetric INT4).

    PYTHONPATH=src .venv/bin/python bench/quantize/bench_weight_observer.py [--windows 8] [--schemes ...]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

import lowbit
from lowbit.model_quant import every_linear, quantize_rtn
from lowbit.report.compare import set_backends
from lowbit.errors import SchemeError
from lowbit.schemes import PRESETS, WeightObserver, Scheme

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quantize import SHARED, eval_windows, load_smollm2, perplexity  # noqa: E402

SCHEMES = ["w4a16", "nvfp4a16", "nvfp4", "nvfp4-e5m3", "mxfp4", "mxfp8", "w8a16", "w8a8-fp8-dynamic"]


def with_observer(name: str, observer: WeightObserver) -> Scheme:
    p = PRESETS[name]
    return Scheme(name, dataclasses.replace(p.weights, observer=observer), p.input_activations)


def observers_for(name: str, wanted) -> list[WeightObserver]:
    """The wanted observers that the preset's weight spec accepts (full-range: symmetric INT)."""
    out = []
    for obs in wanted:
        try:
            with_observer(name, obs)
        except SchemeError:
            continue
        out.append(obs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemes", nargs="+", default=SCHEMES)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--samples", type=int, default=4, help="calibration windows for schemes that need them")
    ap.add_argument("--observers", nargs="+", default=["max", "mse", "full-range"],
                    help="weight observers to compare (each where the scheme's weight spec takes it)")
    ap.add_argument("--float-ppl", type=float, default=None,
                    help="the float model's perplexity on the same windows from an earlier run (skips it)")
    ap.add_argument("--eval-file", default=str(SHARED / "persuasion.txt"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    torch.manual_seed(0)
    model, tok = load_smollm2()
    windows = eval_windows(tok, args.eval_file, args.windows, args.window)
    print(f"# SmolLM2-135M, eval {args.windows} x {args.window} tokens of {Path(args.eval_file).name}; "
          f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()}", flush=True)
    ppl_f = args.float_ppl if args.float_ppl is not None else perplexity(model, windows)[0]
    print(f"float32 ppl {ppl_f:.3f}{' (given)' if args.float_ppl is not None else ''}", flush=True)
    rows = [dict(config="float32", ppl=ppl_f)]
    print("| scheme | observer | ppl | vs float | rtn s | load |\n|---|---|---|---|---|---|", flush=True)
    for name in args.schemes:
        for obs in observers_for(name, [WeightObserver(o) for o in args.observers]):
            scheme = with_observer(name, obs)
            m = copy.deepcopy(model)
            t = time.perf_counter()
            quantize_rtn(m, every_linear(m, scheme))
            rtn_s = time.perf_counter() - t
            if scheme.needs_calibration:
                m = lowbit.quantize(copy.deepcopy(model), scheme, "builtin", tokenizer=tok,
                                    num_samples=args.samples, seq_len=512)
            set_backends(m, "fast")  # the automatic exact backend; weight cache where that is the reference
            ppl, _ = perplexity(m, windows)
            row = dict(scheme=name, observer=obs.value, ppl=ppl, delta_pct=100 * (ppl / ppl_f - 1), rtn_s=rtn_s,
                       load=os.getloadavg()[0])
            rows.append(row)
            print(f"| {name} | {obs.value} | {ppl:.3f} | {row['delta_pct']:+.2f}% | {rtn_s:.1f} | {row['load']:.1f} |",
                  flush=True)
            del m
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
