"""Mixed precision against uniform schemes on the whole evaluation text and two calibration draws.

bench_mixed.py scores 4599 tokens on the peers' 16 x 256 windows, where one calibration draw
moves a 4-bit row by about a point; this bench scores every row on the whole built-in evaluation
text (26895 tokens, 512-token windows) after calibrating on the main job's 16 x 512 windows and on
a second draw (``--shifts``: every window index moved along the built-in text, as in
bench/calibrate/bench_step_windows.py), so that a difference between a recipe and a uniform scheme
can be read against the draw-to-draw spread. Rows: a scheme name, or ``auto:BITS:C1+C2+...``
(``lowbit.auto_recipe`` on the same windows, its choice time included), or a recipe file.
``--model FOLDER`` runs another float model (e.g. Gemma-3-270M expanded by
``lowbit.models.builtin.convert_gguf``); the evaluation is lowbit's own, a BOS per window.

    .venv/bin/python bench/mixed/bench_mixed_draws.py --rows nvfp4-e5m3,auto:4.5:nvfp4+nvfp4-e5m3+mxfp4+w8a8-fp8 \\
        --shifts 0,2 [--out rows.jsonl]

One JSON line per row; figures in bench/mixed/RESULTS-mixed.md.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "calibrate"))
from bench_step_windows import add_row, calibration, float_row, scores  # noqa: E402

import lowbit  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="nvfp4,nvfp4-e5m3,auto:4.5:nvfp4+nvfp4-e5m3+mxfp4+w8a8-fp8")
    ap.add_argument("--shifts", default="0,2")
    ap.add_argument("--out", default="mixed-draws.jsonl")
    ap.add_argument("--model", default=None, help="a float model folder (default: the built-in SmolLM2-135M)")
    ap.add_argument("--limit", type=int, default=None, help="evaluation tokens (default: the whole text)")
    a = ap.parse_args()
    model, tok = lowbit.load_model(a.model)
    model.eval()
    rows = [float_row(model, tok, a.limit)]
    for shift in map(int, a.shifts.split(",")):
        for spec in a.rows.split(","):
            m = copy.deepcopy(model)
            calib = calibration(tok, shift)
            t0, c0 = time.perf_counter(), time.process_time()
            auto = None
            plan = spec
            if spec.startswith("auto:"):
                _, bits, cands = spec.split(":")
                auto = lowbit.auto_recipe(m, cands.replace("+", ","), float(bits), calib, tokenizer=tok)
                plan = auto.recipe
            q = lowbit.quantize(m, plan, calibration=calib, tokenizer=tok, progress=False)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            short, whole, n = scores(q, tok, a.limit)
            row = {"row": spec, "shift": shift, "wall": wall, "cpu": cpu, "ppl1024": short, "ppl_all": whole,
                   "tokens": n, "load": os.getloadavg()}
            if auto is not None:
                row.update(average_bits=auto.average_bits, counts=auto.counts(), choice_s=auto.seconds)
            add_row(rows, row, a.out)
            del q, m


if __name__ == "__main__":
    main()
