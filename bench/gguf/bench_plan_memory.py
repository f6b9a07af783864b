"""The GGUF plan's peak memory (``plan_gguf``: llama.cpp's converter run on index patterns) on
random Qwen3-MoE models of growing depth and width (issue 48): does it grow with the model or
with its widest layer?

    .venv/bin/python bench/gguf/bench_plan_memory.py [--shape LAYERS:EXPERTS ...] [--out DIR]

Each shape (default 2:64, 4:64, 2:128) is a Qwen3-MoE of hidden 1024, experts of 512, every layer
MoE, vocabulary 1024, seed 0, saved in float32 under ``--out``; each plan runs in a fresh process
(``metadata=False``: the tensors, not the tokenizer step) and reports its peak RSS
(``ru_maxrss``) less the RSS after its imports, against one layer's experts in float32.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
import torch, transformers  # the imports' own memory, before the plan
from lowbit.formats.gguf.convert import plan_gguf
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
t = time.perf_counter()
plan = plan_gguf(sys.argv[1], metadata=False)
print(json.dumps({"seconds": round(time.perf_counter() - t, 2), "imports_mb": round(base),
                  "peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                  "tensors": len(plan.tensors)}))
"""


MAKE = r"""
import sys, torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
layers, experts = int(sys.argv[2]), int(sys.argv[3])
cfg = Qwen3MoeConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
                     num_experts=experts, num_experts_per_tok=4, num_hidden_layers=layers, num_attention_heads=8,
                     num_key_value_heads=4, head_dim=128, max_position_embeddings=256, decoder_sparse_step=1,
                     mlp_only_layers=[])
torch.manual_seed(0)
Qwen3MoeForCausalLM(cfg).float().save_pretrained(sys.argv[1])
"""


def make(folder: Path, layers: int, experts: int) -> int:
    """Save the random model (in a child: a process's peak RSS survives fork and exec, so this one
    stays small for the plans' children); the bytes of one layer's experts in float32."""
    if not (folder / "config.json").is_file():
        subprocess.run([sys.executable, "-c", MAKE, str(folder), str(layers), str(experts)], check=True,
                       capture_output=True)
    return experts * 3 * 1024 * 512 * 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", action="append", default=[], help="LAYERS:EXPERTS (default 2:64, 4:64, 2:128)")
    ap.add_argument("--out", default=None, help="folder for the models (default: a temporary one)")
    a = ap.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="lowbit-plan-mem-"))
    for shape in a.shape or ["2:64", "4:64", "2:128"]:
        layers, experts = (int(x) for x in shape.split(":"))
        folder = out / f"qwen3moe-{layers}x{experts}"
        layer_bytes = make(folder, layers, experts)
        r = subprocess.run([sys.executable, "-c", CHILD, str(folder)], capture_output=True, text=True, check=True)
        row = json.loads(r.stdout.strip().splitlines()[-1])
        plan_mb = row["peak_mb"] - row["imports_mb"]
        print(json.dumps({"layers": layers, "experts": experts, "layer_experts_mb": round(layer_bytes / 2**20),
                          **row, "plan_mb": plan_mb, "ratio": round(plan_mb * 2**20 / layer_bytes, 2)}), flush=True)


if __name__ == "__main__":
    main()
