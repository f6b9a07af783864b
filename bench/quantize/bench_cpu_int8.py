"""cpu-int8 linear layers against float32 F.linear at prefill sizes (M = batch x seq >= 512).

Shapes are SmolLM2-135M's linears (hidden 576, intermediate 1536, 3 kv heads of 64), plus a
2048x2048 layer. Both sides run in the same process, interleaved (3 rounds of ``--reps``
calls each), and the fastest call of each is reported: on a shared machine the minimum is the
best estimate of the cost itself (the load average is printed). The cpu-int8 time includes
everything the backend does per call: input quantization (static per-tensor or dynamic
per-token; never shared with a sibling here), the exact chunked GEMM, int32 chunk sums,
scales and bias.

    .venv/bin/python bench/quantize/bench_cpu_int8.py [--reps 15] [--threads 1] [--int-mm]

On a machine shared with other jobs, two threads per op pay for every barrier in each small
element-wise op (the int8 path has a few: quantize the input, scale the output); one thread
(--threads 1) measures the arithmetic itself.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from lowbit.backends.cpu_int8 import CpuInt8Backend
from lowbit.calibration import input_scales_from_amax
from lowbit.modules import QuantLinear
from lowbit.schemes import get_scheme

SHAPES = [  # (name, in, out)
    ("q_proj/o_proj", 576, 576),
    ("k_proj/v_proj", 576, 192),
    ("gate/up_proj", 576, 1536),
    ("down_proj", 1536, 576),
    ("2048x2048", 2048, 2048),
]


def fresh(be, module, x):
    """Each call quantizes its input: drop what a sibling linear would have shared."""
    be.shared.clear()
    return be.forward(module, x)


def timeit(fn, reps: int) -> list[float]:
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--m", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--int-mm", action="store_true", help="also time torch._int_mm once (slow here)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"cpu capability {torch.backends.cpu.get_cpu_capability()}, load average {os.getloadavg()}")
    print("| shape (in->out) | M | fp32 F.linear ms | cpu-int8 static ms | ratio | cpu-int8 dynamic ms | ratio |")
    print("|---|---|---|---|---|---|---|")
    be = CpuInt8Backend()
    for name, k, n in SHAPES:
        lin = nn.Linear(k, n)
        for m in args.m:
            x = torch.randn(m, k)
            st = QuantLinear.from_linear(lin, get_scheme("w8a8-int8"), name=name,
                                         **input_scales_from_amax(get_scheme("w8a8-int8").input_activations,
                                                                  x.abs().amax().reshape(1)))
            dy = QuantLinear.from_linear(lin, get_scheme("w8a8-int8-dynamic"), name=name)
            tf, ts, td = [], [], []
            for _ in range(3):  # interleave rounds so load changes hit both sides
                tf += timeit(lambda: F.linear(x, lin.weight, lin.bias), args.reps)
                ts += timeit(lambda: fresh(be, st, x), args.reps)
                td += timeit(lambda: fresh(be, dy, x), args.reps)
            f, s, d = (min(t) * 1e3 for t in (tf, ts, td))
            print(f"| {name} ({k}->{n}) | {m} | {f:.2f} | {s:.2f} | {s / f:.2f} | {d:.2f} | {d / f:.2f} |",
                  flush=True)
    if args.int_mm:
        k = n = 2048
        m = 256
        a = torch.randint(-128, 128, (m, k), dtype=torch.int8)
        b = torch.randint(-128, 128, (k, n), dtype=torch.int8)
        t_int = timeit(lambda: torch._int_mm(a, b), 1)
        t_f = timeit(lambda: a.float() @ b.float(), 3)
        print(f"torch._int_mm 2048x2048, M=256: {statistics.median(t_int) * 1e3:.1f} ms vs float32 "
              f"{statistics.median(t_f) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
