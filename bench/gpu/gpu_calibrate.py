#!/usr/bin/env python
"""Calibration on a GPU (issue 35's device check): seconds per decoder layer and peak GPU memory of
each scheme's default calibration for one Llama-3.1-8B-shaped layer in bf16, every step on the
device (observers, SmoothQuant, Hessians, GPTQ's column loop, reconstruction), and the
extrapolation to whole 8B and 70B models; plus GPTQ's GPU codes against the CPU's.

    PYTHONUNBUFFERED=1 PYTHONPATH=src python bench/gpu/gpu_calibrate.py --out "$OUT" [--budget-s 420]
    PYTHONPATH=src python bench/gpu/gpu_calibrate.py --cpu-dry-run --out /tmp/x   # rehearsal: tiny layer, CPU

Schemes: w8a8-int8 (static, SmoothQuant), nvfp4 and w4a16 (GPTQ + 20 reconstruction steps), at
lowbit.quantize's defaults (16 x 512 calibration tokens). The extrapolation multiplies the
per-layer seconds by the layer count (8B: 32 layers; 70B: 80 layers, each ~3.9x an 8B layer's
weights, which the per-layer seconds are scaled by) and adds nothing for lm_head (left in bf16 by
default). Writes OUT/gpu_calibrate.json and OUT/gpu_calibrate.md after each scheme, so a run cut
by the time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

RESULTS: dict = {"runs": [], "gptq_codes": None}
LAYER_PARAMS_70B_OVER_8B = 3.9  # (8192^2 * 2.5 + 3 * 8192 * 28672) / (4096^2 * 2.5 + 3 * 4096 * 14336)


def save(out: Path) -> None:
    (out / "gpu_calibrate.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    lines = ["| scheme | s per layer | peak GPU MB | 8B (32 layers) min | 70B (80 layers) min | phases (s per layer) |",
             "|---|---:|---:|---:|---:|---|"]
    for r in RESULTS["runs"]:
        s = r["per_layer_s"]
        lines.append(f"| {r['scheme']} | {s:.1f} | {r['peak_gpu_mb']:.0f} | {32 * s / 60:.1f} | "
                     f"{80 * s * LAYER_PARAMS_70B_OVER_8B / 60:.1f} | {r['phases']} |")
    if RESULTS["gptq_codes"]:
        lines.append("")
        lines.append(f"GPTQ codes, GPU torch loop vs CPU: {RESULTS['gptq_codes']}")
    (out / "gpu_calibrate.md").write_text("\n".join(lines) + "\n")


def model_8b(dry: bool, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(hidden_size=64, intermediate_size=160, num_attention_heads=4, num_key_value_heads=2) if dry else \
        dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8)
    cfg = LlamaConfig(vocab_size=1024, num_hidden_layers=1, max_position_embeddings=8192, rms_norm_eps=1e-5,
                      rope_theta=500000.0, tie_word_embeddings=False, **shape)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def gptq_codes(device: str, dry: bool) -> dict:
    """One down_proj-shaped weight and a Hessian of random inputs: nvfp4 GPTQ codes solved on the
    GPU (torch loop) against the CPU (native loop)."""
    from lowbit.algorithms.gptq import gptq_quantize
    from lowbit.schemes import PRESETS

    out_f, in_f = (64, 160) if dry else (4096, 14336)
    g = torch.Generator().manual_seed(0)
    W = torch.randn(out_f, in_f, generator=g) * 0.02
    X = torch.randn(2048, in_f, generator=g)
    H = (X.double().T @ X.double())
    spec = PRESETS["nvfp4"].weights
    t0 = time.perf_counter()
    a = gptq_quantize(W, H, spec)
    cpu_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    b = gptq_quantize(W.to(device), H.to(device), spec)
    if device == "cuda":
        torch.cuda.synchronize()
    dev_s = time.perf_counter() - t0
    diff = int((a.codes != b.codes.cpu()).sum())
    return {"shape": [out_f, in_f], "codes": a.codes.numel(), "differing": diff, "cpu_s": cpu_s, "device_s": dev_s,
            "scales_equal": bool(torch.equal(a.scale, b.scale.cpu()))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--schemes", default="w8a8-int8,nvfp4,w4a16")
    ap.add_argument("--budget-s", type=float, default=420.0, help="start no scheme after this many seconds")
    ap.add_argument("--cpu-dry-run", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import lowbit
    from lowbit.calibration import CalibrationConfig

    device = "cpu" if a.cpu_dry_run else "cuda"
    dtype = torch.float32 if a.cpu_dry_run else torch.bfloat16
    RESULTS["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"
    t_start = time.perf_counter()
    RESULTS["gptq_codes"] = gptq_codes(device, a.cpu_dry_run)
    save(out)
    base = model_8b(a.cpu_dry_run, dtype)
    cfg = CalibrationConfig()
    n, seq = (4, 64) if a.cpu_dry_run else (cfg.num_samples, cfg.seq_len)
    tokens = torch.randint(0, 1024, (n, seq), generator=torch.Generator().manual_seed(1))
    for scheme in a.schemes.split(","):
        if time.perf_counter() - t_start > a.budget_s:
            RESULTS["runs"].append({"scheme": scheme, "skipped": "time budget"})
            break
        model = copy.deepcopy(base).to(device)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        q = lowbit.quantize(model, scheme, calibration=tokens, progress=False)
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else float("nan")
        cost = q.lowbit_calibration.cost
        devices = sorted({str(b.device) for _, b in q.named_buffers() if "layers." in _})
        RESULTS["runs"].append({"scheme": scheme, "per_layer_s": wall, "peak_gpu_mb": peak, "devices": devices,
                                "phases": {k: round(v, 2) for k, v in cost.seconds.items()},
                                "cost": cost.as_dict(), "tokens": [n, seq]})
        save(out)
        print(f"{scheme}: {wall:.1f} s per layer, peak {peak:.0f} MB, on {devices}", flush=True)
        del model, q
    save(out)
    print((out / "gpu_calibrate.md").read_text())


if __name__ == "__main__":
    main()
