"""Calibrated quantization streamed from a checkpoint folder, one decoder layer at a time.

    lowbit.quantize_checkpoint("Llama-3.1-8B", "out", "w8a8-int8", calibration="builtin")

Only the embeddings and head, the current (and the prefetched next) decoder layer and the
calibration activations are in memory; the output equals the in-memory path's bit for bit, is
resumable after a kill, and the same command under torchrun splits the work over the ranks.
See ``lowbit.checkpoint_api`` (the entry point) and ``lowbit.streamed.api``; ``plan_checkpoint`` / ``run_checkpoint`` (``lowbit.streamed.checkpoint_plan``)
split a run into its resolved plan and its execution.
"""

from lowbit.streamed.api import StreamResult
from lowbit.streamed.checkpoint_plan import (
    CalibrationChoice, CheckpointPlan, RunSettings, TargetChoice, checkpoint_plan_of, plan_checkpoint, run_checkpoint,
)

__all__ = ["StreamResult", "CheckpointPlan", "CalibrationChoice", "TargetChoice",
           "RunSettings", "checkpoint_plan_of", "plan_checkpoint", "run_checkpoint"]
