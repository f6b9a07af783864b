"""Does vLLM (CPU build) serve lowbit's compressed-tensors MoE output? Per-token log-probabilities
of one prompt, vLLM against lowbit, on tiny random MoE models: Qwen3-MoE, Mixtral (legacy names),
DeepSeek-V3 and gpt-oss from ``tests/helpers/moe_models.py`` (8 experts), OLMoE, PhiMoE,
GraniteMoE, GLM-4-MoE and MiniMax from ``tests/helpers/families.py`` (4 experts).

Two steps, two venvs (vLLM pins older transformers; see ../shared/README.md):

    .venv/bin/python bench/moe/vllm_moe_check.py make OUT [FAMILIES] [SCHEMES]  # lowbit: folders, log-probs
    .venv-vllm/bin/python bench/moe/vllm_moe_check.py serve OUT [FAMILIES] [RUNS]  # vLLM: a process a family

FAMILIES, SCHEMES: comma-separated (default all; a later make adds to OUT); RUNS: comma-separated
``scheme:dtype`` (default every scheme in float32 and bfloat16), run one ``LLM`` after the other in
the family's process (its log: OUT/FAMILY.log). Prints, per folder and dtype, the largest
|log p_vLLM - log p_lowbit| over the prompt's tokens, or vLLM's error, and the run's wall seconds
and load (bench/moe/RESULTS-moe.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "phimoe", "granitemoe", "deepseek_v3", "glm4_moe", "gpt_oss",
            "minimax")
SCHEMES = ("float", "w8a8-int8-dynamic", "w8a8-int8", "w8a8-fp8-dynamic", "w4a16")


def _tiny(fam: str):
    """The family's tiny random model: ``tiny_moe`` where it has one, else ``tiny_model`` with the
    routers spread as ``tiny_moe`` spreads them."""
    import torch
    from helpers.families import tiny_model
    from helpers.moe_models import MOE_FAMILIES, tiny_moe

    if fam in MOE_FAMILIES:
        return tiny_moe(fam)
    m = tiny_model(fam)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith((".gate.weight", ".router.weight", ".router.layer.weight")) and p.dim() == 2:
                p.normal_(0.0, 0.5)
    return m


def make(out: Path, families: list[str], schemes: list[str]) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    import lowbit
    from helpers.eval_fixtures import byte_tokenizer

    torch.set_grad_enabled(False)
    tok = byte_tokenizer()
    ids = torch.randint(3, 250, (1, 64), generator=torch.Generator().manual_seed(0))
    calib = torch.randint(3, 250, (4, 32), generator=torch.Generator().manual_seed(1))
    path = out / "lowbit.json"
    ref = json.loads(path.read_text()) if path.exists() else {"ids": ids[0].tolist(), "runs": {}, "errors": {}}
    for fam in families:
        for scheme in schemes:
            d = out / f"{fam}-{scheme}"
            try:
                m = _tiny(fam)
                if scheme == "float":
                    m.save_pretrained(d)
                    tok.save_pretrained(d)
                else:
                    lowbit.save(lowbit.quantize(m, scheme, calibration=calib, num_samples=4, seq_len=32), d,
                                format="compressed-tensors", tokenizer=tok, overwrite=True)
                    m = lowbit.load(d)
                lp = torch.log_softmax(m(input_ids=ids, use_cache=False).logits[0].double(), -1)
                ref["runs"][str(d)] = lp[torch.arange(ids.shape[1] - 1), ids[0, 1:]].tolist()
            except Exception as e:  # noqa: BLE001 - lowbit's own refusal is a finding too
                ref["errors"][str(d)] = f"{type(e).__name__}: {str(e)[:200]}"
                print(f"| {d.name} | lowbit: {ref['errors'][str(d)]} |", flush=True)
            path.write_text(json.dumps(ref))


def serve_family(out: Path, fam: str, runs: list[str], ref: dict) -> None:
    """The family's runs (``scheme:dtype``) in this process, one ``LLM`` after the other; a
    ``RESULT`` line per run. After a refusal the process ends (an engine that failed leaves
    vLLM's parallel groups unusable for the next ``LLM``); ``main`` starts another for the rest."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import gc
    import traceback

    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    ids = ref["ids"]
    for run in runs:
        scheme, dtype = run.split(":")
        folder = str(out / f"{fam}-{scheme}")
        t0, load = time.time(), open("/proc/loadavg").read().split()[0]
        res, llm = {"run": run, "load": load}, None
        try:
            llm = LLM(model=folder, dtype=dtype, enforce_eager=True, max_model_len=128, seed=0)
            o = llm.generate([TokensPrompt(prompt_token_ids=ids)],
                             SamplingParams(prompt_logprobs=0, max_tokens=1))[0]
            lp = [p[t].logprob for p, t in zip(o.prompt_logprobs[1:], ids[1:])]
            res["max_abs_logprob_diff"] = max(abs(a - b) for a, b in zip(lp, ref["runs"][folder]))
        except Exception as e:  # vLLM's refusals are the finding
            traceback.print_exc()
            res["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
        res["seconds"] = round(time.time() - t0)
        print("RESULT " + json.dumps(res), flush=True)
        if "error" in res:
            return


def main() -> None:
    step, out = sys.argv[1], Path(sys.argv[2])
    families = sys.argv[3].split(",") if len(sys.argv) > 3 else list(FAMILIES)
    if step == "make":
        make(out, families, sys.argv[4].split(",") if len(sys.argv) > 4 else list(SCHEMES))
        return
    ref = json.loads((out / "lowbit.json").read_text())
    runs = (sys.argv[4].split(",") if len(sys.argv) > 4
            else [f"{s}:{d}" for s in SCHEMES for d in ("float32", "bfloat16")])
    if step == "one":
        serve_family(out, families[0], runs, ref)
        return
    for fam in families:  # a process per family (its log: OUT/FAMILY.log); a crash: the rest in a new one
        todo = [r for r in runs if str(out / f"{fam}-{r.split(':')[0]}") in ref["runs"]]
        while todo:
            left = len(todo)
            with open(out / f"{fam}.log", "a") as log:
                p = subprocess.run([sys.executable, __file__, "one", str(out), fam, ",".join(todo)],
                                   stdout=subprocess.PIPE, stderr=log, text=True)
            for line in p.stdout.splitlines():
                if not line.startswith("RESULT "):
                    continue
                res = json.loads(line[7:])
                todo.remove(res["run"])
                scheme, dtype = res["run"].split(":")
                print(f"| {fam}-{scheme} | {dtype} | " +
                      (f"{res['max_abs_logprob_diff']:.2g}" if "error" not in res else res["error"]) +
                      f" | {res['seconds']} s, load {res['load']} |", flush=True)
            if len(todo) == left:
                break
        for r in todo:
            print(f"| {fam}-{r} | the process ended with code {p.returncode} (OUT/{fam}.log) |", flush=True)


if __name__ == "__main__":
    main()
