"""``RunPath``: how a checkpoint is made (a module of its own, free of torch, for the CLI's plan)."""

from __future__ import annotations

import enum


class RunPath(enum.Enum):
    """How a checkpoint is made."""

    MODEL_FREE = "model-free"  # tensors straight from the shards, no forward
    STREAMED = "streamed"      # calibrated one decoder layer at a time from the folder
    IN_MEMORY = "in-memory"    # the whole model loaded (rotations, automatic recipes, KV cache, no calibration)
    GGUF = "gguf"              # one GGUF file through llama.cpp's converter (lowbit.formats.gguf)
