"""Profile of the calibrated path, per decoder layer: where each scheme's default calibration spends
its time against the float layer's own forward + backward (the floor).

Per model shape (``--shapes``):
- ``smollm2``: the first ``--layers`` decoder layers of the built-in SmolLM2-135M (real weights,
  real calibration text);
- ``llama8b``: one Llama-3.1-8B-shaped decoder layer (hidden 4096, intermediate 14336, 32 heads /
  8 KV heads), random weights rounded to bf16 (a bf16 source) and computed in float32, on random
  token ids of a 1024-word vocabulary.

Rows: the float layer's forward and forward + backward (every weight's gradient) on the windows
of one reconstruction step (``reconstruct_batch_size``: the floor one step is measured against)
and its forward on one calibration batch (``batch_size`` windows: what one evaluation call
runs); the Hessian accumulation of one batch for each input width; then, per scheme, its
default calibration (``lowbit.quantize`` with the calibration data, every other option at its
default), split by ``CalibrationReport.cost``'s phases, per layer: observe passes (observers,
SmoothQuant maxima and Hessians), SmoothQuant, float targets, weight quantization (RTN, or GPTQ:
scale search and column solve), reconstruction steps and whole-set evaluations, the next layer's
inputs; one step's cost over the floor; peak resident memory above the float model's.

    .venv/bin/python bench/calibrate/bench_calibrate.py [--shapes smollm2,llama8b] [--schemes ...]
        [--samples 16 --seq-len 512] [--llama8b-samples 4 --llama8b-seq-len 256] [--json FILE]

Figures in bench/calibrate/RESULTS-calibrate.md (host, date and load average printed first).
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import os
import platform
import time
from pathlib import Path

import torch

import lowbit
from lowbit.calibration import CalibrationConfig
from lowbit.calibration.hessian import HessianSum

SCHEMES = ["w8a8-int8", "w8a8-fp8", "nvfp4", "nvfp4-e5m3", "mxfp4", "w4a16", "w4a8-int8"]
PHASES = ["capture", "observe", "smooth", "targets", "quantize", "reconstruct-steps", "reconstruct-evals",
          "next-inputs"]


def _reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _rss_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _host() -> str:
    flags = open("/proc/cpuinfo").read()
    isa = "AVX-512 + VNNI" if "avx512_vnni" in flags else ("AVX-512" if "avx512f" in flags else "AVX2")
    model = next((ln.split(":", 1)[1].strip() for ln in flags.splitlines() if ln.startswith("model name")), "?")
    return f"{model}, {isa}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def smollm2(layers: int, samples: int, seq_len: int):
    model, tok = lowbit.load_model()
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    from lowbit.calibration import calibration_tokens

    return model, calibration_tokens("builtin", tok, num_samples=samples, seq_len=seq_len)


def llama8b(samples: int, seq_len: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1024, hidden_size=4096, intermediate_size=14336, num_hidden_layers=1,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))  # a bf16 checkpoint, computed in float32
    tokens = torch.randint(0, cfg.vocab_size, (samples, seq_len), generator=torch.Generator().manual_seed(1))
    return model, tokens


def floor(model, tokens: torch.Tensor, batch: int) -> dict:
    """The float decoder layer 0 on one calibration batch: forward, and forward + backward with
    every weight's gradient (seconds, best of 2 after a warm-up)."""
    layer = model.model.layers[0]
    with torch.no_grad():
        h = model.model.embed_tokens(tokens[:batch])
    pos = torch.arange(h.shape[1]).unsqueeze(0)
    pe = model.model.rotary_emb(h, pos)
    weights = [p for p in layer.parameters() if p.dim() == 2]

    def fwd():
        out = layer(h, position_embeddings=pe, attention_mask=None, position_ids=pos)
        return out[0] if isinstance(out, (tuple, list)) else out

    with torch.no_grad():
        target = fwd() * 1.01

    def fwd_bwd():
        for p in weights:
            p.requires_grad_(True)
        loss = (fwd() - target).pow(2).mean()
        torch.autograd.grad(loss, weights)
        for p in weights:
            p.requires_grad_(False)

    def best(fn, n=2):
        fn()
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return min(ts)

    with torch.no_grad():
        f = best(fwd)
    fb = best(fwd_bwd)
    x = h.reshape(-1, h.shape[-1])
    hess = {}
    for width in sorted({layer.self_attn.q_proj.in_features, layer.mlp.down_proj.in_features}):
        xi = torch.randn(x.shape[0], width)
        hess[width] = best(lambda: HessianSum().add(xi))
    return {"tokens": int(h.shape[0] * h.shape[1]), "forward_s": f, "forward_backward_s": fb, "hessian_s": hess}


