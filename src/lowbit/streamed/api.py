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

from lowbit.algorithms.smoothquant.defaults import DEFAULT, resolve_alpha
from lowbit.algorithms.gptq import WeightRounding
from lowbit.algorithms.rotate.options import DEFAULT_ROTATION
from lowbit.errors import OptionRef, QuantizationError
from lowbit.schemes import Scheme, get_scheme


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


def quantize_checkpoint(src: str | os.PathLike, out: str | os.PathLike, scheme: str | Scheme = "nvfp4-e5m3",
                        format: str = "lowbit", *, calibration=None, tokenizer=None, smoothquant=DEFAULT,
                        config=None, preset: str | None = None, ignore: Iterable[str] = (),
                        include_lm_head: bool = False, allow_unquantized: bool = False, resume: bool = True,
                        overwrite: bool = False, progress: bool | None = None, device: str | None = None,
                        offload: bool = False, workers: int = 2, run_options=None, group=None,
                        **calibration_options) -> Path:
    """Quantize the checkpoint folder ``src`` into ``out`` and return ``out``.

    calibration, tokenizer, smoothquant, config, preset, calibration_options, allow_unquantized,
        ignore: as for ``lowbit.quantize`` (same defaults). ``tokenizer`` defaults to the source
        folder's. When nothing calibrates (``model_quant.calibrates``: no static activation scales,
        no SmoothQuant, no GPTQ), the run is model-free (``lowbit.modelfree.quantize_checkpoint``,
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
    from lowbit.model_quant import calibrates, calibration_config

    scheme = get_scheme(scheme)
    fmt = Format.parse(format)
    get_layout(fmt).check_scheme(scheme)
    try:
        sq = resolve_alpha(smoothquant, scheme, static_only=False)
    except ValueError as e:
        raise QuantizationError(str(e)) from None
    cfg = calibration_config(config, preset, calibration_options)
    if cfg.rotation is not DEFAULT_ROTATION:
        raise QuantizationError(f"rotation={cfg.rotation.value!r} rewrites the embeddings, every layer and lm_head "
                                f"together, which a run streamed one layer at a time (or model-free) cannot do: "
                                f"quantize in memory (lowbit.quantize, then lowbit.save)")
    if calibration is None or not calibrates(scheme, sq, cfg):
        # model-free: it refuses schemes that need calibration, naming the dynamic alternatives
        # (asked for: without calibration data the 4-bit schemes' default GPTQ is plain RTN)
        if calibration is None and not scheme.needs_calibration and (
                sq is not None or cfg.weight_rounding is WeightRounding.GPTQ):
            raise QuantizationError(f"{scheme.name} with SmoothQuant or GPTQ needs calibration data (pass "
                                    f"{{calibration}})", calibration=OptionRef("calibration", "builtin"))
        from lowbit.modelfree import quantize_checkpoint as model_free

        path = model_free(src, out, scheme, fmt.value, workers=workers, ignore=ignore, include_lm_head=include_lm_head,
                          resume=resume, overwrite=overwrite, progress=progress, device=device,
                          run_options=run_options, group=group)
        return StreamResult(Path(path), {}, peak_rss=peak_rss_bytes())
    if include_lm_head:
        raise QuantizationError("a calibrated output head is not streamed yet: drop {head}, or quantize in memory "
                                "(lowbit.quantize, then lowbit.save)", head=OptionRef("include_lm_head"))
    from lowbit.streamed.run import streamed

    return streamed(Path(src), Path(out), scheme, fmt, sq, cfg, calibration, tokenizer, list(ignore),
                    allow_unquantized, resume, overwrite, progress, device, offload, group)


def fingerprint(src: Path, ckpt, scheme: Scheme, fmt, tokens: torch.Tensor, cfg, smoothquant, ignore: list[str],
                world: int, device) -> str:
    """What decides the output bytes of a streamed run (a resumed run must match it)."""
    h = hashlib.sha256()
    h.update(json.dumps({
        "src": str(src.resolve()), "tensors": sorted((i.name, i.shard, i.dtype, i.shape, i.begin, i.end)
                                                     for i in ckpt.tensors.values()),
        "scheme": repr(scheme), "format": fmt.value, "config": repr(cfg), "smoothquant": repr(smoothquant),
        "ignore": ignore, "world": world, "device": str(device),
    }, sort_keys=True, default=str).encode())
    h.update(tokens.contiguous().numpy().tobytes())
    return h.hexdigest()[:32]

