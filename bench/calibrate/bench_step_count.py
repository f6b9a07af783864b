"""Reconstruction steps per layer against perplexity and time, side by side (issue 35).

For each ``--rows`` entry SCHEME:ITERS[:SHIFT] (SHIFT: which 16 of the built-in calibration
text's 512-token windows, as in bench_step_windows.py; 0, lowbit's own choice, when left out),
quantizes the built-in SmolLM2-135M with ``lowbit.quantize``'s defaults and ``reconstruct_iters``
ITERS, and scores perplexity on the first 1024 tokens of the built-in evaluation text (the main
job's figure) and on all of it (512-token windows).

    .venv/bin/python bench/calibrate/bench_step_count.py --rows nvfp4:16,nvfp4:10 [--out rows.jsonl]

One JSON line per row (wall and CPU seconds of the quantization, its phases, load average);
figures in bench/calibrate/RESULTS-calibrate.md.
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import lowbit
from bench_step_windows import add_row, calibration, float_row, scores


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="nvfp4:16,nvfp4-e5m3:16")
    ap.add_argument("--out", default="step-count.jsonl")
    a = ap.parse_args()
    model, tok = lowbit.load_model()
    model.eval()
    rows = [float_row(model, tok)]
    for spec in a.rows.split(","):
        scheme, iters, *rest = spec.split(":")
        shift = int(rest[0]) if rest else 0
        m = copy.deepcopy(model)
        t0, c0 = time.perf_counter(), time.process_time()
        q = lowbit.quantize(m, scheme, calibration=calibration(tok, shift), tokenizer=tok, progress=False,
                            reconstruct_iters=int(iters))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        short, whole, n = scores(q, tok)
        add_row(rows, {"scheme": scheme, "iters": int(iters), "shift": shift, "wall": wall, "cpu": cpu,
                       "ppl1024": short, "ppl_all": whole, "tokens": n,
                       "phases": q.lowbit_calibration.cost.as_dict(), "load": os.getloadavg()}, a.out)
        del q, m


if __name__ == "__main__":
    main()
