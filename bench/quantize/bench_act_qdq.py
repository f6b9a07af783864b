"""Activation QDQ per preset: reference ``fake_quantize`` vs ``lowbit.quant.fast_qdq`` vs the GEMM it feeds.

For every preset's input-activation spec, an input [M, K] (SmolLM2-135M's K = 576 and 1536)
is quantized-dequantized by the reference and by the fast path (bit-identical, checked here
too), next to float32 F.linear(x, W[576, K]) of the same input. Rounds alternate between the
three and the fastest call of each is reported (the load average is printed).

    .venv/bin/python bench/quantize/bench_act_qdq.py [--m 512] [--reps 10] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from lowbit.kernels import Implementation, using
from lowbit.quant import fake_quantize as _fake_quantize, global_scale_from_amax
from lowbit.schemes import PRESETS, Dynamic, Granularity


def fake_quantize(x, spec, **kw):
    with using(Implementation.REFERENCE):
        return _fake_quantize(x, spec, **kw)


def fast_fake_quantize(x, spec, **kw):
    with using(Implementation.TORCH):
        return _fake_quantize(x, spec, **kw)


def best_ms(fn, reps: int) -> float:
    fn()
    out = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t)
    return out * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=512)
    ap.add_argument("--k", type=int, nargs="+", default=[576, 1536])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load average {os.getloadavg()}")
    print("| K | scheme (activation spec) | F.linear ms | reference QDQ ms | fast QDQ ms | speed-up | fast / F.linear |")
    print("|---|---|---|---|---|---|---|")
    for k in args.k:
        x = torch.randn(args.m, k) * torch.logspace(-2, 1, k)
        w = torch.randn(576, k)
        for name, scheme in PRESETS.items():
            spec = scheme.input_activations
            if spec is None:
                continue
            kw = {}
            if spec.global_scale:
                kw["global_scale"] = global_scale_from_amax(x.abs().amax(), spec)
            if spec.dynamic is Dynamic.STATIC and spec.granularity is Granularity.TENSOR:
                kw["scale"] = x.abs().amax().reshape(1) / 127.0
            ref, fast = fake_quantize(x, spec, **kw), fast_fake_quantize(x, spec, **kw)
            assert torch.equal(ref.view(torch.int32), fast.view(torch.int32)), name
            tl, tr, tf = [], [], []
            for _ in range(args.rounds):
                tl.append(best_ms(lambda: F.linear(x, w), args.reps))
                tr.append(best_ms(lambda: fake_quantize(x, spec, **kw), max(2, args.reps // 3)))
                tf.append(best_ms(lambda: fast_fake_quantize(x, spec, **kw), args.reps))
            lin, r, f = min(tl), min(tr), min(tf)
            print(f"| {k} | {name} ({spec.describe()}) | {lin:.2f} | {r:.2f} | {f:.2f} | {r / f:.1f}x | {f / lin:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
