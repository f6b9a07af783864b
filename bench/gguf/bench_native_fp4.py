"""GGML's FP4 encoders, native (C: ggml_fp4_native.c) against the torch reference, side by side:
``lowbit.kernels.ggml.encode(W, "mxfp4" | "nvfp4")`` on SmolLM2-135M's shapes, its tied token
embedding [49152, 576] and an MLP down projection [1536, 576], random float32. Each figure is the
median of ``--repeat`` runs, the two implementations alternating; the bytes are checked equal.
The reference runs on ``--threads`` intra-op threads (the C encoder on one thread always).

    PYTHONPATH=src python bench/gguf/bench_native_fp4.py [--threads 1] [--repeat 3]
"""

from __future__ import annotations

import argparse
import sys
import statistics
import time
from pathlib import Path

import torch

from lowbit.kernels import Implementation, using
from lowbit.kernels.ggml import encode
from lowbit.numerics.ggml import GgmlType


def _cpu() -> str:
    """The CPU model and its vector flags (``bench_native_search``'s line)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_native_search import _cpu as cpu_line

    return cpu_line()


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the reference)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"cpu: {_cpu()}; {torch.get_num_threads()} torch thread(s), the C encoder 1")
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}; load before: {_load()}")
    print("\n| tensor | type | native s | reference s | speedup |\n|---|---|---|---|---|")
    for shape in ((49152, 576), (1536, 576)):
        W = torch.randn(*shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 0.05
        for kind in (GgmlType.MXFP4, GgmlType.NVFP4):
            times: dict[str, list[float]] = {"native": [], "reference": []}
            outs = {}
            encode(W[:2], kind)  # the library is built and loaded before the clock runs
            for _ in range(args.repeat):
                for name, impl in (("native", Implementation.NATIVE), ("reference", Implementation.TORCH)):
                    with using(impl):
                        t = time.perf_counter()
                        outs[name] = encode(W, kind)
                        times[name].append(time.perf_counter() - t)
            assert torch.equal(outs["native"], outs["reference"]), f"{kind.value} {shape}: bytes differ"
            nat, ref = (statistics.median(times[k]) for k in ("native", "reference"))
            print(f"| {shape[0]} x {shape[1]} | {kind.value} | {nat:.4f} | {ref:.3f} | {ref / nat:.0f}x |", flush=True)
    print(f"\nload after: {_load()}")


if __name__ == "__main__":
    main()
