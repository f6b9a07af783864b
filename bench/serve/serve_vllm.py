"""Does vLLM (CPU build) serve what lowbit writes, with lowbit's numbers? Perplexity from vLLM's
prompt log-probabilities against lowbit's own evaluation of the same compressed-tensors folder, on
the same token ids (one window of ``--tokens`` tokens of the packaged evaluation text, Persuasion),
for the built-in SmolLM2-135M.

Two steps, two venvs (vLLM pins older transformers; see ../shared/README.md):

    .venv/bin/python bench/serve/serve_vllm.py make OUT [--schemes ...] [--reuse]  # lowbit: folders + its log-probs
    .venv-vllm/bin/python bench/serve/serve_vllm.py serve OUT [--only a,b] [--dtypes bfloat16] [--timeout 150]  # vLLM

Prints one Markdown row per folder and dtype: lowbit's and vLLM's perplexity, the relative
difference, the largest per-token |log p| difference, lowbit's prediction of vLLM's numbers
(``ServingNumerics.VLLM_CPU``, bf16 rows) and vLLM's difference from it, the greedy agreement
(4 prompts of 64 tokens of the same text, 32 new tokens each: the share of positions where vLLM's
token is lowbit's / the emulation's), and the load + scoring seconds, or vLLM's error (bench/serve/RESULTS-serve.md holds the figures). ``make --reuse`` keeps
folders already written (only the log-probabilities are computed again).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

# SmolLM2's 576-wide inputs are no multiple of 128: the group-128 INT4 schemes (w4a16, w4a16-asym,
# w4a8-*) have no compressed-tensors layout for it (lowbit refuses; bench on a model with 128-multiples)
SCHEMES = ("float", "w8a8-int8", "w8a8-int8-dynamic", "w8a8-fp8-dynamic", "w8a8-fp8", "fp8-block", "w8a16",
           "nvfp4a16", "mxfp4", "mxfp8")


RUN_TIMEOUT_S = 150  # one load + scoring; the float path takes ~20 s (--timeout: FP8 and static INT8 are slower)


def _logprobs(m, ids) -> list[float]:
    import torch

    with torch.no_grad():
        lp = torch.log_softmax(m(input_ids=ids).logits[0].double(), -1)
    return lp[torch.arange(ids.shape[1] - 1), ids[0, 1:]].tolist()


GREEDY_PROMPTS, GREEDY_LEN, GREEDY_TOKENS = 4, 64, 32  # greedy continuations: 4 prompts of 64 tokens, 32 new


def _greedy_prompts(ids: list[int]) -> list[list[int]]:
    return [ids[i * 200: i * 200 + GREEDY_LEN] for i in range(GREEDY_PROMPTS)]


def _greedy(m, prompts) -> list[list[int]]:
    import torch

    with torch.no_grad():
        return [m.generate(torch.tensor([p]), max_new_tokens=GREEDY_TOKENS, do_sample=False,
                           min_new_tokens=GREEDY_TOKENS)[0, len(p):].tolist() for p in prompts]


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of generated positions where two greedy continuations hold the same token."""
    pairs = [(x, y) for u, v in zip(a, b) for x, y in zip(u, v)]
    return sum(x == y for x, y in pairs) / len(pairs)


def _ppl(lp: list[float]) -> float:
    return math.exp(-math.fsum(lp) / len(lp))


def make(out: Path, schemes: list[str], tokens: int, reuse: bool = False) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    import lowbit
    from lowbit.errors import LowbitError
    from lowbit.quant.serving import ServingNumerics
    from lowbit.models import load_model
    from lowbit.models.builtin import ensure_builtin
    from lowbit.modules.engine_layers import use_engine_model_ops
    from lowbit.textfiles import builtin_evaluation_text_path

    torch.set_grad_enabled(False)
    src = ensure_builtin()
    model, tok = load_model(src)
    text = builtin_evaluation_text_path().read_text()
    ids = tok(text, return_tensors="pt").input_ids[:, :tokens]
    ref = {"ids": ids[0].tolist(), "runs": {}}
    for scheme in schemes:
        d = out / scheme
        if scheme == "float":
            m = model
        elif reuse and (d / "config.json").is_file():  # --reuse: the folder as written before
            m = lowbit.load(d)
        else:
            m, _ = load_model(src)
            # lowbit.quantize's defaults: it calibrates (on the packaged text) only where the scheme needs it
            lowbit.save(lowbit.quantize(m, scheme, calibration="builtin", tokenizer=tok), d, format="compressed-tensors",
                        tokenizer=tok, source_dir=src, overwrite=True)
            m = lowbit.load(d)
        if scheme == "float":
            d.mkdir(parents=True, exist_ok=True)
            import shutil

            for f in Path(src).iterdir():
                shutil.copy(f, d / f.name)
        ref["runs"][str(d)] = _logprobs(m, ids)
        ref.setdefault("greedy", {})[str(d)] = _greedy(m, _greedy_prompts(ref["ids"]))
        print(scheme, "ppl", _ppl(ref["runs"][str(d)]), flush=True)
        # what lowbit predicts vLLM-CPU computes (ServingNumerics.VLLM_CPU), where it has an emulation
        try:
            if scheme != "float":
                e = lowbit.load(d, numerics=ServingNumerics.VLLM_CPU)
            else:  # transformers' bf16 model with the engine's ops outside the linears
                e = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
                use_engine_model_ops(e, ServingNumerics.VLLM_CPU)
        except LowbitError as err:
            print(scheme, "no emulation:", err, flush=True)
            continue
        ref.setdefault("emulated", {})[str(d)] = _logprobs(e, ids)
        ref.setdefault("greedy_emulated", {})[str(d)] = _greedy(e, _greedy_prompts(ref["ids"]))
        print(scheme, "vllm-cpu emulation ppl", _ppl(ref["emulated"][str(d)]), flush=True)
    (out / "lowbit.json").write_text(json.dumps(ref))


