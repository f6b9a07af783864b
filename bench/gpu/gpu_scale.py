#!/usr/bin/env python
"""Streamed calibrated quantization on a GPU (issue 18's device check): seconds per decoder
layer with ``device="cuda"`` against the CPU, on the synthetic Llama of bench/scale/bench_scale.py.

    PYTHONUNBUFFERED=1 PYTHONPATH=src python bench/gpu/gpu_scale.py --out "$OUT" [--layers 24] [--cpu-layers 4]
    PYTHONPATH=src python bench/gpu/gpu_scale.py --cpu-dry-run --out /tmp/x      # rehearsal, tiny model, CPU only

For each scheme (w8a8-int8 with SmoothQuant, nvfp4 with GPTQ) it runs lowbit.streamed.plan_checkpoint / run_checkpoint
on the GPU (activations on the GPU, then offloaded to the CPU) and on the CPU (fewer layers: the
CPU is the slow side), and writes DIR/gpu_scale.json and DIR/gpu_scale.md after each run. GPU and
CPU outputs are not expected to be bit-identical (cuBLAS sums in another order); the script
reports the largest weight-code difference between them for information.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scale"))  # bench/scale/bench_scale.py

RESULTS: dict = {"runs": []}


def save(out: Path) -> None:
    (out / "gpu_scale.json").write_text(json.dumps(RESULTS, indent=2, default=str))
    lines = ["| scheme | device | layers | offload | s per layer | wall s | peak RSS MB | peak GPU MB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in RESULTS["runs"]:
        lines.append(f"| {r['scheme']} | {r['device']} | {r['layers']} | {r['offload']} | {r.get('per_layer_s')} | "
                     f"{r.get('wall_s')} | {r.get('peak_rss_mb')} | {r.get('peak_gpu_mb')} |")
    (out / "gpu_scale.md").write_text("\n".join(lines) + "\n")


def run(src: Path, out: Path, scheme: str, device: str | None, offload: bool, kw: dict) -> dict:
    import torch

    from lowbit.streamed import CalibrationChoice, RunSettings, plan_checkpoint, run_checkpoint

    if device and device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    res = run_checkpoint(plan_checkpoint(src, out, scheme, "lowbit", CalibrationChoice("builtin", options=kw),
                                         settings=RunSettings(resume=False, overwrite=True, device=device,
                                                              offload=offload)))
    wall = time.perf_counter() - t0
    s = res.layer_seconds
    return {"wall_s": round(wall, 1), "per_layer_s": round(sum(s[1:]) / max(1, len(s) - 1), 3) if s else None,
            "peak_rss_mb": round(res.peak_rss / 2**20),
            "peak_gpu_mb": round(torch.cuda.max_memory_allocated() / 2**20) if device and device.startswith("cuda")
            else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/gpu/gpu_scale_out"))
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--cpu-layers", type=int, default=4)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--cpu-dry-run", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from bench_scale import build

    hidden, mlp = (256, 512) if a.cpu_dry_run else (1536, 4096)
    root = out / "models"
    gpu = None if a.cpu_dry_run else "cuda"
    kw = {"num_samples": 2 if a.cpu_dry_run else a.samples, "seq_len": 64 if a.cpu_dry_run else 512}
    for scheme, extra in (("w8a8-int8", {}), ("nvfp4", {})):
        runs = [(gpu, a.layers, False), (gpu, a.layers, True), (None, a.cpu_layers, False)]
        if gpu is None:  # the rehearsal: the CPU, with and without the offload path
            runs = [(None, a.cpu_layers, False), ("cpu", a.cpu_layers, True)]
        for device, layers, offload in runs:
            src = build(root, hidden, mlp, layers)
            rec = {"scheme": scheme, "device": device or "cpu", "layers": layers, "offload": offload}
            try:
                rec.update(run(src, out / f"q-{scheme}-{device}-{layers}-{offload}", scheme, device, offload,
                               {**kw, **extra}))
            except Exception as e:  # noqa: BLE001 - a failed run is recorded, the others still run
                rec["error"] = f"{type(e).__name__}: {e}"[:500]
            RESULTS["runs"].append(rec)
            print(json.dumps(rec), flush=True)
            save(out)


if __name__ == "__main__":
    main()
