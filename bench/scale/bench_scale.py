"""Calibrated quantization of a model larger than it needs to be in memory: streamed vs in-memory.

Builds (once) a synthetic Llama with random weights saved in bf16 (default ~0.7B parameters:
hidden 1536, MLP 4096, 24 layers, 12 heads / 4 KV heads, tied embeddings of the built-in model's
49152-token vocabulary, whose tokenizer it copies), then runs the CLI on it, each run a fresh
process measured by GNU time (wall, user+sys CPU seconds, peak RSS of the largest process):

- in-memory: ``lowbit quantize SRC --scheme S --in-memory`` (load_model, quantize, save);
- streamed:  ``lowbit quantize SRC --scheme S`` (the default: one decoder layer at a time);
- 2 ranks:   ``torchrun --nproc-per-node 2 --no-python lowbit quantize SRC --scheme S``.

and checks that the outputs hold the same tensors. Per-layer seconds come from the streamed
runs' JSON summaries. The extrapolation to larger models lives in bench/scale/RESULTS-scale.md.

    .venv/bin/python bench/scale/bench_scale.py [--scheme w8a8-int8] [--calib-samples 16] [--calib-seq-len 512]
        [--runs in-memory streamed ranks2] [--root /tmp/lowbit-scale]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def build(root: Path, hidden: int, mlp: int, layers: int) -> Path:
    src = root / f"llama-h{hidden}-l{layers}"
    if (src / "config.json").is_file():
        return src
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    try:  # the built-in model's tokenizer (its vocabulary), else a byte-level one (a machine without it)
        from lowbit.models import ensure_builtin

        builtin = ensure_builtin()
    except Exception:  # noqa: BLE001
        builtin = None
    cfg = LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                      num_attention_heads=hidden // 128, num_key_value_heads=min(4, hidden // 128), max_position_embeddings=2048,
                      tie_word_embeddings=True, dtype=torch.bfloat16)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    tmp = root / ".building"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size="500MB")
    if builtin is not None:
        for f in builtin.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")) or f.name in ("vocab.json", "merges.txt"):
                shutil.copy(f, tmp / f.name)
    else:
        sys.path.insert(0, str(Path(__file__).parents[2] / "tests"))
        from helpers.eval_fixtures import byte_tokenizer

        byte_tokenizer().save_pretrained(tmp)
    os.replace(tmp, src)
    return src


def timed(cmd: list[str], env: dict) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    def field(name):
        return re.search(rf"{name}: ([\d.]+)", p.stderr).group(1)
    out = {"wall_s": round(wall, 1), "cpu_s": round(float(field("User time \\(seconds\\)")) +
                                                     float(field("System time \\(seconds\\)")), 1),
           "peak_rss_mb": round(int(field("Maximum resident set size \\(kbytes\\)")) / 1024)}
    try:
        out["summary"] = json.loads(p.stdout[p.stdout.index("{"):])
    except ValueError:
        out["summary"] = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/tmp/lowbit-scale")
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--mlp", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--scheme", default="w8a8-int8")
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--calib-seq-len", type=int, default=512)
    ap.add_argument("--runs", nargs="+", default=["in-memory", "streamed", "ranks2"])
    a = ap.parse_args()
    root = Path(a.root)
    root.mkdir(parents=True, exist_ok=True)
    src = build(root, a.hidden, a.mlp, a.layers)
    size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    print(f"source {src}: {size / 1e9:.2f} GB of safetensors", flush=True)
    env = dict(os.environ)
    common = [str(src), "--scheme", a.scheme, "--calib-samples", str(a.calib_samples), "--calib-seq-len",
              str(a.calib_seq_len), "--overwrite", "--json"]
    lowbit = str(BIN / "lowbit")
    cmds = {
        "in-memory": [lowbit, "quantize", *common, "--in-memory", "-o", str(root / "out-in-memory")],
        "streamed": [lowbit, "quantize", *common, "-o", str(root / "out-streamed")],
        "ranks2": [str(BIN / "torchrun"), "--nproc-per-node", "2", "--no-python", lowbit, "quantize", *common,
                   "-o", str(root / "out-ranks2")],
    }
    rows = {}
    for run in a.runs:
        load = os.getloadavg()[0]
        r = timed(cmds[run], env)
        r["load_before"] = round(load, 2)
        s = r.pop("summary") or {}
        layer_s = s.get("layer_seconds") or []
        r["per_layer_s"] = round(sum(layer_s) / len(layer_s), 2) if layer_s else None
        rows[run] = r
        print(json.dumps({"run": run, **r}), flush=True)
    outs = [root / f"out-{run}" for run in a.runs]
    if len(outs) > 1:
        sys.path.insert(0, str(Path(__file__).parents[2] / "tests"))
        from helpers.folders import assert_same_tensors, folder_tensors

        ref = folder_tensors(outs[0])
        for o in outs[1:]:
            assert_same_tensors(ref, folder_tensors(o))
        print(f"same tensors: {', '.join(a.runs)}")
    print("\n| run | wall s | CPU s | peak RSS MB | s per layer | load before |\n|---|---|---|---|---|---|")
    for run, r in rows.items():
        print(f"| {run} | {r['wall_s']} | {r['cpu_s']} | {r['peak_rss_mb']} | {r['per_layer_s']} | {r['load_before']} |")


if __name__ == "__main__":
    main()
