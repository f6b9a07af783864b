"""Every scheme lowbit writes as compressed-tensors, served by vLLM's CPU build: does it load and run,
and with which numbers? (issue 21: "every scheme either matches or is listed with the exact engine
limitation").

A tiny random model whose every linear side is a multiple of 128 (so the group-128 INT4 and the
128 x 128 block-FP8 layouts exist for it; SmolLM2's 576 columns have none), quantized by
``lowbit.quantize`` with each scheme's defaults (calibration on random ids where a scheme needs
it), saved as compressed-tensors and served by vLLM in its own venv (``lowbit.engines.run_vllm``).
Per scheme: vLLM's perplexity on 3 random prompts of 96 tokens against lowbit's own float32
evaluation of the same folder and, where lowbit emulates vLLM-CPU's arithmetic (``--numerics``:
vllm-cpu for AVX2 hosts, vllm-cpu-avx512 for AVX-512 + VNNI ones), against the emulation; greedy
agreement over 8 new tokens per
prompt; vLLM's load and run seconds; or vLLM's error in one line. The verdicts lowbit prints after
``lowbit quantize --format compressed-tensors`` (``lowbit.formats.ct_serving``) come from these rows.

    .venv/bin/python bench/serve/serve_schemes.py [--model llama|qwen3] [--schemes a,b] [--numerics N] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from helpers.served import (MODELS, calibration_ids, greedy, logprobs, max_abs_diff,  # noqa: E402
                            perplexity, prompts)

import lowbit  # noqa: E402
from lowbit.engines import EngineError, run_vllm  # noqa: E402
from lowbit.errors import LowbitError  # noqa: E402
from lowbit.quant.serving import ServingNumerics  # noqa: E402
from lowbit.schemes import PRESETS  # noqa: E402
from serve_vllm import _agreement  # noqa: E402  (bench/serve/serve_vllm.py: the greedy agreement of its table)

N_GEN = 8


def run_scheme(model_name: str, scheme: str, root: Path,
               numerics: ServingNumerics = ServingNumerics.VLLM_CPU) -> dict:
    ps = prompts()
    gen = [p[:32] for p in ps]
    row: dict = {"model": model_name, "scheme": scheme}
    folder = root / f"{model_name}-{scheme}"
    model = MODELS[model_name]()
    if scheme != "float":
        model = lowbit.quantize(model, scheme, calibration_ids(), num_samples=8, seq_len=64, progress=False)
    try:
        if scheme == "float":
            model.save_pretrained(folder)
        else:
            lowbit.save(model, folder, format="compressed-tensors", overwrite=True)
    except LowbitError as e:
        return {**row, "status": "not written", "error": str(e)}
    ref = model if scheme == "float" else lowbit.load(folder)
    ref_lp = logprobs(ref, ps)
    row["lowbit_ppl"] = perplexity(ref_lp)
    try:
        reply = run_vllm(folder, score=ps, generate=gen, max_tokens=N_GEN, timeout_s=900)
    except EngineError as e:
        return {**row, "status": "refused", "error": str(e).split(" (folder ")[0][:400]}
    row.update(status="runs", vllm_ppl=perplexity(reply.logprobs), load_s=reply.load_s, run_s=reply.run_s,
               max_dlogp_lowbit=max_abs_diff(reply.logprobs, ref_lp),
               greedy_vs_lowbit=_agreement(reply.generated, greedy(ref, gen, N_GEN)))
    if scheme == "float":
        return row
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            emu = lowbit.load(folder, numerics=numerics)
        row["emulation_warnings"] = sorted({str(w.message)[:200] for w in caught if "lowbit" in str(w.message)})
        e_lp = logprobs(emu, ps)
        row.update(emulation_ppl=perplexity(e_lp), max_dlogp_emulation=max_abs_diff(reply.logprobs, e_lp),
                   greedy_vs_emulation=_agreement(reply.generated, greedy(emu, gen, N_GEN)))
    except LowbitError as e:
        row["emulation"] = str(e)[:200]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="llama")
    ap.add_argument("--schemes", default="float," + ",".join(PRESETS))
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--numerics", default="vllm-cpu", help="the emulation compared: vllm-cpu (AVX2 hosts) or "
                                                              "vllm-cpu-avx512 (AVX-512 + VNNI hosts)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for scheme in a.schemes.split(","):
            row = run_scheme(a.model, scheme, Path(tmp), ServingNumerics(a.numerics))
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
