"""One reconstruction step on the Llama-3.1-8B-shaped layer against its floor (issue 35).

Builds ``bench_calibrate.llama8b``'s layer (4 windows of ``SEQ`` tokens), measures the float
layer's forward + backward of one window (``bench_calibrate.floor``), then quantizes it to nvfp4
with RTN codes and ``STEPS`` reconstruction steps of one window (the steps' work does not depend
on GPTQ, which is skipped for time) and prints the seconds of one step.

    .venv/bin/python bench/calibrate/bench_step_8b.py SEQ STEPS     # e.g. 512 8

Figures in bench/calibrate/RESULTS-calibrate.md ("The step's work per weight").
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_calibrate as B  # noqa: E402

import lowbit  # noqa: E402


def main() -> None:
    seq, steps = int(sys.argv[1]), int(sys.argv[2])
    model, tokens = B.llama8b(4, seq)
    fl = B.floor(model, tokens, 1)
    print(f"floor: forward {fl['forward_s']:.3f} s, forward + backward {fl['forward_backward_s']:.3f} s "
          f"({fl['tokens']} tokens); load {os.getloadavg()}", flush=True)
    q = lowbit.quantize(model, "nvfp4", calibration=tokens, weight_rounding="rtn", reconstruct_iters=steps,
                        progress=False)
    c = q.lowbit_calibration.cost
    step = c.seconds["reconstruct-steps"] / c.layer_calls["reconstruct-steps"]
    print(f"window {seq}: one step {step:.2f} s = {step / fl['forward_backward_s']:.2f}x the floor; "
          f"phases {c.as_dict()}; load {os.getloadavg()}")


if __name__ == "__main__":
    main()
