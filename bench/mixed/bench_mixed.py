"""Mixed precision on SmolLM2: lowbit's automatic recipe against uniform schemes, a hand recipe
and auto-round's AutoScheme at the same average weight bits, scored on the same token ids.

    .venv/bin/python bench/mixed/bench_mixed.py --lowbit nvfp4 --lowbit bench/mixed/nvfp4-down-fp8.yaml \\
        --lowbit auto:4.5:nvfp4,mxfp4,w8a8-fp8 --lowbit auto:6:nvfp4,mxfp4,w8a8-fp8
    .venv/bin/python bench/mixed/bench_mixed.py --lowbit auto:5:w4a16,w8a16 \\
        --autoscheme 5:W4A16,W8A16 --autoround-python /tmp/lowbit-peers/auto-round/bin/python

Every row calibrates on the same 16 windows of 256 tokens (lowbit's evenly spaced windows of its
built-in calibration text, the ones bench/peers hands the peers) and is scored by bench/peers'
perplexity (lowbit's built-in evaluation text, --limit tokens in 512-token windows) and KL divergence
from the float model (its hidden states kept before quantizing, bench/peers/worker.py). lowbit rows
use lowbit.quantize's defaults for each scheme (GPTQ + 20 reconstruction steps for 4-bit ones);
``auto:B:C1,C2`` rows choose the recipe with lowbit.auto_recipe (its default 4 windows for the
sensitivities, the first 4 of the 16) and the time includes the choice. ``--autoscheme
B:O1,O2`` runs auto-round's AutoScheme(avg_bits=B, options=...) with its SignRound tuning
(iters --iters, as bench/peers' auto-round-tuned) in auto-round's own venv, on the same 16
windows decoded to text (AutoScheme takes a dataset name or a local .json file, not token ids). Average bits are
lowbit's count (lowbit.recipes.weight_bits: codes + scales) of the layers each tool quantized.
Prints one JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "peers"))
from worker import float_reference, kl_divergence, perplexity  # noqa: E402  (bench/peers/worker.py: the peers' scoring)

import lowbit  # noqa: E402
from lowbit.eval.text import read_text  # noqa: E402

AUTOSCHEME = textwrap.dedent("""
    import json, sys, time, os
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    sys.path.insert(0, sys.argv[1])
    from worker import float_reference, kl_divergence, perplexity
    from auto_round import AutoRound, AutoScheme
    a = json.loads(sys.argv[2])
    ids, calib = load_file(a["ids"])["ids"], load_file(a["calib"])["ids"]
    tok = AutoTokenizer.from_pretrained(a["model"])
    model = AutoModelForCausalLM.from_pretrained(a["model"], dtype=torch.float32).eval()
    ref = float_reference(model, ids, 512)
    t0, c0 = time.perf_counter(), time.process_time()
    scheme = AutoScheme(avg_bits=a["bits"], options=tuple(a["options"]))
    # AutoScheme takes its data as a dataset name or a local .json file of texts: the same windows, decoded
    ar = AutoRound(model, tok, scheme=scheme, iters=a["iters"], nsamples=calib.shape[0], seqlen=calib.shape[1],
                   dataset=a["calib_json"], device_map="cpu")
    model, layer_config = ar.quantize()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    bits = {n: c.get("bits") for n, c in layer_config.items() if isinstance(c, dict)}
    gs = {n: c.get("group_size") for n, c in layer_config.items() if isinstance(c, dict)}
    ppl, n = perplexity(model, ids, 512)
    print(json.dumps({"wall_s": wall, "cpu_s": cpu, "ppl": ppl, "tokens": n, "bits": bits, "group_size": gs,
                      **kl_divergence(model, ids, 512, ref)}))
