"""Static W8A8 INT8 with SmoothQuant: per-channel int8 weights, one calibrated int8 scale per input.

    python examples/int8_smoothquant.py MODEL OUT [--alpha 0.8] [--calib FILE]

A static per-tensor input scale is set by its largest channel, so SmoothQuant first moves the
activation outliers into the weights (alpha 0.8 is lowbit's measured default for INT8 inputs;
'auto' searches it per layer, 'none' turns it off). Calibrated in memory, saved as
compressed-tensors; prints the alphas used and the change in perplexity against float.
"""

from __future__ import annotations

import argparse
import copy

import lowbit
from lowbit.eval import perplexity


def _alpha(text: str):
    return text if text in ("auto", "none", "default") else float(text)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--alpha", type=_alpha, default="default", help="an alpha in [0, 1], 'auto', 'none' or 'default'")
    ap.add_argument("--calib", default="builtin")
    ap.add_argument("--calib-samples", type=int)
    ap.add_argument("--calib-seq-len", type=int)
    ap.add_argument("--eval-tokens", type=int, default=1024, help="perplexity tokens of the built-in evaluation text")
    a = ap.parse_args(argv)

    model, tok = lowbit.load_model(a.model)
    budget = {k: v for k, v in (("num_samples", a.calib_samples), ("seq_len", a.calib_seq_len)) if v is not None}
    q = lowbit.quantize(copy.deepcopy(model), "w8a8-int8", calibration=a.calib, tokenizer=tok, smoothquant=a.alpha,
                        **budget)
    alphas = sorted({g.alpha for g in q.lowbit_calibration.groups.values() if g.alpha is not None})
    print(f"SmoothQuant alphas: {alphas or 'none'}")
    lowbit.save(q, a.out, format="compressed-tensors", tokenizer=tok, source_dir=a.model)
    base = perplexity(model, tok, limit=a.eval_tokens, progress=False).perplexity
    ppl = perplexity(q, tok, limit=a.eval_tokens, progress=False).perplexity
    print(f"wrote {a.out}: perplexity {ppl:.3f} vs float {base:.3f} ({100 * (ppl / base - 1):+.2f}%)")


if __name__ == "__main__":
    main()
