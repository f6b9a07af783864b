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
from lowbit.algorithms.gptq import WeightRounding
from lowbit.algorithms.rotate.options import DEFAULT_ROTATION
from lowbit.errors import OptionRef, QuantizationError
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
        folder's. When nothing calibrates (``model_quant.calibrates``: no static activation scales,
        no SmoothQuant, no GPTQ), the run is model-free (``lowbit.modelfree.quantize_model_free``,
        which takes ``workers``, ``include_lm_head`` and ``run_options``).
    device: where each layer is calibrated and quantized ("cuda", "cuda:1"; default: the CPU).
    offload: keep the calibration activations in CPU memory and move each batch to ``device``
        when it runs (for activations larger than the device's memory).
    group: the ranks to split the work over (``lowbit.dist.Group``; default: ``Group.join``).
    resume: continue a killed run from its last finished layer (the same arguments only).
    Errors: QuantizationError / FormatError / SchemeError naming the option, file or tensor; an
    interrupted run leaves only its temporary folder (resumable), never a half-written output.
    """
    return run_streamed(src, out, scheme, format, calibration=calibration, tokenizer=tokenizer,
                        smoothquant=smoothquant, config=config, preset=preset, ignore=ignore,
                        include_lm_head=include_lm_head, allow_unquantized=allow_unquantized, resume=resume,
                        overwrite=overwrite, progress=progress, device=device, offload=offload, workers=workers,
                        run_options=run_options, group=group, **calibration_options).path


def run_streamed(src, out, scheme, format="lowbit", *, calibration=None, tokenizer=None, smoothquant=DEFAULT,
                 config=None, preset=None, ignore=(), include_lm_head=False, allow_unquantized=False, resume=True,
                 overwrite=False, progress=None, device=None, offload=False, workers=2, run_options=None,
                 group=None, **calibration_options) -> StreamResult:
    """``quantize_checkpoint`` returning what the run did (``StreamResult``; the CLI prints it)."""
    from lowbit.formats import Format, get_layout
    from lowbit.calibration.config import calibration_config
    from lowbit.recipes.plan import recipe_of
    from lowbit.streamed.planned import alphas_of, calibrating, open_planned

    recipe = recipe_of(scheme)  # SchemeError / RecipeError, before anything is read
    fmt = Format.parse(format)
    for s in recipe.schemes:
        get_layout(fmt).check_scheme(s)
    alphas = alphas_of(recipe.schemes, smoothquant)
    cfg = calibration_config(config, preset, calibration_options)
    if cfg.rotation is not DEFAULT_ROTATION:
        raise QuantizationError(f"rotation={cfg.rotation.value!r} rewrites the embeddings, every layer and lm_head "
                                f"together, which a run streamed one layer at a time (or model-free) cannot do: "
                                f"quantize in memory (lowbit.quantize, then lowbit.save)")
    if calibration is not None and calibrating(recipe.schemes, alphas, cfg):
        if include_lm_head:
            raise QuantizationError("a calibrated output head is not streamed yet: drop {head}, or quantize in "
                                    "memory (lowbit.quantize, then lowbit.save)", head=OptionRef("include_lm_head"))
        planned = open_planned(Path(src), recipe, list(ignore))  # the recipe resolved (lowbit.recipes.plan)
        if calibrating(planned.schemes, alphas, cfg):
            from lowbit.streamed.run import StreamedJob, streamed

            return streamed(StreamedJob(planned, Path(out), fmt, alphas, cfg, calibration, tokenizer, list(ignore),
                                        allow_unquantized, resume, overwrite, progress, device, offload, group))
        planned.close()  # no linear got a scheme that calibrates: round-to-nearest, as in memory
    # model-free: it refuses schemes that need calibration, naming the dynamic alternatives
    # (asked for: without calibration data the 4-bit schemes' default GPTQ is plain RTN)
    if calibration is None and not any(s.needs_calibration for s in recipe.schemes) and (
            any(a is not None for a in alphas.values()) or cfg.weight_rounding is WeightRounding.GPTQ):
        raise QuantizationError(f"{recipe.label} with SmoothQuant or GPTQ needs calibration data (pass "
                                f"{{calibration}})", calibration=OptionRef("calibration", "builtin"))
    from lowbit.modelfree import quantize_model_free as model_free

    path = model_free(src, out, recipe, fmt.value, workers=workers, ignore=ignore, include_lm_head=include_lm_head,
                      resume=resume, overwrite=overwrite, progress=progress, device=device,
                      run_options=run_options, group=group)
    return StreamResult(Path(path), {}, peak_rss=peak_rss_bytes())


def fingerprint(src: Path, ckpt, recipe: Recipe, fmt, tokens: torch.Tensor, cfg, smoothquant, ignore: list[str],
                world: int, device, valid: torch.Tensor | None = None) -> str:
    """What decides the output bytes of a streamed run (a resumed run must match it, and every
    rank of a job: ``Group.agree``): the source, the recipe (one scheme: as before recipes; any
    other: ``recipe_key``), the format, options, calibration tokens, ranks and device."""
    from lowbit.recipes.plan import is_plain, recipe_key

    blob = {
        "src": str(src.resolve()), "tensors": sorted((i.name, i.shard, i.dtype, i.shape, i.begin, i.end)
                                                     for i in ckpt.tensors.values()),
        "scheme": repr(recipe.default) if is_plain(recipe) else "recipe", "format": fmt.value, "config": repr(cfg),
        "smoothquant": repr(smoothquant), "ignore": ignore, "world": world, "device": str(device),
    }
    if not is_plain(recipe):
        blob["recipe"] = recipe_key(recipe)
    h = hashlib.sha256()
    h.update(json.dumps(blob, sort_keys=True, default=str).encode())
    h.update(tokens.contiguous().numpy().tobytes())
    if valid is not None:  # padded windows: which positions count
        h.update(b"valid" + valid.contiguous().numpy().tobytes())
    return h.hexdigest()[:32]