""")


def eval_ids(tok, limit: int, window: int) -> torch.Tensor:
    ids = tok(read_text(), add_special_tokens=False, return_tensors="pt").input_ids[0]
    return ids[: -(-limit // (window - 1)) * window].contiguous()


def calib_ids(tok) -> torch.Tensor:
    from lowbit.calibration import calibration_tokens
    from lowbit.eval.text import default_calibration_text_path

    return calibration_tokens(str(default_calibration_text_path()), tok, num_samples=16, seq_len=256)


def lowbit_row(plan: str, ids: torch.Tensor, calib: torch.Tensor) -> dict:
    model, tok = lowbit.load_model()
    ref = float_reference(model, ids, 512)
    t0, c0 = time.perf_counter(), time.process_time()
    auto = None
    if plan.startswith("auto:"):
        _, bits, cands = plan.split(":")
        auto = lowbit.auto_recipe(model, cands, float(bits), calib)
        given = auto.recipe
    else:
        given = plan
    q = lowbit.quantize(model, given, calibration=calib, progress=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    lowbit.use_backend(q, "auto")
    from lowbit.report.quantized import quantized_summary

    s = quantized_summary(q)
    ppl, n = perplexity(q, ids, 512)
    row = {"tool": "lowbit", "plan": plan, "average_bits": s["average_bits"], "linears_per_scheme": s["schemes"],
           "quant_wall_s": round(wall, 1), "quant_cpu_s": round(cpu, 1), "ppl": ppl, "tokens": n,
           **kl_divergence(q, ids, 512, ref)}
    if auto is not None:
        row["auto_seconds"] = round(auto.seconds, 1)
        row["recipe"] = auto.recipe.to_dict()
    return row


def autoscheme_row(spec: str, ids, calib, python: str, iters: int) -> dict:
    from safetensors.torch import save_file

    from lowbit.models import resolve_model_path
    from lowbit.recipes.weight_bits import average_bits
    from lowbit.schemes import PRESETS

    bits, opts = spec.split(":")
    work = Path(tempfile.mkdtemp(prefix="lowbit-autoscheme-"))
    save_file({"ids": ids}, str(work / "ids.safetensors"))
    save_file({"ids": calib}, str(work / "calib.safetensors"))
    model, tok = lowbit.load_model()
    (work / "calib.json").write_text(json.dumps([tok.decode(w, skip_special_tokens=True) for w in calib]))
    args = {"model": str(resolve_model_path(None)), "ids": str(work / "ids.safetensors"),
            "calib": str(work / "calib.safetensors"), "calib_json": str(work / "calib.json"), "bits": float(bits), "options": opts.split(","), "iters": iters}
    p = subprocess.run([python, "-c", AUTOSCHEME, str(HERE.parent / "peers"), json.dumps(args)], capture_output=True,
                       text=True)
    if p.returncode != 0:
        return {"tool": "auto-round AutoScheme", "plan": spec, "status": "error", "error": p.stderr[-2000:]}
    r = json.loads(p.stdout.strip().splitlines()[-1])
    shapes = {n: tuple(m.weight.shape) for n, m in model.named_modules() if n in r["bits"] and hasattr(m, "weight")}
    by_bits = {4: PRESETS["w4a16"], 8: PRESETS["w8a16"]}  # auto-round's W4A16 / W8A16: lowbit's numerics
    schemes = {n: by_bits[b] for n, b in r["bits"].items() if n in shapes and b in by_bits}
    return {"tool": "auto-round AutoScheme", "plan": spec, "iters": iters,
            "average_bits": average_bits(shapes, schemes) if schemes else None,
            "linears_per_bits": {str(b): sum(1 for n in schemes if r["bits"][n] == b) for b in (4, 8)},
            "quant_wall_s": round(r["wall_s"], 1), "quant_cpu_s": round(r["cpu_s"], 1), "ppl": r["ppl"],
            "tokens": r["tokens"], **{k: r[k] for k in ("kld", "kld_half95", "kld_p99", "kld_max", "same_top")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lowbit", action="append", default=[], help="a scheme, a recipe file, or auto:BITS:CANDIDATES")
    ap.add_argument("--autoscheme", action="append", default=[], help="BITS:OPTIONS for auto-round's AutoScheme")
    ap.add_argument("--autoround-python", default="/tmp/lowbit-peers/auto-round/bin/python")
    ap.add_argument("--iters", type=int, default=200, help="auto-round's SignRound steps per block")
    ap.add_argument("--limit", type=int, default=4096, help="evaluation tokens")
    ap.add_argument("--float", action="store_true", help="also score the float model")
    a = ap.parse_args()
    model, tok = lowbit.load_model()
    ids, calib = eval_ids(tok, a.limit, 512), calib_ids(tok)
    print(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": os.getloadavg()[0],
                      "cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?"),
                      "threads": torch.get_num_threads()}), flush=True)
    if a.float:
        ppl, n = perplexity(model, ids, 512)
        print(json.dumps({"tool": "float", "ppl": ppl, "tokens": n}), flush=True)
    del model
    for plan in a.lowbit:
        print(json.dumps(lowbit_row(plan, ids, calib)), flush=True)
    for spec in a.autoscheme:
        print(json.dumps(autoscheme_row(spec, ids, calib, a.autoround_python, a.iters)), flush=True)


if __name__ == "__main__":
    main()
