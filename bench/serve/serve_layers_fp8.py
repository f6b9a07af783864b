"""The lowbit side of bench/serve/serve_layers.py for W8A8 FP8-dynamic folders: per captured layer, vLLM's
input values and output against the vLLM-CPU emulation (lowbit.quant.serving
``quant_values_vllm_cpu_fp8`` / ``epilogue_vllm_cpu_fp8``), lowbit's meaning of the checkpoint
(values ``e4m3(x / s)``, float32) and an exact float64 reading (values e4m3(x / s) from float64,
float64 GEMM and scales). One Markdown row per layer and a summary."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lowbit.numerics import E4M3, FormatName
from lowbit.quant import quantize
from lowbit.quant.serving import epilogue_vllm_cpu_fp8, quant_values_vllm_cpu_fp8
from lowbit.schemes import Dynamic, Granularity, QuantSpec
from serve_layers_compare import _layer, _rel, _tensors

TOKEN = QuantSpec(FormatName.E4M3, Granularity.TOKEN, dynamic=Dynamic.DYNAMIC)


def is_fp8(folder: str) -> bool:
    cfg = json.loads((Path(folder) / "config.json").read_text())["quantization_config"]
    return any(g.get("weights", {}).get("type") == "float" for g in cfg["config_groups"].values())


def compare_fp8(folder: str, capture: str) -> None:
    folder = Path(folder)
    rec = torch.load(capture, weights_only=False)  # our own capture file, written by serve_layers.py
    t = _tensors(folder)
    print(f"{folder.name}: fp8 dynamic; {len(rec['layers'])} layers, {len(rec['ids'])} tokens")
    print("| layer | kernel | values != emulation | values != lowbit | values != exact | y == emulation | "
          "rel rms vLLM-exact | rel rms lowbit-exact | rel rms emul-exact | "
          "rel rms bf16(exact)-exact |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    tot = {"em": 0, "lb": 0, "ex": 0, "n": 0, "yeq": 0, "yn": 0}
    for name, r in rec["layers"].items():
        w, w_s, _, bias = _layer(t, name)
        wv = w.to(torch.float32)
        x = r["x"].reshape(-1, r["x"].shape[-1])
        y = r["y"].reshape(-1, r["y"].shape[-1])
        vq = r["codes"]
        ev, es = quant_values_vllm_cpu_fp8(x, TOKEN)
        ey = torch.nn.functional.linear(ev, wv)
        ey_out = epilogue_vllm_cpu_fp8(ey, es, w_s, bias, torch.bfloat16)
        lq = quantize(x.to(torch.float32), TOKEN, name=name)  # lowbit's meaning: e4m3(x / s)
        lv, ls = E4M3.decode(lq.codes), lq.scale
        ly = torch.nn.functional.linear(lv * ls, wv * w_s.reshape(-1, 1)) + (0 if bias is None else bias.float())
        x64 = x.double()
        s64 = x64.abs().amax(-1, keepdim=True) / E4M3.max_finite
        v64 = E4M3.qdq((x64 / torch.where(s64 == 0, torch.ones_like(s64), s64)).float()).double()
        y64 = (v64 @ w.double().t()) * s64 * w_s.double().reshape(1, -1)
        if bias is not None:
            y64 = y64 + bias.double()
        n = vq.numel()
        c_em, c_lb, c_ex = int((vq != ev).sum()), int((vq != lv).sum()), int((vq != v64.float()).sum())
        yeq = int((ey_out == y).sum())
        tot["em"] += c_em; tot["lb"] += c_lb; tot["ex"] += c_ex; tot["n"] += n
        tot["yeq"] += yeq; tot["yn"] += y.numel()
        print(f"| {name.replace('model.layers.', '')} | {r.get('kernel', '?')} | {c_em} / {n} | {c_lb} | {c_ex} | "
              f"{100 * yeq / y.numel():.3f}% | {_rel(y, y64)[1]:.2e} | {_rel(ly, y64)[1]:.2e} | "
              f"{_rel(ey_out, y64)[1]:.2e} | {_rel(y64.to(torch.bfloat16), y64)[1]:.2e} |", flush=True)
    print(f"summary: values vLLM != emulation {tot['em']} of {tot['n']}, != lowbit {tot['lb']} "
          f"({100 * tot['lb'] / tot['n']:.4f}%), != exact64 {tot['ex']}; outputs bit-equal to the emulation: "
          f"{100 * tot['yeq'] / tot['yn']:.3f}%")
