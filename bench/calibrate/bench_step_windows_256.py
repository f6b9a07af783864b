"""nvfp4 at its default on the peers' 16 x 256 calibration windows with a whole batch (4 windows)
or 2 windows a reconstruction step, scored as bench/mixed scores (4599 tokens); the one-window
row is bench/mixed's uniform nvfp4 row. Run from the repository root; figures in
bench/calibrate/RESULTS-calibrate.md ("Shorter windows").
"""
import json, sys, time, os
sys.path.insert(0, "bench/mixed"); sys.path.insert(0, "bench/peers")
import torch, lowbit
from bench_mixed import eval_ids, calib_ids
from worker import perplexity
model, tok = lowbit.load_model()
ids, calib = eval_ids(tok, 4096, 512), calib_ids(tok)
del model
for scheme, bs in [("nvfp4", None), ("nvfp4", 2)]:
    m, _ = lowbit.load_model()
    t0, c0 = time.perf_counter(), time.process_time()
    q = lowbit.quantize(m, scheme, calibration=calib, progress=False, reconstruct_batch_size=bs)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    lowbit.use_backend(q, "auto")
    ppl, n = perplexity(q, ids, 512)
    print(json.dumps({"scheme": scheme, "windows_a_step": bs or "batch", "cpu": round(cpu, 1), "wall": round(wall, 1), "ppl": ppl, "tokens": n, "load": os.getloadavg()}), flush=True)
