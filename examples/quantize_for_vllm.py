"""Quantize a Hugging Face model folder for vLLM: compressed-tensors, calibrated, streamed.

    python examples/quantize_for_vllm.py MODEL OUT [--scheme w4a16] [--calib FILE]

The model is read one decoder layer at a time (memory bounded by a layer), calibrated on the
built-in text or --calib (one paragraph a line) with the scheme's measured defaults (w4a16: GPTQ
+ 20 reconstruction steps per layer), and written as compressed-tensors, which vLLM and
transformers load. Prints which engines serve the folder, as lowbit measured them.
"""

from __future__ import annotations

import argparse

import lowbit
from lowbit.formats.ct_serving import engine_support


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="Hugging Face model folder (safetensors)")
    ap.add_argument("out", help="output folder")
    ap.add_argument("--scheme", default="w4a16", help="w4a16, w8a8-int8, w8a8-int8-dynamic, w8a8-fp8-dynamic, ...")
    ap.add_argument("--calib", default="builtin", help="calibration text file, or 'builtin'")
    ap.add_argument("--calib-samples", type=int, help="calibration windows (default: lowbit's, 16)")
    ap.add_argument("--calib-seq-len", type=int, help="tokens per window (default: lowbit's, 512)")
    a = ap.parse_args(argv)

    budget = {k: v for k, v in (("num_samples", a.calib_samples), ("seq_len", a.calib_seq_len)) if v is not None}
    out = lowbit.quantize_checkpoint(a.model, a.out, a.scheme, "compressed-tensors", calibration=a.calib,
                                     overwrite=True, **budget)
    print(f"wrote {out}")
    for verdict in engine_support(out, lowbit.get_scheme(a.scheme)):
        print(verdict.line())


if __name__ == "__main__":
    main()
