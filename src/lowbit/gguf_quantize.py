"""``quantize_gguf``: a float Hugging Face folder to one GGUF file for llama.cpp, the type of each
tensor chosen by a llama-quantize mix (or one GGML type for every tensor), weighted by an
importance matrix from calibration text when given.

    from lowbit.formats.gguf import quantize_gguf
    report = quantize_gguf("SmolLM2-135M", "smollm2-Q4_K_M.gguf", "Q4_K_M", calibration="builtin")
    report.types["blk.0.attn_v.weight"]       # 'Q6_K'

Without calibration every weight is llama.cpp's reference rounding (``llama-quantize`` without
``--imatrix``, byte for byte); with it, each linear's mean squared input per column
(``lowbit.calibration.importance``, llama-imatrix's statistic) weights the scale search
(``importance_search``: lowbit's ``direct`` search for Q4_0 / Q5_0 by default, or llama-quantize
``--imatrix``'s), and then GPTQ picks the codes under the scales that search chose
(``lowbit.gguf_gptq``; ``CalibrationConfig(weight_rounding="rtn")``: the search's own codes, with
``importance_search="llama-cpp"`` ``llama-quantize --imatrix``'s bytes given its vectors).
The calibration runs one decoder layer in memory at a time (``lowbit.gguf_streamed``; the same
file as the whole model in memory, byte for byte), so a model larger than memory can be written.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Mapping

import torch
import torch.nn as nn

from lowbit.errors import FormatError
from lowbit.formats import Format, get_format
from lowbit.gguf_spill import Spill
from lowbit.gguf_options import DEFAULT_IMPORTANCE_SEARCH, check_gguf_config, parse_importance_search
from lowbit.numerics.ggml import GgmlType, ImportanceSearch


def _calibrated(src: Path, plan, tokens, config, kinds: Mapping[str, GgmlType], search, spill, checkpoint,
                progress, reports: dict) -> tuple[dict, Mapping]:
    """(HF weight name -> llama-imatrix's statistic [in] of every linear, HF weight name -> (type,
    GPTQ-rounded rows) for the weights of ``kinds``), from the calibration windows ``tokens``: one decoder layer in
    memory at a time (``lowbit.gguf_streamed``, the rows in ``spill``), or, for a model without
    decoder layers to stream, the whole model in memory (``lowbit.gguf_gptq``); experts stored
    fused get theirs stacked per fused tensor (``lowbit.gguf_fused``)."""
    from lowbit.gguf_reconstruct import refuse_reconstruction
    from lowbit.gguf_streamed import streamed_sources

    importance = streamed_sources(src, plan, tokens, config, kinds, search, spill, progress, reports=reports,
                                  checkpoint=checkpoint)
    if importance is not None:
        return importance, spill
    refuse_reconstruction(config, f"{src}: no decoder layers found to stream")
    return _in_memory(src, plan, tokens, config, kinds, search)


def _in_memory(src: Path, plan, tokens, config, kinds: Mapping[str, GgmlType], search) -> tuple[dict, dict]:
    """``_calibrated``'s results with the whole float model in memory (``gguf_gptq.gptq_sources``)."""
    from transformers import AutoModelForCausalLM

    from lowbit.files.folder import SafetensorsFolder
    from lowbit.gguf_fused import fused_parts, stack, with_parts
    from lowbit.gguf_gptq import checkpoint_keys, gptq_options, gptq_sources, source_weights
    from lowbit.linearize import linearize
    from lowbit.models.float_check import check_float_folder
    from lowbit.moe.naming import stored_key
    from lowbit.renames import checkpoint_renames

    check_float_folder(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, use_safetensors=True)
    model.eval()
    folder = SafetensorsFolder(src)
    renames = checkpoint_renames(model, folder)  # before the split: transformers' own model
    linearize(model)  # MoE experts as linears: an importance vector and a Hessian per expert
    keys, model_type = set(folder), getattr(model.config, "model_type", None)
    # experts the checkpoint keeps fused: rounded as the split linears they are in memory, then stacked
    parts = fused_parts(model, [f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Linear)],
                        lambda k: stored_key(model_type, k, keys, renames))
    disk = checkpoint_keys(model, folder, renames)
    importance, encoded = gptq_sources(model, tokens, source_weights(model, folder, plan, parts, disk),
                                       with_parts(kinds, parts), options=gptq_options(config),
                                       batch_size=config.batch_size, disk=disk, search=search)
    stack(plan, parts, importance, encoded)
    return importance, encoded


