"""Evaluate a quantized folder against its float model: perplexity, last-word accuracy, the change.

    python examples/evaluate.py QUANTIZED FLOAT [--tokens 2048] [--lastword 40] [--text FILE]

Both models are scored on the same windows of the same text (lowbit's built-in evaluation text,
Jane Austen's Persuasion, or --text, one paragraph a line). With quantized activations a model's
output moves with float rounding; --spread N also reports the perplexity's sd under N tiny input
perturbations, so a difference inside it reads as noise.
"""

from __future__ import annotations

import argparse
import json

import lowbit
from lowbit.eval import lastword_accuracy, perplexity
from lowbit.eval.spread import perplexity_spread, spread_summary


def _score(model, tok, a) -> dict:
    ppl = perplexity(model, tok, text_file=a.text, limit=a.tokens, progress=False)
    out = {"perplexity": ppl.perplexity, "bits_per_byte": ppl.bits_per_byte, "tokens": ppl.tokens_scored}
    if a.lastword:
        out["lastword"] = lastword_accuracy(model, tok, limit=a.lastword, progress=False).accuracy
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("quantized")
    ap.add_argument("float")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--lastword", type=int, default=40, help="last-word examples (0 skips)")
    ap.add_argument("--text", help="evaluation text file (default: built-in)")
    ap.add_argument("--spread", type=int, default=0, help="perturbed re-evaluations of the quantized model")
    a = ap.parse_args(argv)

    qmodel = lowbit.load(a.quantized)
    fmodel, tok = lowbit.load_model(a.float)
    q, f = _score(qmodel, tok, a), _score(fmodel, tok, a)
    report = {"quantized": q, "float": f, "ppl_change_pct": 100 * (q["perplexity"] / f["perplexity"] - 1)}
    if a.spread:
        values = perplexity_spread(qmodel, tok, seeds=a.spread, text_file=a.text, limit=a.tokens, progress=False)
        report["ppl_spread"] = spread_summary(q["perplexity"], values)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
