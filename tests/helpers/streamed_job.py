"""A streamed quantization job for the tests to start (alone, or as the ranks of torchrun):

    python streamed_job.py SRC OUT_ROOT SCHEME:FORMAT[:gptq][:recon][:modelfree] ...

writes OUT_ROOT/SCHEME (SCHEME-recon with :recon) for each, calibrated on the tests' fixed token ids
(with :modelfree, not calibrated: model-free quantization)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import lowbit

TOKENS = torch.randint(0, 256, (10, 32), generator=torch.Generator().manual_seed(0))  # 3 batches of 4

def out_name(job: str) -> str:
    """The output folder of a job: its scheme, with "-recon" for a reconstruction job."""
    return job.split(":")[0] + ("-recon" if "recon" in job.split(":")[2:] else "")


if __name__ == "__main__":
    src, root = Path(sys.argv[1]), Path(sys.argv[2])
    for job in sys.argv[3:]:
        scheme, fmt, *rest = job.split(":")
        kw = {"weight_rounding": "gptq"} if "gptq" in rest else {}
        if "recon" in rest:  # block reconstruction: 5 steps over the 3 batches, owned by different ranks
            kw["reconstruct_iters"] = 5
        if "modelfree" in rest:
            lowbit.quantize_checkpoint(src, root / out_name(job), scheme, fmt, workers=0, progress=False)
            continue
        lowbit.quantize_checkpoint(src, root / out_name(job), scheme, fmt, calibration=TOKENS, **kw)
