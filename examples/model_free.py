"""Model-free quantization: safetensors file to file, no model class, no forward pass.

    python examples/model_free.py MODEL OUT [--scheme nvfp4-e5m3] [--format lowbit] [--workers 4]

For the schemes that need no calibration (weight-only, dynamic activations, NVFP4-E5M3, MX):
bounded memory, parallel over shards, resumable, and bit-identical to lowbit.quantize's
round-to-nearest. Under torchrun the same script splits the shards over the ranks.
"""

from __future__ import annotations

import argparse

import lowbit


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--scheme", default="nvfp4-e5m3")
    ap.add_argument("--format", default="lowbit", help="lowbit (every scheme), compressed-tensors, fake")
    ap.add_argument("--workers", type=int, default=2, help="CPU cores to use")
    ap.add_argument("--device", help="quantize on this device (bit-identical), e.g. cuda")
    a = ap.parse_args(argv)

    if lowbit.get_scheme(a.scheme).needs_calibration:
        raise SystemExit(f"{a.scheme} needs calibration; see examples/streamed.py")
    out = lowbit.quantize_checkpoint(a.model, a.out, a.scheme, a.format, workers=a.workers, device=a.device,
                                     overwrite=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