def quantize_gguf(src: str | os.PathLike, out: str | os.PathLike, scheme: str = "Q4_K_M", *, calibration=None,
                  tokenizer=None, config=None, overrides: Mapping[str, str] | None = None,
                  progress: bool | None = None, overwrite: bool = False,
                  tokenizer_from: str | os.PathLike | None = None,
                  importance_search: ImportanceSearch | str = DEFAULT_IMPORTANCE_SEARCH):
    """Quantize the float checkpoint folder ``src`` into the GGUF file ``out``; returns the
    ``WriteReport`` (path, size, every tensor's type, seconds).

    scheme: a llama-quantize mix (Q8_0, Q6_K, Q5_K_M, Q5_K_S, Q4_K_M, Q4_K_S, Q3_K_L, Q3_K_M, Q3_K_S,
        Q2_K, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4_MOE) or one GGML type for every tensor (q4_k, nvfp4...).
    calibration: text for the importance matrix and GPTQ (as ``lowbit.quantize`` takes it; None:
        llama.cpp's reference rounding, no importance); ``config``: a ``CalibrationConfig`` for its
        windows and ``weight_rounding`` (default GPTQ, ``gguf_options.gguf_rounding``).
    overrides: {regex on GGUF tensor names: GGML type}, llama-quantize's ``--tensor-type``.
    tokenizer_from: a GGUF file whose ``tokenizer.*`` keys the file takes (for a tokenizer the
        converter cannot read from the folder, e.g. one expanded from a published GGUF).
    importance_search: how the importance matrix chooses each block's scale (with calibration):
        ``direct`` (default, ``DEFAULT_IMPORTANCE_SEARCH``: the importance alone weighs the squared
        error, a wider grid for Q4_0 / Q5_0, ``lowbit.numerics.ggml_direct``) or ``llama-cpp``
        (llama-quantize ``--imatrix``'s search, its bytes given the same vectors).
    FormatError naming the file, tensor or option; nothing is left at ``out`` on an error."""
    from lowbit.calibration.config import CalibrationConfig
    from lowbit.formats.gguf.convert import plan_gguf
    from lowbit.files.folder import SafetensorsFolder

    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    fmt = get_format(Format.GGUF)  # the format's rules: types, fallbacks, output, writing
    target = fmt.target(scheme)
    fmt.overrides(overrides)  # a bad pattern before any work
    search = parse_importance_search(importance_search)
    if config is not None:
        if calibration is None:  # llama.cpp's reference rounding reads no calibration option
            raise FormatError("config: calibration options need calibration data (calibration=...); without it "
                              "the file is llama.cpp's reference rounding")
        check_gguf_config(target.value, config)  # options it would not read: refused by name
    fmt.check_output(src, out, overwrite)
    plan = plan_gguf(src, tokenizer_from=tokenizer_from)
    importance, encoded, reports = None, {}, {}
    types = fmt.tensor_types(plan, target, calibration is not None, overrides)
    spill = checkpoint = None
    if calibration is not None:
        from lowbit.calibration import calibration_set
        from lowbit.gguf_spill import Checkpoint, run_key
        from lowbit.streamed.run import tokenizer_for

        config = config or CalibrationConfig()
        tokens = calibration_set(calibration, tokenizer_for(src, calibration, tokenizer), **config.data_options()).ids
        key = run_key(src, target.value, types, config, search, tokens)
        spill = Spill.resumable(out, key)  # a killed run's folder when there is one: resumed
        checkpoint = Checkpoint(spill, key)
    done = False
    try:
        if calibration is not None:
            from lowbit.gguf_gptq import rounded_types

            kinds = rounded_types(plan, types, config)
            importance, encoded = _calibrated(src, plan, tokens, config, kinds, search, spill, checkpoint, progress,
                                              reports)
        folder = SafetensorsFolder(src)
        show = _progress(len(plan.tensors), progress)
        try:
            report = fmt.write(plan, out, folder, target, types, importance=importance, encoded=encoded,
                               progress=show, search=search)
        finally:
            show.close()
        done = True
    finally:
        if spill is not None and (done or not checkpoint.exists()):
            spill.close()
        elif spill is not None:  # stopped after a checkpoint: what a rerun of the same command resumes from
            spill.release()
            if not checkpoint.unreadable:
                import warnings

                warnings.warn(f"{out}: the calibrated layers done so far stay in {spill.folder}; the same "
                              f"command resumes from them (delete that folder to start over)", stacklevel=2)
    report.seconds = time.perf_counter() - t0
    report.reconstructed = reports
    return report


class _progress:
    """A tensor-count progress bar on stderr (default: when stderr is a terminal)."""

    def __init__(self, total: int, enabled: bool | None) -> None:
        import sys

        from tqdm import tqdm

        on = sys.stderr.isatty() if enabled is None else enabled
        self.bar = tqdm(total=total, desc="writing GGUF", unit="tensor", disable=not on)

    def __call__(self, name: str) -> None:
        self.bar.set_postfix_str(name, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
