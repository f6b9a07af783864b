"""Does vLLM (CPU build) serve lowbit's compressed-tensors MoE output? Per-token log-probabilities
of one prompt, vLLM against lowbit, on tiny random Qwen3-MoE and Mixtral (legacy names) models.

Two steps, two venvs (vLLM pins older transformers; see ../shared/README.md):

    .venv/bin/python bench/moe/vllm_moe_check.py make OUT          # lowbit: folders + its log-probs
    .venv-vllm/bin/python bench/moe/vllm_moe_check.py serve OUT    # vLLM: one process per folder

Prints, per folder and dtype, the largest |log p_vLLM - log p_lowbit| over the prompt's tokens, or
vLLM's error (bench/moe/RESULTS-moe.md holds the figures).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

FAMILIES = ("qwen3_moe", "mixtral")
SCHEMES = ("float", "w8a8-int8-dynamic", "w8a8-int8", "w8a8-fp8-dynamic", "w4a16")


def make(out: Path) -> None:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    import lowbit
    from helpers.eval_fixtures import byte_tokenizer
    from helpers.moe_models import tiny_moe

    torch.set_grad_enabled(False)
    tok = byte_tokenizer()
    ids = torch.randint(3, 250, (1, 64), generator=torch.Generator().manual_seed(0))
    calib = torch.randint(3, 250, (4, 32), generator=torch.Generator().manual_seed(1))
    ref = {"ids": ids[0].tolist(), "runs": {}}
    for fam in FAMILIES:
        for scheme in SCHEMES:
            d = out / f"{fam}-{scheme}"
            m = tiny_moe(fam)
            if scheme == "float":
                m.save_pretrained(d)
                tok.save_pretrained(d)
            else:
                lowbit.save(lowbit.quantize(m, scheme, calibration=calib, num_samples=4, seq_len=32), d,
                            format="compressed-tensors", tokenizer=tok, overwrite=True)
                m = lowbit.load(d)
            lp = torch.log_softmax(m(input_ids=ids).logits[0].double(), -1)
            ref["runs"][str(d)] = lp[torch.arange(ids.shape[1] - 1), ids[0, 1:]].tolist()
    (out / "lowbit.json").write_text(json.dumps(ref))


def serve_one(folder: str, dtype: str, ref: dict) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ids = ref["ids"]
    try:
        llm = LLM(model=folder, dtype=dtype, enforce_eager=True, max_model_len=128, seed=0)
        o = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(prompt_logprobs=0, max_tokens=1))[0]
        lp = [p[t].logprob for p, t in zip(o.prompt_logprobs[1:], ids[1:])]
        return {"max_abs_logprob_diff": max(abs(a - b) for a, b in zip(lp, ref["runs"][folder]))}
    except Exception as e:  # vLLM's refusals are the finding
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}


def main() -> None:
    step, out = sys.argv[1], Path(sys.argv[2])
    if step == "make":
        make(out)
    elif step == "one":
        ref = json.loads((out / "lowbit.json").read_text())
        print("RESULT " + json.dumps(serve_one(sys.argv[3], sys.argv[4], ref)))
    else:
        ref = json.loads((out / "lowbit.json").read_text())
        for folder in ref["runs"]:
            for dtype in ("float32", "bfloat16"):
                p = subprocess.run([sys.executable, __file__, "one", str(out), folder, dtype],
                                   capture_output=True, text=True)
                res = next((json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")),
                           {"error": p.stderr.strip().splitlines()[-1][:200] if p.stderr.strip() else "no output"})
                print(f"| {Path(folder).name} | {dtype} | " +
                      (f"{res['max_abs_logprob_diff']:.2g}" if "error" not in res else res["error"]) + " |", flush=True)


if __name__ == "__main__":
    main()
