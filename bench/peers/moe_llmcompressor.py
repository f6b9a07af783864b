"""llm-compressor on bench/moe/bench_moe.py's synthetic Qwen3-MoE (and its dense twin): quantization
time and peak memory, for the lowbit rows of bench/moe/RESULTS-moe.md.

Run in a venv holding llm-compressor (torch==2.13.0 installed first):

    /tmp/llmc/bin/python bench/peers/moe_llmcompressor.py --child moe gptq

Recipes (its best where the scheme has one): "rtn" W8A8 dynamic int8 (QuantizationModifier),
"static" SmoothQuant 0.8 + W8A8 static int8 weights/activations... as llm-compressor spells it
(SmoothQuantModifier + QuantizationModifier with a static INT8 input scheme), "gptq" W4A16 GPTQ
(GPTQModifier), with ``moe_calibrate_all_experts=True`` (every expert sees every token, like
lowbit). One child process per run; peak RSS is VmHWM minus the RSS after building the model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "moe"))  # bench/moe/bench_moe.py
from bench_moe import _build, _rss_kb  # noqa: E402  (bench_moe imports nothing of lowbit at module level)


def _recipe(config: str):
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.smoothquant import SmoothQuantModifier

    ignore = ["lm_head", "re:.*mlp.gate$"]
    if config == "rtn":
        return [QuantizationModifier(targets="Linear", scheme="W8A8", ignore=ignore)]
    if config == "static":
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        scheme = QuantizationScheme(targets=["Linear"],
                                    weights=QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True),
                                    input_activations=QuantizationArgs(num_bits=8, type="int", strategy="tensor",
                                                                       symmetric=True, dynamic=False))
        return [SmoothQuantModifier(smoothing_strength=0.8),
                QuantizationModifier(config_groups={"group_0": scheme}, ignore=ignore)]
    return [GPTQModifier(targets="Linear", scheme="W4A16", ignore=ignore)]


def child(kind: str, config: str, a) -> dict:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot

    import tempfile

    torch.set_num_threads(a.threads)
    model = _build(kind, a)
    cfg_dir = tempfile.mkdtemp(prefix="llmc-moe-")
    model.config.save_pretrained(cfg_dir)  # oneshot reads the config from the model's name_or_path
    model.config._name_or_path = cfg_dir
    base = _rss_kb("VmRSS")
    text = open(a.text, "rb").read()[: a.samples * a.seq_len]
    ids = torch.tensor(list(text), dtype=torch.long).reshape(a.samples, a.seq_len)
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * a.seq_len] * a.samples})
    t0, c0 = time.perf_counter(), time.process_time()
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
    from helpers.eval_fixtures import byte_tokenizer  # token id == byte, as the ids above

    kw = {} if config == "rtn" else dict(dataset=ds, num_calibration_samples=a.samples, max_seq_length=a.seq_len)
    oneshot(model=model, recipe=_recipe(config), tokenizer=byte_tokenizer(), moe_calibrate_all_experts=True, **kw)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    quantized = sum(getattr(m, "quantization_scheme", None) is not None for m in model.modules())
    float_3d = sum(p.numel() for p in model.parameters() if p.dim() == 3)  # fused experts it left alone
    return {"tool": "llm-compressor", "model": kind, "config": config, "quantized_modules": quantized,
            "float_3d_expert_params": float_3d, "seconds": round(wall, 2),
            "cpu_seconds": round(cpu, 2), "peak_above_model_mb": round((_rss_kb("VmHWM") - base) / 1024, 1),
            "load": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    for k, v in dict(experts=64, top_k=8, expert_width=256, hidden=1024, layers=8, samples=8, seq_len=256,
                     threads=2).items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    ap.add_argument("--text", default=os.path.join(os.path.dirname(__file__), "..", "..", "src", "lowbit", "data",
                                                   "calibration.txt"))
    ap.add_argument("--configs", nargs="+", default=["rtn", "static", "gptq"])
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "CONFIG"))
    a = ap.parse_args()
    if a.child:
        print("RESULT " + json.dumps(child(a.child[0], a.child[1], a)))
        return
    args = [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k not in ("configs", "child")]
    for config in a.configs:
        for kind in ("moe", "dense"):
            p = subprocess.run([sys.executable, __file__, "--child", kind, config, *args], capture_output=True, text=True)
            line = next((x[7:] for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            print(line or json.dumps({"model": kind, "config": config, "error": p.stderr.strip().splitlines()[-1][:300]}),
                  flush=True)


if __name__ == "__main__":
    main()
