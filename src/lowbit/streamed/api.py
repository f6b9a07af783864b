"""What a streamed calibrated run reports (``StreamResult``) and what decides its output bytes
(``fingerprint``: a resumed run, and every rank of a torchrun job, must agree on it).

The run itself: ``lowbit.quantize_checkpoint`` (``lowbit.checkpoint_api``) plans it
(``lowbit.streamed.checkpoint_plan``) and ``lowbit.streamed.run`` executes it: the model is built
without weights (``Skeleton``), and each decoder layer is read from the shards, calibrated and
quantized exactly as ``lowbit.quantize`` does in memory (the same ``LayerwiseCalibrator``),
written, and freed (``LayerStream``, ``StreamOutput``). The tensors written equal those of
``lowbit.save(lowbit.quantize(lowbit.load_model(src)[0], ...))`` bit for bit.

Under torchrun (WORLD_SIZE > 1) the ranks split the calibration batches; statistics are combined
exactly (``lowbit.calibration.reduce``), each GPTQ solve runs on one rank, and the output equals
one process's.
"""

from __future__ import annotations

import hashlib
import json
import resource
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class StreamResult:
    """What a streamed run did: the output folder, ``quantized_summary``'s fields, the
    calibration report, seconds per decoder layer (this rank), peak RSS in bytes (this rank)."""

    path: Path
    summary: dict
    report: object = None
    layer_seconds: list[float] = field(default_factory=list)
    peak_rss: int = 0
    ranks: int = 1


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def fingerprint(plan, ckpt, tokens: torch.Tensor, valid: torch.Tensor | None, world: int, device) -> str:
    """What decides the output bytes of a streamed run of ``plan`` (a ``CheckpointPlan``; a resumed
    run must match it, and every rank of a job: ``Group.agree``): the source (``ckpt``'s tensors),
    the recipe (one scheme: as before recipes; any other: ``recipe_key``), the format, options,
    calibration tokens (and which positions count, ``valid``), ranks and device."""
    from lowbit.recipes.plan import is_plain, recipe_key

    recipe = plan.recipe
    blob = {
        "src": str(plan.source.resolve()), "tensors": sorted((i.name, i.shard, i.dtype, i.shape, i.begin, i.end)
                                                             for i in ckpt.tensors.values()),
        "scheme": repr(recipe.default) if is_plain(recipe) else "recipe", "format": plan.checkpoint_format.value,
        "config": repr(plan.config), "smoothquant": repr(plan.smoothquant()), "ignore": plan.ignore, "world": world,
        "device": str(device),
    }
    if not is_plain(recipe):
        blob["recipe"] = recipe_key(recipe)
    h = hashlib.sha256()
    h.update(json.dumps(blob, sort_keys=True, default=str).encode())
    h.update(tokens.contiguous().numpy().tobytes())
    if valid is not None:  # padded windows: which positions count
        h.update(b"valid" + valid.contiguous().numpy().tobytes())
    return h.hexdigest()[:32]

