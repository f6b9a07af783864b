"""nvfp4 at its default on the peers' 16 x 256 calibration windows with a whole batch (4 windows)
or 2 windows a reconstruction step, scored as bench/mixed scores (4599 tokens); the one-window
row is bench/mixed's uniform nvfp4 row. Run from the repository root; figures in
bench/calibrate/RESULTS-calibrate.md ("Shorter windows").

    .venv/bin/python bench/calibrate/bench_step_windows_256.py
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(BENCH / "mixed"), str(BENCH / "peers")]

import lowbit  # noqa: E402
from bench_mixed import calib_ids, eval_ids  # noqa: E402  (bench/mixed: the same windows and ids)
from worker import perplexity  # noqa: E402  (bench/peers: the same scoring)


def main() -> None:
    model, tok = lowbit.load_model()
    ids, calib = eval_ids(tok, 4096, 512), calib_ids(tok)
    del model
    for windows in (None, 2):  # None: a whole calibration batch a step
        m, _ = lowbit.load_model()
        t0, c0 = time.perf_counter(), time.process_time()
        q = lowbit.quantize(m, "nvfp4", calibration=calib, progress=False, reconstruct_batch_size=windows)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        lowbit.use_backend(q, "auto")
        ppl, n = perplexity(q, ids, 512)
        print(json.dumps({"scheme": "nvfp4", "windows_a_step": windows or "batch", "cpu": round(cpu, 1),
                          "wall": round(wall, 1), "ppl": ppl, "tokens": n, "load": os.getloadavg()}), flush=True)


if __name__ == "__main__":
    main()
