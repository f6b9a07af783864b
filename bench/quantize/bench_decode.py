"""Forward time of the built-in SmolLM2-135M per scheme and backend, against float, at M = 1
(one-token decode steps with a KV cache: what generation does) and M = 512 (a prefill window).

Per scheme (round-to-nearest; static schemes calibrated on 2 x 128 built-in tokens: the time does
not depend on the scales), for each backend asked: the median time of ``--steps`` decode steps
after a 32-token prompt, and of ``--reps`` 512-token forwards, each as a ratio to the float
model's, timed interleaved in the same process. Times are process CPU time (all threads;
``--clock wall`` for wall time): on a shared machine CPU time is the steadier measure of the
work a forward does. Prints a markdown table.

    .venv/bin/python bench/quantize/bench_decode.py [--schemes nvfp4-e5m3,w8a8-int8,...] [--backends default,reference]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch

import lowbit
from lowbit.models import load_model

DEFAULT_SCHEMES = "nvfp4-e5m3,nvfp4,w8a8-int8,w8a8-int8-dynamic,w8a8-fp8,mxfp4,w4a16"


CLOCK = time.process_time


def decode_times(model, steps: int, prompt: torch.Tensor) -> list[float]:
    times = []
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            t0 = CLOCK()
            out = model(nxt, past_key_values=past, use_cache=True)
            times.append(CLOCK() - t0)
            past = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
    return times


def prefill_times(model, reps: int, ids: torch.Tensor) -> list[float]:
    times = []
    with torch.no_grad():
        for _ in range(reps):
            t0 = CLOCK()
            model(ids, use_cache=False)
            times.append(CLOCK() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schemes", default=DEFAULT_SCHEMES)
    ap.add_argument("--backends", default="default", help="'default' (what lowbit.load gives) and/or backend names")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(None)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 49152, (1, 32), generator=g)
    ids = torch.randint(0, 49152, (1, 512), generator=g)
    calib = torch.randint(0, 49152, (2, 128), generator=g)
    print(f"torch threads {torch.get_num_threads()}, {args.clock} clock, load average {os.getloadavg()[0]:.2f} at start")
    print(f"| scheme | backend | decode ms/token ({args.clock}) | x float | prefill 512 s | x float |")
    print("|---|---|---|---|---|---|")
    for name in args.schemes.split(","):
        scheme = lowbit.get_scheme(name)
        kw = {"calibration": calib, "num_samples": 2, "seq_len": 128} if scheme.needs_calibration else {}
        q = lowbit.quantize(copy.deepcopy(model), scheme, **kw)
        for be in args.backends.split(","):
            if be == "default":
                lowbit.use_backend(q, "auto")
            else:
                lowbit.use_backend(q, be)
            used = sorted({m.backend.name for m in q.modules() if hasattr(m, "weight_codes")})
            # interleave: float, quantized, float
            f1 = decode_times(model, args.steps, prompt)
            qd = decode_times(q, args.steps, prompt)
            f2 = decode_times(model, args.steps, prompt)
            fd = statistics.median(f1 + f2)
            fp1 = prefill_times(model, args.reps, ids)
            qp = prefill_times(q, args.reps, ids)
            fp2 = prefill_times(model, args.reps, ids)
            fp = statistics.median(fp1 + fp2)
            print(f"| {name} | {be} ({'/'.join(used)}) | {1e3 * statistics.median(qd):.1f} (float {1e3 * fd:.1f}) | "
                  f"{statistics.median(qd) / fd:.2f} | {statistics.median(qp):.2f} (float {fp:.2f}) | "
                  f"{statistics.median(qp) / fp:.2f} |", flush=True)
        del q
    print(f"load average {os.getloadavg()[0]:.2f} at end")


if __name__ == "__main__":
    main()
