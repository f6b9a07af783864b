"""The calibrated GGUF path's two searches, native (C) against torch, single thread, side by side:
the direct importance search of Q5_0 (``encode(..., search=DIRECT)``, a 1536 x 576 weight: SmolLM2's
MLP down projection's shape) and GPTQ on a GGML grid (576 x 1536 Q6_K, 1536 x 576 Q5_0). Each figure
is the median of ``--repeat`` runs, the two implementations alternating; the bits are checked equal.
GPTQ's time includes the factor of the Hessian (torch's Cholesky in both): it is timed alone too.

    PYTHONPATH=src python bench/gguf/bench_native_search.py
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from pathlib import Path

import torch

from lowbit.algorithms.gptq import GPTQOptions, prepare_part
from lowbit.algorithms.gptq_grid import gptq_on_grid
from lowbit.kernels import Implementation, using
from lowbit.kernels.ggml import encode
from lowbit.numerics.ggml import GgmlType, ImportanceSearch
from lowbit.numerics.ggml_codes import grid_of


def _cpu() -> str:
    text = Path("/proc/cpuinfo").read_text()
    model = re.search(r"model name\s*:\s*(.*)", text)
    flags = set(re.search(r"flags\s*:\s*(.*)", text).group(1).split())
    keep = sorted(f for f in flags if f.startswith(("avx512f", "avx512_vnni", "amx")) or f in ("avx2", "fma"))
    return f"{model.group(1) if model else '?'}; {' '.join(keep)}"


def _time(fn, repeat: int) -> tuple[dict[str, float], object]:
    times: dict[str, list[float]] = {"native": [], "torch": []}
    outs = {}
    for _ in range(repeat):
        for name, impl in (("native", Implementation.NATIVE), ("torch", Implementation.TORCH)):
            with using(impl):
                t = time.perf_counter()
                outs[name] = fn()
                times[name].append(time.perf_counter() - t)
    assert torch.equal(outs["native"], outs["torch"]), "native and torch disagree"
    return {k: statistics.median(v) for k, v in times.items()}, outs["native"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    print(f"cpu: {_cpu()}\ntorch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, 1 thread")
    print(f"loadavg before: {Path('/proc/loadavg').read_text().strip()}")
    rows = []
    W = torch.randn(1536, 576, generator=g) * torch.rand(1536, 1, generator=g) * 0.05
    imp = torch.exp(2 * torch.randn(576, generator=g))
    t, _ = _time(lambda: encode(W, GgmlType.Q5_0, importance=imp, search=ImportanceSearch.DIRECT), args.repeat)
    rows.append(("encode Q5_0 direct search, 1536 x 576", t))
    for kind, (o, i) in ((GgmlType.Q6_K, (576, 1536)), (GgmlType.Q5_0, (1536, 576))):
        W = torch.randn(o, i, generator=g) * 0.05
        x = torch.randn(2048, i, generator=g) * (1 + 3 * torch.rand(i, generator=g))
        H = (x.T @ x).double()
        grid = grid_of(encode(W, kind), kind)
        t, _ = _time(lambda: gptq_on_grid(W, H, grid), args.repeat)
        rows.append((f"gptq_on_grid {kind.value}, {o} x {i}", t))
        f, _ = _time(lambda: prepare_part(W, H, GPTQOptions(), "w")[1], args.repeat)  # the same in both
        rows.append((f"  of which the factor of H (prepare_part, torch in both), {i} x {i}", f))
        rows.append((f"  the rest: column loop + block updates, {kind.value}",
                     {k: t[k] - f[k] for k in t}))
    print("\n| operation | native s | torch s | speedup |\n|---|---|---|---|")
    for name, t in rows:
        print(f"| {name} | {t['native']:.4f} | {t['torch']:.4f} | {t['torch'] / t['native']:.1f}x |")
    print(f"\nloadavg after: {Path('/proc/loadavg').read_text().strip()}")


if __name__ == "__main__":
    main()
