"""The lowbit side of bench/serve/serve_layers.py: per-layer comparison of vLLM's captured int8 linears
with lowbit's cpu-int8 backend, the vLLM-CPU emulation (lowbit.quant.serving) and an exact float64
reading of the checkpoint. Prints one Markdown row per layer and a summary."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from lowbit.backends.cpu_int8 import int_accumulate
from lowbit.quant import int_values
from lowbit.quant.serving import (Accumulation, accumulation, epilogue_vllm_cpu, pair_saturation,
                                  quant_codes_vllm_cpu, saturating_pairs)
from lowbit.schemes import Dynamic, Granularity, QuantSpec
from lowbit.numerics import FormatName

SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
          "o_proj": ("o_proj",), "down_proj": ("down_proj",)}


def _tensors(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def _layer(t: dict, name: str):
    parent, short = name.rsplit(".", 1)
    ws, ss, iss, bs = [], [], [], []
    for s in SHARDS[short]:
        p = f"{parent}.{s}"
        ws.append(t[f"{p}.weight"])
        ss.append(t[f"{p}.weight_scale"].to(torch.float32).reshape(-1))
        iss.append(t.get(f"{p}.input_scale"))
        bs.append(t.get(f"{p}.bias"))
    static = [None if i is None else float(i.float()) for i in iss]
    bias = None if bs[0] is None else torch.cat(bs)
    return torch.cat(ws), torch.cat(ss), static, bias


def _rel(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a.double() - b.double())
    ref = b.double().abs().amax().clamp_min(1e-30)
    return float(d.abs().amax() / ref), float(d.pow(2).mean().sqrt() / b.double().pow(2).mean().sqrt())


def compare(folder: str, capture: str) -> None:
    folder = Path(folder)
    rec = torch.load(capture, weights_only=False)
    t = _tensors(folder)
    cfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    dyn = any(g.get("input_activations", {}).get("dynamic") for g in cfg["config_groups"].values())
    spec = QuantSpec(FormatName.INT8, Granularity.TOKEN, dynamic=Dynamic.DYNAMIC) if dyn else \
        QuantSpec(FormatName.INT8, Granularity.TENSOR, dynamic=Dynamic.STATIC)
    print(f"{folder.name}: {'dynamic' if dyn else 'static'}; {len(rec['layers'])} layers, "
          f"{len(rec['ids'])} tokens")
    print("| layer | kernel | vLLM scale | codes != lowbit | codes != emulation | codes != exact | "
          "y == emulation | rel rms vLLM-exact | rel rms lowbit-exact | rel rms emul-exact | rel rms bf16(exact)-exact |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    tot = {"lb": 0, "em": 0, "ex": 0, "n": 0, "yeq": 0, "yn": 0}
    for name, r in rec["layers"].items():
        w, w_s, static, bias = _layer(t, name)
        x = r["x"].reshape(-1, r["x"].shape[-1])
        y = r["y"].reshape(-1, r["y"].shape[-1])
        vq = r["codes"].to(torch.float32)
        s_static = None if dyn else torch.tensor([static[-1]], dtype=torch.float32)
        # lowbit: the format's meaning in float32 (x / s)
        lq, ls = int_values(x.float(), spec, s_static, name)
        # emulation of vLLM-CPU
        eq, es = quant_codes_vllm_cpu(x, spec, s_static)
        # exact: float64 all the way
        x64 = x.double()
        s64 = x64.abs().amax(-1, keepdim=True) / 127 if dyn else torch.tensor([[static[-1]]], dtype=torch.float64)
        q64 = torch.clamp(torch.round(x64 / torch.where(s64 == 0, torch.ones_like(s64), s64)), -128, 127)
        wv = w.to(torch.float32)
        acc64 = q64 @ w.double().t()  # exact: |sum| < 2^53
        y64 = acc64 * s64 * w_s.double().reshape(1, -1)
        if bias is not None:
            y64 = y64 + bias.double()
        lacc = int_accumulate(lq, wv)
        ly = lacc.double() * ls.double() * w_s.double().reshape(1, -1) + (0 if bias is None else bias.double())
        pairs = saturating_pairs(w)
        exact_acc = int_accumulate(eq, wv)
        pairs_acc = exact_acc + pair_saturation(eq, pairs, w.shape[0])
        emulated_pairs = accumulation(dyn, torch.bfloat16) is Accumulation.PAIRS_INT16
        ey = epilogue_vllm_cpu(pairs_acc if emulated_pairs else exact_acc, es, w_s, bias, torch.bfloat16, dynamic=dyn)
        # the other accumulation, to show which one vLLM ran
        ey_other = epilogue_vllm_cpu(exact_acc if emulated_pairs else pairs_acc, es, w_s, bias, torch.bfloat16,
                                     dynamic=dyn)
        tot["pairs"] = tot.get("pairs", 0) + pairs[0].numel()
        tot["allpairs"] = tot.get("allpairs", 0) + w.numel() // 2
        tot["yeq_exact"] = tot.get("yeq_exact", 0) + int((ey_other == y).sum())
        n = vq.numel()
        c_lb = int((vq != lq).sum())
        c_em = int((vq != eq).sum())
        c_ex = int((vq != q64.float()).sum())
        yeq = int((ey == y).sum())
        tot["lb"] += c_lb; tot["em"] += c_em; tot["ex"] += c_ex; tot["n"] += n
        tot["yeq"] += yeq; tot["yn"] += y.numel()
        sc = "per token" if dyn else f"{float(r['input_scale'].reshape(-1)[0]):.6g} (file {static})"
        print(f"| {name.replace('model.layers.', '')} | {r.get('kernel', '?')} | {sc} | {c_lb} / {n} | {c_em} | {c_ex} | "
              f"{100 * yeq / y.numel():.2f}% | {_rel(y, y64)[1]:.2e} | {_rel(ly, y64)[1]:.2e} | {_rel(ey, y64)[1]:.2e} | "
              f"{_rel(y64.to(torch.bfloat16), y64)[1]:.2e} |", flush=True)
    print(f"summary: codes vLLM != lowbit {tot['lb']} of {tot['n']} ({100 * tot['lb'] / tot['n']:.4f}%), "
          f"!= emulation {tot['em']}, != exact64 {tot['ex']}; outputs bit-equal to the emulation: "
          f"{100 * tot['yeq'] / tot['yn']:.3f}% (with the other accumulation instead: "
          f"{100 * tot['yeq_exact'] / tot['yn']:.3f}%); weight pairs that can saturate: {tot['pairs']} of {tot['allpairs']}")
