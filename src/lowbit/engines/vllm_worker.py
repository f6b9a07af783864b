"""Run inside vLLM's own Python (never imported by lowbit): score token ids with vLLM.

    VLLM_PYTHON lowbit/engines/vllm_worker.py < request.json > reply.json

Standalone (stdlib + vllm only): vLLM pins other transformers/compressed-tensors versions than
lowbit, so it lives in a venv of its own and lowbit talks to it through this script's JSON.

request: {"folder": str, "dtype": "bfloat16", "max_model_len": int,
          "score": [[ids...], ...],            # prompt log-probabilities of every token after the first
          "generate": [[ids...], ...], "max_tokens": int}   # greedy continuations
reply (the last stdout line): {"logprobs": [[float, ...], ...], "greedy": [[bool, ...], ...],
          "generated": [[int, ...], ...],
          "load_s": float, "run_s": float}  or  {"error": "one line"}
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    req = json.loads(sys.stdin.read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt
    except Exception as e:  # the interpreter given is not vLLM's
        print(json.dumps({"error": f"cannot import vllm in {sys.executable}: {type(e).__name__}: {e}"}))
        return
    t0 = time.perf_counter()
    try:
        llm = LLM(model=req["folder"], dtype=req.get("dtype", "bfloat16"), enforce_eager=True, seed=0,
                  max_model_len=int(req["max_model_len"]), skip_tokenizer_init=True)
        t1 = time.perf_counter()
        out: dict = {"logprobs": [], "greedy": [], "generated": []}
        if req.get("score"):
            res = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in req["score"]],
                               SamplingParams(prompt_logprobs=1, max_tokens=1, detokenize=False),
                               use_tqdm=False)
            for ids, r in zip(req["score"], res):
                pairs = list(zip(r.prompt_logprobs[1:], ids[1:]))
                out["logprobs"].append([p[t].logprob for p, t in pairs])
                out["greedy"].append([p[t].rank == 1 for p, t in pairs])  # the token is the argmax
        if req.get("generate"):
            res = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in req["generate"]],
                               SamplingParams(temperature=0.0, max_tokens=int(req.get("max_tokens", 16)),
                                              ignore_eos=True, detokenize=False), use_tqdm=False)
            out["generated"] = [list(r.outputs[0].token_ids) for r in res]
    except Exception as e:  # vLLM's refusal of a folder is the answer
        msg = " ".join(str(e).split())[:300]
        print(json.dumps({"error": f"vLLM: {type(e).__name__}: {msg}"}))
        return
    out.update(load_s=round(t1 - t0, 2), run_s=round(time.perf_counter() - t1, 2))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
