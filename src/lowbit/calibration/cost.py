"""Where a calibration run spends its work: wall seconds and layer passes per phase.

Each phase of ``lowbit.calibration.pipeline`` adds its wall time (``time.perf_counter``) and the
layer forward calls it made (one calibration batch each, on this rank) to a ``CalibrationCost``,
kept on the ``CalibrationReport`` (``report.cost``, written to report.json by ``compare``). The
counts are the cost model that tests check (they depend on the options and the data, never on
the host); the seconds are for benchmarks (bench/calibrate/bench_calibrate.py) and for users asking where
the time went.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterator


class Phase(str, Enum):
    CAPTURE = "capture"                      # the model up to the first decoder layer
    OBSERVE = "observe"                      # statistics passes: observers, SmoothQuant maxima, Hessians
    SMOOTH = "smooth"                        # SmoothQuant scales, folding and re-observed groups
    TARGETS = "targets"                      # the float layer's outputs that reconstruction aims at
    QUANTIZE = "quantize"                    # weights: RTN, or GPTQ (scale search and column solve)
    RECONSTRUCT_STEPS = "reconstruct-steps"  # the steps (calls: steps; a forward + backward per window)
    RECONSTRUCT_EVALS = "reconstruct-evals"  # the whole-set evaluations that keep the best step
    NEXT_INPUTS = "next-inputs"              # the quantized layer run to make the next layer's inputs
    WHOLE_MODEL = "whole-model"              # linears outside the decoder layers (lm_head)

    def __str__(self) -> str:
        return self.value


@dataclass
class CalibrationCost:
    seconds: dict[str, float] = field(default_factory=dict)   # phase -> wall seconds
    layer_calls: dict[str, int] = field(default_factory=dict)  # phase -> layer forward calls (one batch each)
    backward_calls: int = 0                                   # reconstruction forward + backward passes (one window each)
    reused_outputs: int = 0                                   # layers whose next inputs came from reconstruction
    reused_float_states: int = 0                              # layers whose float outputs came from a shared
    #                                                           FloatStates (lowbit.calibration.float_states)

    def add(self, phase: Phase, seconds: float, calls: int = 0) -> None:
        key = phase.value
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds
        if calls:
            self.layer_calls[key] = self.layer_calls.get(key, 0) + calls

    @contextmanager
    def timed(self, phase: Phase, calls: int = 0) -> Iterator[None]:
        """Add the block's wall time (and ``calls`` layer calls) to ``phase``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - t0, calls)

    def as_dict(self) -> dict:
        return {"seconds": {k: round(v, 4) for k, v in self.seconds.items()}, "layer_calls": dict(self.layer_calls),
                "backward_calls": self.backward_calls, "reused_outputs": self.reused_outputs,
                "reused_float_states": self.reused_float_states}
