"""How many evaluation tokens the main job needs: every default scheme against float on the
whole built-in evaluation text, then the intervals recomputed on its first N tokens.

For each N: the KLD and Δppl interval of each scheme against float, and which pairs of schemes
are within noise (paired KLD interval contains zero); plus the time of one float and one
quantized scoring pass of N tokens. Prints Markdown for bench/eval/RESULTS-eval.md.

    .venv/bin/python bench/eval/bench_eval_size.py [--limit 8192] [--sizes 512,1024,2048,4096,8192]
"""

from __future__ import annotations

import argparse
import copy
import os
import time
from dataclasses import replace

import lowbit
from lowbit.calibration import FloatStates
from lowbit.eval.divergence import divergence, paired
from lowbit.eval.perplexity import score_text
from lowbit.eval.reference import float_reference
from lowbit.linearize import linearize
from lowbit.report.compare import DEFAULT_SCHEMES, CompareOptions, quantize_with_options


def _prefix(scores, n):
    cut = {k: (v[:n] if v is not None and hasattr(v, "shape") else v) for k, v in scores.__dict__.items()}
    return replace(scores, **cut)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=8192)
    ap.add_argument("--sizes", default="512,1024,2048,4096,8192")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    model, tok = lowbit.load_model()
    model.eval()
    linearize(model)
    t0 = time.perf_counter()
    ref = float_reference(model, tok, limit=args.limit, progress=False)
    float_s = time.perf_counter() - t0
    n_tok = ref.result.tokens_scored
    opts = CompareOptions(progress=False)
    states = FloatStates()
    scores, times = {}, {}
    for name in DEFAULT_SCHEMES:
        q, _, _ = quantize_with_options(copy.deepcopy(model), name, tok, opts, states)
        t0 = time.perf_counter()
        scores[name] = score_text(q, tok, limit=args.limit, reference=ref, progress=False)
        times[name] = time.perf_counter() - t0
        del q
    print(f"SmolLM2-135M, {n_tok} tokens scored; float pass {float_s:.1f} s, "
          + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()) + f"; load {os.getloadavg()[0]:.2f}\n")
    print("| tokens | " + " | ".join(f"{s}: KLD / Δppl %" for s in DEFAULT_SCHEMES) + " | pairs within noise |")
    print("|---" * (len(DEFAULT_SCHEMES) + 2) + "|")
    for n in sizes:
        if n > n_tok:
            continue
        cut = {k: _prefix(v, n) for k, v in scores.items()}
        cells = []
        for k in DEFAULT_SCHEMES:
            d = divergence(cut[k])
            cells.append(f"{d.kld.estimate:.4f} ±{(d.kld.high - d.kld.low) / 2:.4f} / "
                         f"{d.ppl_change_pct.estimate:+.1f} [{d.ppl_change_pct.low:+.1f}, {d.ppl_change_pct.high:+.1f}]")
        names = list(DEFAULT_SCHEMES)
        noise = [f"{a} ~ {b}" for i, a in enumerate(names) for b in names[i + 1:]
                 if paired(cut[a], cut[b])["within_noise"]]
        print(f"| {n} | " + " | ".join(cells) + f" | {', '.join(noise) or 'none'} |")


if __name__ == "__main__":
    main()
