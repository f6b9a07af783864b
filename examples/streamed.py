"""Calibrated quantization of a model larger than memory, streamed from its checkpoint.

    python examples/streamed.py MODEL OUT [--scheme w8a8-int8] [--device cuda]

The model is built on the meta device; each decoder layer is read from the shards, calibrated,
quantized, written as its own shard and freed, so peak memory is about one layer plus the
calibration activations. The bytes equal the in-memory path's. A killed run resumes from its last
finished layer when started again with the same arguments. Prints the peak resident memory.
"""

from __future__ import annotations

import argparse
import resource

import lowbit


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--scheme", default="w8a8-int8")
    ap.add_argument("--format", default="compressed-tensors")
    ap.add_argument("--calib", default="builtin")
    ap.add_argument("--calib-samples", type=int)
    ap.add_argument("--calib-seq-len", type=int)
    ap.add_argument("--device", help="calibrate each layer on this device (cuda, cuda:N)")
    ap.add_argument("--offload-activations", action="store_true", help="with --device: activations in CPU memory")
    a = ap.parse_args(argv)

    budget = {k: v for k, v in (("num_samples", a.calib_samples), ("seq_len", a.calib_seq_len)) if v is not None}
    out = lowbit.quantize_checkpoint(a.model, a.out, a.scheme, a.format, calibration=a.calib, device=a.device,
                                     offload=a.offload_activations, **budget)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"wrote {out}; peak RSS {peak_mb:.0f} MB")


if __name__ == "__main__":
    main()
