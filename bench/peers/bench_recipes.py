"""One lowbit calibration recipe on SmolLM2, scored exactly as bench/peers scores the peers.

    .venv/bin/python bench/peers/bench_recipes.py --scheme nvfp4 --preset best [--layers 4] [--threads 1]
    .venv/bin/python bench/peers/bench_recipes.py --scheme nvfp4 --options '{"weight_rounding": "rtn"}'
    .venv/bin/python bench/peers/bench_recipes.py --model FOLDER --scheme float   # the float ppl of another model

The evaluation ids are bench/peers/run_peers.py's (lowbit's built-in evaluation text, --limit
tokens in 512-token windows) and the perplexity is bench/peers/worker.py's, so a row here sits
beside the peers' rows of bench/peers/RESULTS.md. Calibration: the built-in calibration file, 16 x 256
tokens (lowbit's evenly spaced windows, the same ones run_peers.py hands the tuned peers) unless
the preset sets its own budget (``fast``: 4 x 128) or --options say otherwise; the JSON line
prints the options used. ``--layers N`` quantizes decoder layers 0..N-1 only, as
run_peers.py --layers does. Prints one JSON line: quantization wall and CPU seconds, perplexity,
its change against --float-ppl, and the per-layer reconstruction report when there is one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from worker import perplexity  # noqa: E402  (bench/peers/worker.py: the peers' scoring)

import lowbit  # noqa: E402
from lowbit.calibration.config import CALIBRATION_PRESETS  # noqa: E402
from lowbit.eval.text import default_calibration_text_path, read_text  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scheme", default="nvfp4", help="a lowbit scheme, or 'float' (no quantization)")
    ap.add_argument("--model", default=None, help="a float model folder (default: the built-in SmolLM2-135M)")
    ap.add_argument("--preset", default=None, help="a lowbit calibration preset (fast, default, gptq-fast, best)")
    ap.add_argument("--options", default="{}", help="lowbit.quantize calibration options as JSON (override the preset)")
    ap.add_argument("--layers", type=int, default=None, help="quantize decoder layers 0..N-1 only")
    ap.add_argument("--limit", type=int, default=8687, help="evaluation tokens")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--float-ppl", type=float, default=45.905, help="the float model's perplexity on these ids")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model, tok = lowbit.load_model(a.model)
    ids = tok(read_text(), add_special_tokens=False, return_tensors="pt").input_ids[0]
    ids = ids[: -(-a.limit // (a.window - 1)) * a.window].contiguous()
    ignore = []
    if a.layers is not None:
        ignore = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                  and n.startswith("model.layers.") and int(n.split(".")[2]) >= a.layers]
    # the peers' 16 x 256 calibration tokens, unless the preset sets its own budget (fast: 4 x 128,
    # best: 64 windows; pass --options '{"num_samples": 16}' for the peers' tokens)
    own = CALIBRATION_PRESETS.get(a.preset, {})
    opts = {k: v for k, v in (("num_samples", 16), ("seq_len", 256)) if k not in own}
    opts.update(json.loads(a.options))
    load = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    if a.scheme != "float":
        lowbit.quantize(model, a.scheme, calibration=str(default_calibration_text_path()), tokenizer=tok,
                        ignore=ignore, preset=a.preset, progress=False, **opts)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    rec = getattr(getattr(model, "lowbit_calibration", None), "reconstruct", {})
    if a.scheme != "float":
        lowbit.use_backend(model, "auto")
    if a.model is None:
        ppl, n = perplexity(model, ids, a.window)
    else:  # another model: lowbit's own evaluation (its BOS per window; Gemma needs it)
        from lowbit.eval import perplexity as lowbit_perplexity

        r = lowbit_perplexity(model, tok, window=a.window, limit=a.limit, progress=False)
        ppl, n = r.perplexity, r.tokens_scored
    print(json.dumps({"scheme": a.scheme, "preset": a.preset, "options": opts, "layers": a.layers, "threads": a.threads,
                      "load_at_start": round(load, 2), "quant_wall_s": round(wall, 1), "quant_cpu_s": round(cpu, 1),
                      "ppl": round(ppl, 3), "change": f"{100 * (ppl / a.float_ppl - 1):+.2f}%", "tokens": n,
                      "reconstruct": {k: {"mse_start": v["mse_start"], "mse_end": v["mse_end"]} for k, v in rec.items()}}))


if __name__ == "__main__":
    main()