def serve_one(folder: str, dtype: str, ref: dict) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ids = ref["ids"]
    t0 = time.perf_counter()
    try:
        llm = LLM(model=folder, dtype=dtype, enforce_eager=True, max_model_len=len(ids) + 8, seed=0)
        t1 = time.perf_counter()
        o = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(prompt_logprobs=0, max_tokens=1))[0]
        lp = [p[t].logprob for p, t in zip(o.prompt_logprobs[1:], ids[1:])]
        gen = [list(g.outputs[0].token_ids) for g in llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in _greedy_prompts(ids)],
            SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, min_tokens=GREEDY_TOKENS))]
    except Exception as e:  # vLLM's refusals are the finding
        return {"error": f"{type(e).__name__}: {str(e)[:160]}"}
    mine = ref["runs"][folder]
    r = {"ppl_vllm": _ppl(lp), "ppl_lowbit": _ppl(mine),
         "max_abs_logprob_diff": max(abs(a - b) for a, b in zip(lp, mine)),
         "load_s": round(t1 - t0, 1), "score_s": round(time.perf_counter() - t1, 1)}
    if folder in ref.get("greedy", {}):
        r["greedy_vs_lowbit"] = _agreement(gen, ref["greedy"][folder])
    emu = ref.get("emulated", {}).get(folder)
    if emu is not None and dtype == "bfloat16":
        r.update(ppl_emulated=_ppl(emu), max_abs_emulated_diff=max(abs(a - b) for a, b in zip(lp, emu)))
        if folder in ref.get("greedy_emulated", {}):
            r["greedy_vs_emulated"] = _agreement(gen, ref["greedy_emulated"][folder])
    return r


def main() -> None:
    step, out = sys.argv[1], Path(sys.argv[2])
    if step == "make":
        schemes = sys.argv[sys.argv.index("--schemes") + 1].split(",") if "--schemes" in sys.argv else list(SCHEMES)
        make(out, schemes, 1000, reuse="--reuse" in sys.argv)
    elif step == "one":
        ref = json.loads((out / "lowbit.json").read_text())
        print("RESULT " + json.dumps(serve_one(sys.argv[3], sys.argv[4], ref)))
    else:
        ref = json.loads((out / "lowbit.json").read_text())
        print("| folder | dtype | lowbit ppl | vLLM ppl | diff | max abs log p diff | emulation ppl (vLLM vs it) | "
              "max abs diff vs emulation | greedy = lowbit / = emulation | load s | score s |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        only = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else None
        dtypes = sys.argv[sys.argv.index("--dtypes") + 1].split(",") if "--dtypes" in sys.argv else ["float32", "bfloat16"]
        limit = int(sys.argv[sys.argv.index("--timeout") + 1]) if "--timeout" in sys.argv else RUN_TIMEOUT_S
        for folder in ref["runs"]:
            if only is not None and Path(folder).name not in only:
                continue
            for dtype in dtypes:
                try:
                    p = subprocess.run([sys.executable, __file__, "one", str(out), folder, dtype],
                                       capture_output=True, text=True, timeout=limit)
                    r = next((json.loads(x[7:]) for x in p.stdout.splitlines() if x.startswith("RESULT ")),
                             {"error": (p.stderr.strip().splitlines() or ["no output"])[-1][:160]})
                except subprocess.TimeoutExpired:
                    r = {"error": f"no result within {limit} s (load + 1000 scored tokens)"}
                name = Path(folder).name
                if "error" in r:
                    print(f"| {name} | {dtype} | | | | {r['error']} | | | | | |", flush=True)
                else:
                    d = 100 * (r["ppl_vllm"] / r["ppl_lowbit"] - 1)
                    em = "| |"
                    if "ppl_emulated" in r:
                        em = (f"| {r['ppl_emulated']:.3f} ({100 * (r['ppl_vllm'] / r['ppl_emulated'] - 1):+.3f}%) | "
                              f"{r['max_abs_emulated_diff']:.3g} |")
                    gr = " / ".join(f"{100 * r[k]:.1f}%" if k in r else "-" for k in ("greedy_vs_lowbit", "greedy_vs_emulated"))
                    print(f"| {name} | {dtype} | {r['ppl_lowbit']:.3f} | {r['ppl_vllm']:.3f} | {d:+.3f}% | "
                          f"{r['max_abs_logprob_diff']:.3g} {em} {gr} | {r['load_s']} | {r['score_s']} |", flush=True)


if __name__ == "__main__":
    main()
