"""``lowbit quantize --format gguf``: its options resolved (``gguf_plan``) and its run (``run_gguf``).

``--scheme`` names a llama-quantize mix (Q4_K_M ...) or one GGML type for every tensor (q4_k ...);
the importance matrix comes from the calibration text (default: the built-in text, as every
calibrated lowbit scheme) and GPTQ picks the codes under its scales (``--weight-rounding rtn``: the
search's own codes); ``--model-free`` writes llama.cpp's reference rounding without either.
"""

from __future__ import annotations

from pathlib import Path

from lowbit.cli.common import (OptionError, calibration_arg, check_model_path, model_arg, parse_calib_weights,
                               parse_reconstruct_iters, parse_weight_rounding, reconstruct_batch_size_option)
from lowbit.cli.recipe_options import SchemePlan
from lowbit.run_path import RunPath

#: the calibration options an importance matrix, GPTQ and the reconstruction use; every other one is refused
_ALLOWED = ("calib", "calib_weights", "calib_column", "calib_split", "chat_template", "calib_pack", "calib_samples",
            "calib_seq_len", "weight_rounding", "importance_search", "reconstruct_iters", "reconstruct_batch_size")
_REFUSED = {"recipe": "--recipe", "target_bits": "--target-bits", "candidates": "--candidates",
            "layer_inputs": "--layer-inputs", "calib_preset": "--calib-preset",
            "gptq_scale_search": "--gptq-scale-search", "rotation": "--rotation", "kv_cache": "--kv-cache",
            "device": "--device", "ignore": "--ignore"}
_REFUSED_FLAGS = {"gptq_act_order": "--gptq-act-order", "in_memory": "--in-memory",
                  "offload_activations": "--offload-activations", "allow_unquantized": "--allow-unquantized"}


def gguf_plan(o, plan_cls):
    """The QuantizePlan (``plan_cls``) of ``lowbit quantize --format gguf`` options ``o``."""
    given = [flag for key, flag in _REFUSED.items() if getattr(o, key) is not None]
    given += [flag for key, flag in _REFUSED_FLAGS.items() if getattr(o, key)]
    if o.smoothquant != "default":
        given.append("--smoothquant")
    if given:
        raise OptionError(f"--format gguf takes --scheme (a llama.cpp mix or GGML type) and the calibration text "
                          f"options; drop {', '.join(given)}")
    if o.scheme is None:
        raise OptionError("--format gguf needs --scheme: a llama.cpp mix (e.g. Q4_K_M) or a GGML type (e.g. q4_k)")
    if o.model_free and any(getattr(o, k) is not None for k in _ALLOWED):
        raise OptionError("--model-free writes llama.cpp's reference rounding without an importance matrix: drop "
                          "the --calib options, or drop --model-free")
    check_model_path(o.model)
    from lowbit.calibration import CalibrationConfig
    from lowbit.cli.common import calib_data_options
    from lowbit.errors import FormatError
    from lowbit.formats import Format, get_format
    from lowbit.models import resolve_model_path

    fmt = get_format(Format.GGUF)
    try:
        target = fmt.target(o.scheme)
    except FormatError as e:
        raise OptionError(f"--scheme {o.scheme}: {e}") from None
    label = target.value  # a mix in capitals (Q4_K_M), a GGML type in lower case (q4_k)
    src = model_arg(o.model)
    folder = resolve_model_path(src)
    stem = Path(src).resolve().name if src else "SmolLM2-135M-Instruct"
    out = Path(o.output) if o.output else Path(f"{stem}-{label}.gguf")
    fmt.check_output(folder, out, o.overwrite)  # the API's own check, before any work
    weights = parse_calib_weights(o.calib, o.calib_weights)
    data = calib_data_options(o.calib_pack, o.chat_template, o.calib_column, o.calib_split)
    given = {k: v for k, v in (("num_samples", o.calib_samples), ("seq_len", o.calib_seq_len),
                               ("reconstruct_iters", parse_reconstruct_iters(o.reconstruct_iters))) if v is not None}
    config = CalibrationConfig(**given, **data, **reconstruct_batch_size_option(o.reconstruct_batch_size),
                               weight_rounding=parse_weight_rounding(o.weight_rounding))
    calibration = None if o.model_free else (calibration_arg(o.calib, weights) or "builtin")
    from lowbit.gguf_options import DEFAULT_IMPORTANCE_SEARCH, parse_importance_search

    try:
        search = parse_importance_search(o.importance_search or DEFAULT_IMPORTANCE_SEARCH)
    except FormatError as e:
        raise OptionError(f"--importance-search: {e}") from None
    return plan_cls(source=folder, output=out, assignment=SchemePlan(label=label), checkpoint_format="gguf",
                    path=RunPath.GGUF, calibration=calibration, config=config, smoothquant=None, method=None,
                    kv_cache=None, ignore=(), allow_unquantized=False, overwrite=o.overwrite, workers=o.workers,
                    device=None, offload_activations=False, as_json=o.as_json, importance_search=search)


def run_gguf(plan) -> dict:
    """Write the GGUF file of ``plan``; the summary's fields (types per tensor count, the
    importance matrix's source)."""
    from lowbit.cli.app import err_console
    from lowbit.gguf_quantize import quantize_gguf

    if plan.calibration is not None:
        from lowbit.gguf_options import gguf_rounding

        text = plan.calibration if plan.calibration != "builtin" else "the built-in text"
        err_console.print(f"[dim]importance matrix ({plan.importance_search.value} search) and "
                          f"{gguf_rounding(plan.config).value} rounding from {text}[/dim]",
                          highlight=False)
    report = quantize_gguf(plan.source, plan.output, plan.assignment.label, calibration=plan.calibration,
                           config=plan.config if plan.calibration is not None else None, overwrite=plan.overwrite, importance_search=plan.importance_search)
    rec = report.reconstructed
    if rec:
        changed, weights = sum(r["changed"] for r in rec.values()), sum(r["weights"] for r in rec.values())
        err_console.print(f"[dim]block reconstruction: {len(rec)} decoder layers, {changed} of {weights} codes "
                          f"changed[/dim]", highlight=False)
    return {"gguf": {"types": report.types, "counts": report.counts(),
                     "importance": plan.calibration is not None, "gptq": report.from_encoded,
                     "reconstructed": rec}}
