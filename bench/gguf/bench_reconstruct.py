"""Block reconstruction of calibrated GGUF files (``reconstruct_iters``), scored by llama.cpp.

For one float model and each mix, ``quantize_gguf`` with the default calibration (importance-weighted
search, GPTQ; 16 x 512 windows of Emma) at each number of reconstruction steps, one run at a time
(the seconds are side by side), each file scored by ``llama-perplexity --kl-divergence`` against
the float32 file's logits on Persuasion (``bench_gguf.py``'s texts and base):

    python bench/gguf/bench_reconstruct.py --llama BIN --out /tmp/recon --mixes Q2_K,Q3_K_M,Q4_K_M \\
        --iters 0,10,20 [--model FOLDER --tokenizer-from PUBLISHED.gguf]

``-nr`` (no weight repacking) is passed to llama-perplexity: on the AMX host of these figures the
repacked kernels stop with an illegal instruction; the scores are the plain CPU kernels'.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from bench_gguf import kld_figures, prepare, run
from bench_native_search import _cpu as cpu_line


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama", required=True, help="folder with llama-perplexity")
    ap.add_argument("--model", default=None, help="float HF folder (default: the built-in SmolLM2-135M)")
    ap.add_argument("--out", default="bench/gguf/out-reconstruct")
    ap.add_argument("--mixes", default="Q2_K,Q3_K_M,Q4_K_M")
    ap.add_argument("--iters", default="0,10,20")
    ap.add_argument("--tokenizer-from", default=None)
    a = ap.parse_args()

    from lowbit.calibration import CalibrationConfig
    from lowbit.files.folder import SafetensorsFolder
    from lowbit.formats.gguf.convert import plan_gguf
    from lowbit.formats.gguf.writer import write_gguf
    from lowbit.gguf_quantize import quantize_gguf

    out, src, calib, evalt = prepare(a.out, a.model, 60000, 60000)
    tools = Path(a.llama)
    base = out / "base.kld"
    if not base.exists():
        f32 = out / "model-f32.gguf"
        write_gguf(plan_gguf(src, tokenizer_from=a.tokenizer_from), f32, SafetensorsFolder(src), {})
        run([str(tools / "llama-perplexity"), "-m", str(f32), "-f", str(evalt), "-c", "512", "-t", "2",
             "--kl-divergence-base", str(base)], out / "ppl-f32.log")
    rows = []
    for mix in a.mixes.split(","):
        for iters in (int(i) for i in a.iters.split(",")):
            path = out / f"{mix}-r{iters}.gguf"
            t0 = time.perf_counter()
            quantize_gguf(src, path, mix, calibration=str(calib), overwrite=True, progress=False,
                          tokenizer_from=a.tokenizer_from,
                          config=CalibrationConfig(num_samples=16, seq_len=512, reconstruct_iters=iters))
            secs = time.perf_counter() - t0
            load = os.getloadavg()[0]
            res, _ = run([str(tools / "llama-perplexity"), "-m", str(path), "-f", str(evalt), "-c", "512", "-t", "2",
                          "--kl-divergence-base", str(base), "--kl-divergence", "-nr"], out / f"ppl-{path.stem}.log")
            row = {"mix": mix, "iters": iters, "size": path.stat().st_size, "seconds": round(secs, 1),
                   "load": round(load, 2), **kld_figures(res)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    (out / "results.json").write_text(json.dumps({"cpu": cpu_line(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
