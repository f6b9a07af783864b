"""Quantize a synthetic mixture-of-experts model and its dense twin: time and peak memory.

The MoE model is a random Qwen3-MoE (``--experts`` experts, top ``--top-k``, expert width
``--expert-width``); the dense twin is a Qwen3 model with the same hidden size, depth and
attention whose MLP width is top_k x expert width (the same active parameters per token). Each
configuration runs in a fresh child process (peak resident memory is VmHWM of that process,
minus the resident size after building the float model), on the packaged calibration text
tokenized by byte values (``--samples`` x ``--seq-len`` tokens):

- rtn: ``lowbit.quantize(model, scheme)`` (w8a8-int8-dynamic: no calibration);
- static: w8a8-int8 with SmoothQuant 0.8 (every expert sees every token);
- gptq: w4a16 with GPTQ weight rounding.

    .venv/bin/python bench/moe/bench_moe.py [--experts 64] [--top-k 8] [--layers 8] [--configs rtn static gptq]

Prints one JSON line per run and a Markdown table (bench/moe/RESULTS-moe.md holds the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CONFIGS = {
    "rtn": ("w8a8-int8-dynamic", {}),
    "static": ("w8a8-int8", {"smoothquant": 0.8}),
    "gptq": ("w4a16", {"smoothquant": "none", "weight_rounding": "gptq"}),
}


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def _build(kind: str, a) -> object:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=4096, hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=a.hidden // 8, max_position_embeddings=1024,
                  tie_word_embeddings=False)
    if kind == "moe":
        cfg = Qwen3MoeConfig(**common, intermediate_size=a.expert_width * a.top_k, moe_intermediate_size=a.expert_width,
                             num_experts=a.experts, num_experts_per_tok=a.top_k, norm_topk_prob=True)
    else:
        cfg = Qwen3Config(**common, intermediate_size=a.expert_width * a.top_k)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".gate.weight"):
                p.normal_(0.0, 0.5)
    return model


def child(kind: str, config: str, a) -> dict:
    import torch

    import lowbit
    from lowbit.textfiles import builtin_calibration_text_path

    torch.set_num_threads(a.threads)
    model = _build(kind, a)
    params = sum(p.numel() for p in model.parameters())
    base = _rss_kb("VmRSS")
    text = builtin_calibration_text_path().read_bytes()[: a.samples * a.seq_len]
    tokens = torch.tensor(list(text), dtype=torch.long).reshape(a.samples, a.seq_len)
    scheme, opts = CONFIGS[config]
    t0 = time.perf_counter()
    c0 = time.process_time()
    calib = None if config == "rtn" else tokens
    extra = {} if config == "rtn" else dict(num_samples=a.samples, seq_len=a.seq_len, **opts)
    q = lowbit.quantize(model, scheme, calibration=calib, **extra)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    from lowbit.modules import QuantLinear

    return {"model": kind, "config": config, "scheme": scheme, "parameters": params,
            "quantized_linears": sum(isinstance(m, QuantLinear) for m in q.modules()),
            "seconds": round(wall, 2), "cpu_seconds": round(cpu, 2),
            "peak_above_model_mb": round((_rss_kb("VmHWM") - base) / 1024, 1),
            "model_mb": round(base / 1024, 1), "load": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-width", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "CONFIG"))
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], a)))
        return
    rows = []
    passthrough = [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k not in ("configs", "child")]
    for config in a.configs:
        for kind in ("moe", "dense"):
            p = subprocess.run([sys.executable, __file__, "--child", kind, config, *passthrough],
                               capture_output=True, text=True)
            if p.returncode:
                raise SystemExit(p.stderr[-2000:])
            row = json.loads(p.stdout.strip().splitlines()[-1])
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("\n| model | config | scheme | parameters | quantized linears | wall s | CPU s | peak above model MB | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['config']} | {r['scheme']} | {r['parameters'] / 1e6:.0f}M | {r['quantized_linears']} "
              f"| {r['seconds']} | {r['cpu_seconds']} | {r['peak_above_model_mb']} | {r['load']:.2f} |")


if __name__ == "__main__":
    main()
