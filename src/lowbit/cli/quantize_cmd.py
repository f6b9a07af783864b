"""``lowbit quantize MODEL --scheme S``: quantize (calibrated when needed) and save a checkpoint,
or, with ``--model-free``, quantize the safetensors shards directly without building the model."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Optional

import typer

from lowbit.cli.app import app, console, err_console
from lowbit.cli.recipe_options import CANDIDATES_HELP, RECIPE_HELP, TARGET_BITS_HELP, parse_plan, save_used_recipe, used_schemes
from lowbit.cli.common import (
    OptionError, calib_data_options, calibration_arg, check_model_path, human_bytes, model_arg, parse_calib_preset,
    parse_calib_weights, CALIB_COLUMN_HELP, CALIB_HELP, CALIB_PACK_HELP, CALIB_SPLIT_HELP, CALIB_WEIGHTS_HELP,
    CHAT_TEMPLATE_HELP, parse_kv_cache, parse_layer_inputs,
    parse_reconstruct_iters, parse_rotation, reconstruct_batch_size_option, parse_smoothquant, parse_weight_rounding,
    CALIB_PRESET_HELP, GPTQ_ACT_ORDER_HELP, GPTQ_SCALE_SEARCH_HELP, RECONSTRUCT_BATCH_SIZE_HELP, RECONSTRUCT_ITERS_HELP, ROTATION_HELP, WEIGHT_ROUNDING_HELP,
)


def _default_output(model: str | None, scheme: str) -> Path:
    stem = Path(model).resolve().name if model else "SmolLM2-135M-Instruct"
    return Path(f"{stem}-{scheme}")


def _weight_bytes(folder: Path) -> int:
    """Bytes of the weight files (``*.safetensors``), what ``lowbit inspect`` reports as on disk."""
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))


@app.command("quantize")
def quantize_cmd(
    model: str = typer.Argument(..., help="Model folder (Hugging Face layout), or 'builtin'."),
    scheme: Optional[str] = typer.Option(None, "--scheme", "-s", help="Scheme name (see `lowbit schemes`); or "
                                         "--recipe, or --target-bits."),
    recipe: Optional[str] = typer.Option(None, "--recipe", help=RECIPE_HELP),
    target_bits: Optional[str] = typer.Option(None, "--target-bits", help=TARGET_BITS_HELP),
    candidates: Optional[str] = typer.Option(None, "--candidates", help=CANDIDATES_HELP),
    fmt: str = typer.Option("lowbit", "--format", "-f", help="Checkpoint format: lowbit, fake, compressed-tensors."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="Output folder (default: MODEL-SCHEME)."),
    calib: Optional[list[str]] = typer.Option(None, "--calib", help=CALIB_HELP),
    calib_weights: Optional[str] = typer.Option(None, "--calib-weights", help=CALIB_WEIGHTS_HELP),
    calib_column: Optional[str] = typer.Option(None, "--calib-column", help=CALIB_COLUMN_HELP),
    calib_split: Optional[str] = typer.Option(None, "--calib-split", help=CALIB_SPLIT_HELP),
    chat_template: Optional[str] = typer.Option(None, "--chat-template", help=CHAT_TEMPLATE_HELP),
    calib_pack: Optional[bool] = typer.Option(None, "--calib-pack/--no-calib-pack", help=CALIB_PACK_HELP),
    calib_samples: Optional[int] = typer.Option(None, "--calib-samples", help="Calibration windows (default 16, as lowbit.quantize and lowbit compare)."),
    calib_seq_len: Optional[int] = typer.Option(None, "--calib-seq-len", help="Tokens per calibration window (default 512, as lowbit.quantize and lowbit compare)."),
    smoothquant: str = typer.Option(
        "default", "--smoothquant",
        help="SmoothQuant alpha in [0, 1], 'auto' (per-layer search), 'none', or 'default': 0.8 for schemes with "
             "static per-tensor INT8 inputs (w8a8-int8), 0.5 for FP8 ones (w8a8-fp8), none for the others."),
    weight_rounding: Optional[str] = typer.Option(
        None, "--weight-rounding",
        help=WEIGHT_ROUNDING_HELP),
    layer_inputs: Optional[str] = typer.Option(
        None, "--layer-inputs",
        help="What each layer is calibrated on: 'quantized' (the quantized layers' outputs; default with GPTQ) or "
             "'float' (the float model's activations: one float pass per layer, about half the calibration "
             "time; default with RTN weights)."),
    calib_preset: Optional[str] = typer.Option(
        None, "--calib-preset",
        help=CALIB_PRESET_HELP),
    reconstruct_iters: Optional[int] = typer.Option(
        None, "--reconstruct-iters",
        help=RECONSTRUCT_ITERS_HELP),
    reconstruct_batch_size: Optional[int] = typer.Option(
        None, "--reconstruct-batch-size", help=RECONSTRUCT_BATCH_SIZE_HELP),
    gptq_act_order: bool = typer.Option(False, "--gptq-act-order", help=GPTQ_ACT_ORDER_HELP),
    gptq_scale_search: Optional[bool] = typer.Option(None, "--gptq-scale-search/--no-gptq-scale-search",
                                                     help=GPTQ_SCALE_SEARCH_HELP),
    rotation: Optional[str] = typer.Option(None, "--rotation", help=ROTATION_HELP),
    kv_cache: Optional[str] = typer.Option(
        None, "--kv-cache",
        help="'fp8': a calibrated FP8 (E4M3) KV cache as vLLM runs it (k_scale/v_scale per attention layer, "
             "from the calibration text; default: none, K and V in float)."),
    model_free: bool = typer.Option(False, "--model-free", help="Quantize shards directly (no calibration, no forward)."),
    workers: int = typer.Option(1, "--workers", help="CPU cores for --model-free (worker processes or threads)."),
    device: Optional[str] = typer.Option(None, "--device", help="Quantize on this torch device (cuda, cuda:N; default: "
                                         "the CPU): model-free (bit-identical output) or streamed calibration."),
    in_memory: bool = typer.Option(
        False, "--in-memory",
        help="Load the whole model before calibrating (default: stream it from the folder one decoder layer at a "
             "time, bit-identical output, memory bounded by one layer; --kv-cache always loads it whole)."),
    offload_activations: bool = typer.Option(
        False, "--offload-activations", help="Streamed with --device: keep calibration activations in CPU memory."),
    ignore: Optional[list[str]] = typer.Option(None, "--ignore", help="Layer name or regex to keep in float (repeatable)."),
    allow_unquantized: bool = typer.Option(
        False, "--allow-unquantized",
        help="Keep weight matrices lowbit cannot quantize (fused MoE experts, non-Linear projections) in float "
             "with a warning instead of refusing the model."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the output folder if it exists."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary."),
) -> None:
    """Quantize MODEL with a scheme (or a recipe: a scheme per group of layers) and write a checkpoint folder."""
    kv = parse_kv_cache(kv_cache)
    weights = parse_calib_weights(calib, calib_weights)
    data_opts = calib_data_options(calib_pack, chat_template, calib_column, calib_split)
    if device is not None and not model_free and (in_memory or kv is not None):
        raise OptionError("--device applies to model-free and streamed quantization: drop --in-memory/--kv-cache or "
                          "drop --device")
    if offload_activations and (model_free or in_memory):
        raise OptionError("--offload-activations applies to streamed calibration: drop --model-free/--in-memory")
    check_model_path(model)
    import lowbit
    from lowbit.algorithms.smoothquant.defaults import DEFAULT, scheme_alphas

    plan = parse_plan(scheme, recipe, target_bits, candidates)
    sch = plan.scheme  # None for a recipe
    src = model_arg(model)
    out = Path(output) if output else _default_output(src, plan.label)
    sq_choice = parse_smoothquant(smoothquant)
    alphas = scheme_alphas(sq_choice, plan.schemes)
    sq = alphas[sch] if sch is not None else {s.name: a for s, a in alphas.items()}
    wr = parse_weight_rounding(weight_rounding)
    reconstruct_iters = parse_reconstruct_iters(reconstruct_iters)
    recon_batch = reconstruct_batch_size_option(reconstruct_batch_size)
    li = parse_layer_inputs(layer_inputs)
    preset = parse_calib_preset(calib_preset)
    rot = parse_rotation(rotation)
    t0 = time.perf_counter()
    if model_free:
        if rot is not None:
            raise OptionError("--model-free cannot rotate: a fused rotation rewrites the embeddings, every layer and "
                              "lm_head together on the loaded model; drop --rotation or drop --model-free")
        if calib or data_opts or sq_choice != DEFAULT or wr is not None or li is not None or preset is not None \
                or kv is not None or reconstruct_iters or recon_batch or gptq_act_order or gptq_scale_search is not None:
            raise OptionError("--model-free takes no calibration: drop --calib/--calib-weights/--calib-column/"
                              "--calib-split/--chat-template/--calib-pack/--smoothquant/--weight-rounding/"
                              "--layer-inputs/--calib-preset/--kv-cache/--reconstruct-iters/--reconstruct-batch-size/"
                              "--gptq-act-order/"
                              "--gptq-scale-search, or drop --model-free")
        if plan.target_bits is not None:
            raise OptionError("--target-bits measures layers on a forward and backward of the model: drop "
                              "--model-free or give --scheme/--recipe")
        from lowbit.models import resolve_model_path

        folder = resolve_model_path(src)
        _check_output(folder, out, overwrite)
        ranks = _model_free(folder, out, sch.name if sch is not None else plan.recipe, fmt, workers, ignore,
                            overwrite, device)
        if ranks is None:
            return  # not rank 0 of a torchrun job: rank 0 prints the summary
        extra = {"ranks": ranks}
    else:
        from lowbit.files.outlock import output_lock
        from lowbit.models import resolve_model_path

        folder = resolve_model_path(src)
        _check_output(folder, out, overwrite)
        cfg = _config(calib_samples, calib_seq_len, wr, li, preset, reconstruct_iters, rot, gptq_act_order,
                      gptq_scale_search, {**recon_batch, **data_opts})
        calib = calibration_arg(calib, weights)
        from lowbit.model_quant import calibrates  # noqa: E402 (torch is imported from here on)

        needs = any(calibrates(s, alphas[s], cfg) for s in plan.schemes)
        # a rotation rewrites the embeddings, every layer and lm_head together, and the automatic
        # choice runs the whole model forward and backward: the whole model is loaded
        stream = not in_memory and kv is None and rot is None and needs and plan.target_bits is None
        if (device is not None or offload_activations) and rot is not None:
            raise OptionError("--rotation loads the whole model in memory on the CPU: drop --device/"
                              "--offload-activations or drop --rotation")
        if (device is not None or offload_activations) and not stream:
            raise OptionError(f"--device/--offload-activations apply to model-free and streamed quantization, and "
                              f"{plan.label} {'with --target-bits' if plan.target_bits is not None else 'without calibration options'} "
                              f"is neither: " + ("drop --device/--offload-activations" if plan.target_bits is not None
                                                 else "add --model-free"))
        if stream:
            extra = _streamed(folder, out, plan.given, fmt, calib, sq_choice, cfg, ignore, overwrite,
                              allow_unquantized, device, offload_activations)
            if extra is None:
                return  # not the first rank of a torchrun job: rank 0 reports
        else:
            with output_lock(out):  # held from loading to the rename: a second run into `out` is refused now
                extra = _calibrated(lowbit, folder, out, plan, fmt, calib, cfg, sq_choice, sq, ignore, overwrite,
                                    t0, allow_unquantized, kv)
    chosen = extra.pop("chosen_recipe", None)
    if plan.recipe is not None or chosen is not None:
        extra["recipe"] = str(save_used_recipe(out, chosen or plan.recipe))
    summary = {"output": str(out), "scheme": plan.label, "format": fmt, "model_free": model_free,
               "seconds": time.perf_counter() - t0, "size_bytes": _weight_bytes(out), **extra}
    from lowbit.formats.base import Format

    verdicts = []
    if fmt == Format.COMPRESSED_TENSORS.value:  # the written folder: what engines serve it (measured)
        from lowbit.formats.ct_serving import engine_support

        for s in used_schemes(plan, chosen):
            verdicts += [v for v in engine_support(out, s) if v.line() not in {w.line() for w in verdicts}]
        summary["serving"] = [{"engine": v.engine, "serving": v.serving.value, "detail": v.detail} for v in verdicts]
    if as_json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        q = summary.get("quantized")
        if q is not None:
            kept = f"; kept in float: {len(q['unquantized_targets'])} weight matrices lowbit cannot quantize" \
                if q["unquantized_targets"] else ""
            kept += "".join(f"; {kind} x{n}" for kind, n in q.get("float_weights", {}).items())
            moe = f", {q['expert_linears']} of them in {q['experts']} experts of {q['moe_blocks']} MoE blocks" \
                if q["moe_blocks"] else ""
            spread = q["expert_input_scale_spread"]
            if spread:
                moe += "; per-expert input scales, max/min: " + ", ".join(f"{k} x{v:.2f}" for k, v in spread.items())
            console.print(f"quantized {q['linears']} linears{moe} ({q['weight_parameters'] / 1e6:.1f}M weights; "
                          f"{q['float_parameters'] / 1e6:.1f}M parameters stay float: embeddings, norms, routers"
                          f"{kept})", highlight=False)
        if summary.get("calibration"):
            from lowbit.report.calibration import describe_calibration

            console.print(describe_calibration(summary["calibration"]), highlight=False)
        if summary.get("smoothing"):
            from lowbit.report.smoothing import describe_smoothing

            console.print(describe_smoothing(summary["smoothing"]), highlight=False)
        if q is not None and q.get("rotation"):
            console.print(q["rotation"], highlight=False)
        if summary.get("kv_cache"):
            ks = summary["kv_scales"] or {}
            console.print(f"KV cache {summary['kv_cache']}: k_scale/v_scale on {len(ks)} attention layers",
                          highlight=False)
        ranks = f" on {summary['ranks']} ranks" if (summary.get("ranks") or 1) > 1 else ""
        streamed = f"; streamed, peak RSS {human_bytes(summary['peak_rss'])}" + (" (rank 0)" if ranks else "") \
            if summary.get("streamed") else ""
        if summary.get("auto_recipe"):
            a = summary["auto_recipe"]
            console.print(f"chose a scheme per layer for {a['target_bits']:g} average weight bits: "
                          f"{a['average_bits']:.3f} reached, {a['counts']} (predicted loss +{a['predicted_loss']:.3g} nats; "
                          f"measured on {len(a['windows'])} of {a['calibration']['samples']} calibration windows in "
                          f"{a['seconds']:.1f} s)", highlight=False)
        if q is not None and q.get("schemes") and len(q["schemes"]) > 1:
            console.print("linears per scheme: " + ", ".join(f"{k} {v}" for k, v in q["schemes"].items()) +
                          f"; {q['average_bits']:.3f} average weight bits", highlight=False)
        if summary.get("recipe"):
            console.print(f"recipe used: {summary['recipe']} (reusable with --recipe)", highlight=False)
        console.print(f"wrote {out} ({plan.label}, {fmt}, weights {human_bytes(summary['size_bytes'])} on disk) "
                      f"in {summary['seconds']:.1f} s{ranks}{streamed}", highlight=False)
        for v in verdicts:
            console.print(f"serving, {v.line()}", highlight=False)


def _model_free(folder: Path, out: Path, scheme: str, fmt: str, workers: int, ignore: list[str] | None,
                overwrite: bool, device: str | None) -> int | None:
    """Model-free quantization, split over the ranks when started by torchrun (lowbit.dist.Group:
    gloo on the CPU, NCCL with a CUDA --device). Returns the number of ranks on rank 0, None on
    the others (which print nothing; every rank exits 0 once the output is complete)."""
    from lowbit.dist import Group
    from lowbit.modelfree import quantize_checkpoint
    from lowbit.modelfree.device import resolve_device

    group = Group.join(resolve_device(device))
    try:
        quantize_checkpoint(folder, out, scheme=scheme, format=fmt, workers=workers, ignore=list(ignore or ()),
                            overwrite=overwrite, progress=group.is_main, device=device, group=group)
    finally:
        if group.distributed:
            import torch.distributed as dist

            dist.destroy_process_group()
    return group.world if group.is_main else None


def _check_output(folder: Path, out: Path, overwrite: bool) -> None:
    """Before any work: the output is not the source, and is new, empty or replaced on purpose."""
    from lowbit.files.outguard import check_not_source
    from lowbit.files.writer import check_output_free

    check_not_source(folder, out)
    check_output_free(out, overwrite)


def _config(calib_samples, calib_seq_len, wr, li, preset, reconstruct_iters=None, rotation=None, act_order=False,
            scale_search=None, more=None):
    """The CalibrationConfig of the calibration options given (the others: its defaults; ``more``:
    further fields as given)."""
    from lowbit.calibration import CalibrationConfig

    kwargs = {} if rotation is None else {"rotation": rotation}
    kwargs.update(more or {})
    if act_order:
        kwargs["gptq_act_order"] = True
    if scale_search is not None:
        kwargs["gptq_scale_search"] = scale_search
    if calib_samples is not None:
        kwargs["num_samples"] = calib_samples
    if calib_seq_len is not None:
        kwargs["seq_len"] = calib_seq_len
    if wr is not None:
        kwargs["weight_rounding"] = wr
    if li is not None:
        kwargs["layer_inputs"] = li
    if reconstruct_iters is not None:
        kwargs["reconstruct_iters"] = reconstruct_iters
    return CalibrationConfig.preset(preset, **kwargs) if preset is not None else CalibrationConfig(**kwargs)


def _calib_desc(calib) -> str:
    """The calibration source(s) as the progress line names them."""
    if calib is None:
        return "the built-in text"
    if isinstance(calib, list):
        return ", ".join(f"{s.data} (weight {s.weight:g})" for s in calib)
    return str(calib)


def _streamed(folder, out, sch, fmt, calib, sq_choice, cfg, ignore, overwrite, allow_unquantized, device,
              offload) -> dict | None:
    """Calibrate and quantize ``folder`` streamed (lowbit.streamed); None on ranks other than 0."""
    from lowbit.report.smoothing import smoothing_summary
    from lowbit.streamed import run_streamed

    err_console.print(f"[dim]calibrating on {_calib_desc(calib)} (streamed)[/dim]", highlight=False)
    from lowbit.dist import Group
    from lowbit.modelfree.device import resolve_device
    from lowbit.streamed.stream import release_freed_blocks

    release_freed_blocks()  # this process quantizes one layer after another: freed layers go back at once
    group = Group.join(resolve_device(device))
    try:
        res = run_streamed(folder, out, sch, fmt, calibration=calib or "builtin", smoothquant=sq_choice, config=cfg,
                           ignore=list(ignore or ()), allow_unquantized=allow_unquantized, overwrite=overwrite,
                           progress=None if group.is_main else False, device=device, offload=offload)
    finally:
        if group.distributed:
            import torch.distributed as dist

            dist.destroy_process_group()
    if not group.is_main:
        return None
    return {"quantized": res.summary, "smoothquant": res.report.smoothquant, "kv_cache": None, "kv_scales": None,
            "streamed": True, "ranks": res.ranks, "peak_rss": res.peak_rss, "calibration": res.report.data,
            "smoothing": smoothing_summary(res.report), "layer_seconds": [round(x, 3) for x in res.layer_seconds]}


def _calibrated(lowbit, folder, out, plan, fmt, calib, cfg, sq_choice, sq, ignore, overwrite, t0, allow_unquantized,
                kv=None) -> dict:
    """Load ``folder``, quantize it (calibrated when the options ask for it: ``model_quant.calibrates``,
    or for the KV-cache scales of ``kv``; with ``plan.target_bits`` after choosing the recipe on
    the loaded model) and save it to ``out``."""
    from lowbit.model_quant import calibrates
    from lowbit.models import load_model
    from lowbit.report.quantized import quantized_summary
    from lowbit.report.smoothing import smoothing_summary
    from lowbit.algorithms.smoothquant.defaults import resolve_alpha

    qmodel, tok = load_model(folder)
    given, extra = plan.given, {}
    if plan.target_bits is not None:
        err_console.print(f"[dim]measuring each layer's sensitivity to {', '.join(s.name for s in plan.candidates)} "
                          f"on {_calib_desc(calib)}[/dim]", highlight=False)
        # measured on the windows the quantization below calibrates on (the same options)
        auto = lowbit.auto_recipe(qmodel, plan.candidates, plan.target_bits, calib or "builtin", tokenizer=tok,
                                  ignore=list(ignore or ()), config=cfg)
        given = extra["chosen_recipe"] = auto.recipe
        extra["auto_recipe"] = {"target_bits": auto.target_bits, "average_bits": auto.average_bits,
                                "counts": auto.counts(), "predicted_loss": auto.predicted_loss,
                                "seconds": auto.seconds, "windows": auto.windows, "calibration": auto.calibration}
    schemes = plan.schemes if plan.target_bits is None else list(given.schemes)
    needs = any(calibrates(s, resolve_alpha(sq_choice, s), cfg) for s in schemes) or kv is not None
    if not needs and (calib is not None or dataclasses.replace(cfg, rotation=type(cfg)().rotation) != type(cfg)()):
        err_console.print(f"[yellow]note:[/yellow] {plan.label} needs no calibration; --calib options ignored")
    if needs:
        err_console.print(f"[dim]calibrating on {_calib_desc(calib)}[/dim]", highlight=False)
        qmodel = lowbit.quantize(qmodel, given, calibration=calib or "builtin", tokenizer=tok, smoothquant=sq_choice,
                                 ignore=list(ignore or ()), config=cfg, allow_unquantized=allow_unquantized,
                                 kv_cache=kv)
    else:
        qmodel = lowbit.quantize(qmodel, given, smoothquant=sq_choice, ignore=list(ignore or ()),
                                 allow_unquantized=allow_unquantized, rotation=cfg.rotation)
    t_quant = time.perf_counter() - t0
    lowbit.save(qmodel, out, format=fmt, tokenizer=tok, source_dir=folder, overwrite=overwrite)
    report = getattr(qmodel, "lowbit_calibration", None)
    return {"quant_seconds": t_quant, "smoothquant": sq, "quantized": quantized_summary(qmodel), "kv_cache": kv,
            "kv_scales": getattr(qmodel, "lowbit_kv_calibration", None),
            "calibration": report.data if report is not None else None,
            "smoothing": smoothing_summary(report), **extra}
