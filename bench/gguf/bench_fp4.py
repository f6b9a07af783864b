"""GGML's FP4 types (MXFP4, NVFP4) in llama.cpp: lowbit's files against llama-quantize's, scored by
llama.cpp itself (issue 48, item 6: "NVFP4 / MXFP4 where llama.cpp runs them on the CPU").

On the outputs of ``bench_gguf.py`` (``--bench``: model-f32.gguf, base.kld, calib.txt):

1. lowbit: ``quantize_gguf(FOLDER, out, "mxfp4" | "nvfp4")`` (every tensor whose rows the type's
   block divides; llama-quantize's fallbacks otherwise), with and without calibration;
2. llama-quantize: the same file by ``--pure`` with ``--tensor-type .=TYPE --output-tensor-type TYPE
   --token-embedding-type TYPE`` (its ftype argument only names the file; llama.cpp has no NVFP4
   ftype); the two files compared tensor by tensor (type and bytes);
3. every file scored by ``llama-perplexity --kl-divergence`` on base.kld's tokens: mean KLD, same top
   token, perplexity; size and seconds.

    python bench/gguf/bench_fp4.py --bench /tmp/kq/bench --llama .../build/bin [--model FOLDER]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_gguf import compare_files, kld_figures, run  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench", required=True)
    ap.add_argument("--llama", required=True)
    ap.add_argument("--model", default=None, help="float HF folder (default: the built-in SmolLM2-135M)")
    ap.add_argument("--types", default="mxfp4,nvfp4")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--calib-chunks", type=int, default=16)
    ap.add_argument("--tokenizer-from", default=None)
    a = ap.parse_args()

    import torch

    from lowbit.calibration import CalibrationConfig
    from lowbit.gguf_quantize import quantize_gguf
    from lowbit.models import resolve_model_path

    torch.set_num_threads(2)
    bench, tools = Path(a.bench), Path(a.llama)
    out = bench / "fp4"
    out.mkdir(exist_ok=True)
    src = resolve_model_path(a.model)
    f32, base = bench / "model-f32.gguf", bench / "base.kld"
    rows, checks = [], {}

    def score(path: Path, label: str, seconds: float) -> None:
        res, _ = run([str(tools / "llama-perplexity"), "-m", str(path), "-t", "2", "--kl-divergence-base", str(base),
                      "--kl-divergence"], out / f"kld-{path.stem}.log")
        rows.append({"file": label, "size": path.stat().st_size, "seconds": seconds, "load": os.getloadavg()[0],
                     **kld_figures(res)})
        print(rows[-1], flush=True)

    for kind in a.types.split(","):
        theirs = out / f"llama-{kind}.gguf"
        _, t_q = run([str(tools / "llama-quantize"), "--pure", "--tensor-type", f".={kind}", "--output-tensor-type",
                      kind, "--token-embedding-type", kind, str(f32), str(theirs), "MXFP4_MOE", "2"],
                     out / f"quantize-{kind}.log")
        ours = out / f"lowbit-{kind}.gguf"
        t0 = time.perf_counter()
        r = quantize_gguf(src, ours, kind, overwrite=True, progress=False, tokenizer_from=a.tokenizer_from)
        t_ours = time.perf_counter() - t0
        checks[kind] = {**compare_files(ours, theirs), "types": r.counts()}
        score(theirs, f"llama-quantize {kind} (every tensor)", t_q)
        score(ours, f"lowbit {kind}", t_ours)
        ours_c = out / f"lowbit-{kind}-calibrated.gguf"
        t0 = time.perf_counter()
        quantize_gguf(src, ours_c, kind, calibration=str(bench / "calib.txt"), overwrite=True, progress=False,
                      tokenizer_from=a.tokenizer_from, config=CalibrationConfig(num_samples=a.calib_chunks, seq_len=a.ctx))
        score(ours_c, f"lowbit {kind}, calibrated (default options)", time.perf_counter() - t0)
    (out / "results.json").write_text(json.dumps({"rows": rows, "checks": checks}, indent=2, default=str))
    print(json.dumps(checks, indent=1, default=str))


if __name__ == "__main__":
    main()
