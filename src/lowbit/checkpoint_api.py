"""``lowbit.quantize_checkpoint``: quantize a checkpoint folder without holding the model in memory,
into another folder or, with ``format="gguf"``, into one GGUF file.

Without calibration (schemes that need none, no SmoothQuant, no GPTQ) this is model-free
quantization (``lowbit.modelfree``). With calibration it is streamed one decoder layer at a time
(``lowbit.streamed``). ``format="gguf"`` is ``lowbit.quantize_gguf``'s run (its calibration
streamed too, ``lowbit.gguf_streamed``). This module only chooses: it sits above both so that
neither package imports the other.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from lowbit.algorithms.smoothquant.defaults import DEFAULT
from lowbit.errors import QuantizationError
from lowbit.recipes import Recipe
from lowbit.schemes import Scheme


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