def profile_scheme(model, tokens, scheme: str, layers: int) -> dict:
    q = copy.deepcopy(model)
    base = _rss_mb("VmRSS")
    _reset_peak()
    t0, c0 = time.perf_counter(), time.process_time()
    q = lowbit.quantize(q, scheme, calibration=tokens, progress=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    cost = q.lowbit_calibration.cost
    per_layer = {p: cost.seconds.get(p, 0.0) / layers for p in PHASES}
    steps = cost.layer_calls.get("reconstruct-steps", 0)  # steps (each a forward + backward per window)
    step = cost.seconds.get("reconstruct-steps", 0.0) / steps if steps else None
    evals = cost.layer_calls.get("reconstruct-evals", 0)
    return {"scheme": scheme, "wall_s": wall, "cpu_s": cpu, "per_layer_s": per_layer, "step_s": step,
            "eval_call_s": cost.seconds.get("reconstruct-evals", 0.0) / evals if evals else None,
            "cost": cost.as_dict(), "peak_mb_above": _rss_mb("VmHWM") - base,
            "rounding": q.lowbit_calibration.weight_rounding}


def table(name: str, fl: dict, rows: list[dict], layers: int) -> str:
    out = [f"### {name}: {layers} layer(s), steps of {fl['tokens']} tokens",
           "",
           f"Floor (float layer, one step's windows): forward {fl['forward_s']:.3f} s, forward + backward "
           f"{fl['forward_backward_s']:.3f} s; forward of one calibration batch ({fl['batch_tokens']} tokens) "
           f"{fl['batch_forward_s']:.3f} s; Hessian accumulation of one batch: "
           + ", ".join(f"width {w}: {s:.3f} s" for w, s in fl["hessian_s"].items()),
           "",
           "| scheme | rounding | s/layer | " + " | ".join(PHASES[1:]) + " | step / floor | eval call / forward | peak MB |",
           "|---|---|---:|" + "---:|" * (len(PHASES) - 1) + "---:|---:|---:|"]
    for r in rows:
        pl = r["per_layer_s"]
        ratio = f"{r['step_s'] / fl['forward_backward_s']:.2f}x" if r["step_s"] else "-"
        ev = f"{r['eval_call_s'] / fl['batch_forward_s']:.2f}x" if r["eval_call_s"] else "-"
        out.append(f"| {r['scheme']} | {r['rounding']} | {r['wall_s'] / layers:.2f} | "
                   + " | ".join(f"{pl[p]:.2f}" for p in PHASES[1:])
                   + f" | {ratio} | {ev} | {r['peak_mb_above']:.0f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="smollm2,llama8b")
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--llama8b-schemes", default="w8a8-int8,nvfp4,w4a16")
    ap.add_argument("--layers", type=int, default=2, help="SmolLM2 decoder layers profiled")
    ap.add_argument("--samples", type=int, default=CalibrationConfig.num_samples)
    ap.add_argument("--seq-len", type=int, default=CalibrationConfig.seq_len)
    ap.add_argument("--llama8b-samples", type=int, default=4)
    ap.add_argument("--llama8b-seq-len", type=int, default=256)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    la = os.getloadavg()
    print(f"# bench_calibrate {_dt.datetime.now(_dt.timezone.utc).isoformat(timespec='seconds')}; {_host()}; "
          f"{platform.python_version()}; load average {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}\n", flush=True)
    batch = CalibrationConfig.batch_size
    result = {}
    for shape in a.shapes.split(","):
        if shape == "smollm2":
            model, tokens = smollm2(a.layers, a.samples, a.seq_len)
            layers, schemes = a.layers, a.schemes.split(",")
        elif shape == "llama8b":
            model, tokens = llama8b(a.llama8b_samples, a.llama8b_seq_len)
            layers, schemes = 1, a.llama8b_schemes.split(",")
        else:
            raise SystemExit(f"error: --shapes: unknown shape {shape!r} (smollm2, llama8b)")
        step = CalibrationConfig.reconstruct_batch_size or batch
        fl = floor(model, tokens, step)
        whole = floor(model, tokens, batch)
        fl.update(batch_tokens=whole["tokens"], batch_forward_s=whole["forward_s"], hessian_s=whole["hessian_s"])
        rows = []
        for s in schemes:
            rows.append(profile_scheme(model, tokens, s, layers))
            r = rows[-1]
            print(f"  {shape} {s}: {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} CPU-s, phases "
                  f"{ {k: round(v, 1) for k, v in r['cost']['seconds'].items()} }", flush=True)
        print(table(f"{shape} ({tokens.shape[0]} x {tokens.shape[1]} calibration tokens)", fl, rows, layers) + "\n",
              flush=True)
        result[shape] = {"floor": fl, "rows": rows, "samples": list(tokens.shape)}
        del model
    la = os.getloadavg()
    print(f"load average at the end {la[0]:.2f} {la[1]:.2f} {la[2]:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
