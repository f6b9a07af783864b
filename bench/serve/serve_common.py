"""What the vLLM-side bench scripts share (run in vLLM's venv): one served folder and the prompt."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def served_prompt(folder: str, tokens: int):
    """(vLLM's LLM serving FOLDER in bfloat16, eager, one request; the first ``tokens`` token ids
    of the packaged evaluation text)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoTokenizer
    from vllm import LLM

    text = Path(__file__).resolve().parents[2].joinpath("src/lowbit/data/evaluation.txt").read_text()
    ids = AutoTokenizer.from_pretrained(folder)(text).input_ids[:tokens]
    return LLM(model=folder, dtype="bfloat16", enforce_eager=True, max_model_len=tokens + 8, seed=0), ids


def prompt_logprobs(llm, ids: list[int]) -> list[float]:
    """vLLM's log-probability of each token of ``ids`` after the first."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    o = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(prompt_logprobs=0, max_tokens=1))[0]
    return [p[t].logprob for p, t in zip(o.prompt_logprobs[1:], ids[1:])]
