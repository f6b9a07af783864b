"""NVFP4 with lowbit's most accurate calibration preset, ``best``.

    python examples/nvfp4_best.py MODEL OUT [--calib FILE]

``best`` is GPTQ, then 50 block-output reconstruction steps per decoder layer on 64 x 512
calibration tokens (SmolLM2-135M: +15.24% perplexity against auto-round tuned's +19.35%;
docs/calibration.md). It costs time: on a CPU, about half an hour of one core for a 135M model.
Streamed from the folder one layer at a time; saved as compressed-tensors (nvfp4-pack-quantized).
"""

from __future__ import annotations

import argparse

import lowbit


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--calib", default="builtin")
    ap.add_argument("--calib-samples", type=int, help="override the preset's 64 windows")
    ap.add_argument("--calib-seq-len", type=int, help="override the preset's 512 tokens")
    ap.add_argument("--format", default="compressed-tensors", help="compressed-tensors or lowbit")
    a = ap.parse_args(argv)

    budget = {k: v for k, v in (("num_samples", a.calib_samples), ("seq_len", a.calib_seq_len)) if v is not None}
    out = lowbit.quantize_checkpoint(a.model, a.out, "nvfp4", a.format, calibration=a.calib, preset="best",
                                     overwrite=True, **budget)
    print(f"wrote {out} (nvfp4, preset best)")


if __name__ == "__main__":
    main()
