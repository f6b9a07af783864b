"""``lowbit.quantize_checkpoint``: quantize a checkpoint folder into another, calibrated or not,
without holding the model in memory.

Without calibration (schemes that need none, no SmoothQuant, no GPTQ) this is model-free
quantization (``lowbit.modelfree``). With calibration it is streamed: the model is built
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
import os
import resource
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch

from lowbit.algorithms.smoothquant.defaults import DEFAULT
from lowbit.errors import QuantizationError
from lowbit.recipes import Recipe
from lowbit.schemes import Scheme


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


def quantize_checkpoint(src: str | os.PathLike, out: str | os.PathLike,
                        scheme: "str | Scheme | Recipe | dict" = "nvfp4-e5m3",
                        format: str = "lowbit", *, calibration=None, tokenizer=None, smoothquant=DEFAULT,
                        config=None, preset: str | None = None, ignore: Iterable[str] = (),
                        include_lm_head: bool = False, allow_unquantized: bool = False, resume: bool = True,
                        overwrite: bool = False, progress: bool | None = None, device: str | None = None,
                        offload: bool = False, workers: int = 2, run_options=None, group=None,
                        **calibration_options) -> Path:
    """Quantize the checkpoint folder ``src`` into ``out`` and return ``out``.

    scheme: a preset name or Scheme, or a recipe (anything ``lowbit.recipes.Recipe.of`` takes:
        a Recipe, a mapping, a ``.json`` / ``.yaml`` file), resolved on the source's quantizable
        linears by the rules of ``lowbit.quantize`` (``lowbit.recipes.plan``); the config gets a
        group per scheme. The run calibrates when one of the schemes the linears get does.
    calibration, tokenizer, smoothquant, config, preset, calibration_options, allow_unquantized,
        ignore: as for ``lowbit.quantize`` (same defaults). ``tokenizer`` defaults to the source
        folder's. When nothing calibrates (``lowbit.method.calibrates``: no static activation scales,
        no SmoothQuant, no GPTQ), the run is model-free (``lowbit.modelfree.quantize_model_free``,
        which takes ``workers``, ``include_lm_head`` and ``run_options``).
    device: where each layer is calibrated and quantized ("cuda", "cuda:1"; default: the CPU).
    offload: keep the calibration activations in CPU memory and move each batch to ``device``
        when it runs (for activations larger than the device's memory).
    group: the ranks to split the work over (``lowbit.dist.Group``; default: ``Group.join``).
    resume: continue a killed run from its last finished layer (the same arguments only).
    format "gguf": one GGUF file for llama.cpp (``scheme`` a llama-quantize mix such as Q4_K_M, or
        one GGML type), ``lowbit.quantize_gguf``'s run (importance matrix and GPTQ from
        ``calibration``; without it llama.cpp's reference rounding); the other options are refused.
    Errors: QuantizationError / FormatError / SchemeError naming the option, file or tensor; an
    interrupted run leaves only its temporary folder (resumable), never a half-written output.
    """
    from lowbit.streamed.checkpoint_plan import (
        CalibrationChoice, RunSettings, TargetChoice, plan_checkpoint, run_checkpoint,
    )

    if _is_gguf(format):  # one GGUF file: the format's own run (lowbit.gguf_quantize), as ``--format gguf``
        from lowbit.gguf_options import DEFAULT_IMPORTANCE_SEARCH, gguf_calibration_config
        from lowbit.gguf_quantize import quantize_gguf

        given = {"smoothquant": smoothquant is not DEFAULT, "ignore": bool(tuple(ignore)),
                 "include_lm_head": include_lm_head, "allow_unquantized": allow_unquantized,
                 "device": device is not None, "offload": offload, "run_options": run_options is not None,
                 "group": group is not None}
        if calibration is None:
            given.update({"config": config is not None, "preset": preset is not None,
                          **{k: True for k in calibration_options}})
        if any(given.values()):
            raise QuantizationError(f"format 'gguf' takes a llama.cpp mix or GGML type, calibration and its options "
                                    f"(with calibration data), tokenizer, overwrite and progress; drop "
                                    f"{', '.join(k for k, v in given.items() if v)}")
        cfg, search = (gguf_calibration_config(str(scheme), config, preset, calibration_options)
                       if calibration is not None else (None, DEFAULT_IMPORTANCE_SEARCH))
        return quantize_gguf(src, out, str(scheme), calibration=calibration, tokenizer=tokenizer, config=cfg,
                             progress=progress, overwrite=overwrite, importance_search=search).path
    plan = plan_checkpoint(src, out, scheme, format,
                           CalibrationChoice(calibration, tokenizer, smoothquant, config, preset, calibration_options),
                           TargetChoice(tuple(ignore), include_lm_head, allow_unquantized),
                           RunSettings(resume, overwrite, progress, device, offload, workers, run_options, group))
    return run_checkpoint(plan).path


def _is_gguf(checkpoint_format) -> bool:
    from lowbit.formats import Format

    return Format.parse(checkpoint_format) is Format.GGUF


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

