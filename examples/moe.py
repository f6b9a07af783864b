"""Quantize a mixture-of-experts model (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3, gpt-oss, ...).

    python examples/moe.py MODEL OUT [--scheme w4a16] [--format compressed-tensors]

Fused experts are split into one linear per expert projection, so every expert gets its own
scales; calibration runs every expert on every token (the layer's output keeps the real routing),
so experts no token routes to are calibrated too. Routers stay in float. The checkpoint keeps the
family's own expert names. Prints the experts quantized and the linears left in float.
"""

from __future__ import annotations

import argparse

import lowbit


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--scheme", default="w4a16")
    ap.add_argument("--format", default="compressed-tensors")
    ap.add_argument("--calib", default="builtin")
    ap.add_argument("--calib-samples", type=int)
    ap.add_argument("--calib-seq-len", type=int)
    a = ap.parse_args(argv)

    model, tok = lowbit.load_model(a.model)
    budget = {k: v for k, v in (("num_samples", a.calib_samples), ("seq_len", a.calib_seq_len)) if v is not None}
    lowbit.quantize(model, a.scheme, calibration=a.calib, tokenizer=tok, **budget)
    names = [n for n, m in model.named_modules() if type(m).__name__ == "QuantLinear"]
    experts = [n for n in names if ".experts." in n]
    print(f"quantized {len(names)} linears, {len(experts)} of them expert projections")
    lowbit.save(model, a.out, format=a.format, tokenizer=tok, source_dir=a.model)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
