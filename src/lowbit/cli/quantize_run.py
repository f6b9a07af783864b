"""``lowbit quantize``'s run: the plan's path (model-free, streamed, in memory) executed, and the
facts of the run (what was quantized, calibrated, smoothed; time, memory, ranks) returned as
the summary the command prints. Only rank 0 of a torchrun job returns a summary."""

from __future__ import annotations

import time

from lowbit.cli.app import err_console
from lowbit.cli.quantize_plan import QuantizePlan, RunPath


def _weight_bytes(output) -> int:
    """Bytes of the weight files (``*.safetensors``), what ``lowbit inspect`` reports as on disk;
    a GGUF output's whole file."""
    from pathlib import Path

    if Path(output).is_file():
        return Path(output).stat().st_size
    return sum(p.stat().st_size for p in Path(output).glob("*.safetensors"))


def _calib_desc(calib) -> str:
    """The calibration source(s) as the progress line names them."""
    if calib is None:
        return "the built-in text"
    if isinstance(calib, list):
        return ", ".join(f"{s.data} (weight {s.weight:g})" for s in calib)
    return str(calib)


def _joined(device):
    """The torchrun group of this process (one rank without torchrun), on ``device``."""
    from lowbit.dist import Group
    from lowbit.modelfree.device import resolve_device

    return Group.join(resolve_device(device))


def _leave(group) -> None:
    if group.distributed:
        import torch.distributed as dist

        dist.destroy_process_group()


def _checkpoint(plan: QuantizePlan, group):
    """The model-free or streamed run of ``plan`` on ``group``'s ranks: the API's own plan
    (``lowbit.streamed.checkpoint_plan_of`` around the plan's Method) and run (``run_checkpoint``)."""
    from lowbit.streamed import RunSettings, TargetChoice, checkpoint_plan_of, run_checkpoint

    settings = RunSettings(overwrite=plan.overwrite, workers=plan.workers, device=plan.device,
                           offload=plan.offload_activations, group=group,
                           progress=group.is_main if plan.path is RunPath.MODEL_FREE else
                           (None if group.is_main else False))
    targets = TargetChoice(ignore=plan.ignore, allow_unquantized=plan.allow_unquantized)
    return run_checkpoint(checkpoint_plan_of(plan.method, plan.source, plan.output, plan.checkpoint_format, targets,
                                             settings))


def _model_free(plan: QuantizePlan) -> dict | None:
    """Model-free quantization, split over the ranks when started by torchrun (lowbit.dist.Group:
    gloo on the CPU, NCCL with a CUDA device)."""
    group = _joined(plan.device)
    try:
        _checkpoint(plan, group)
    finally:
        _leave(group)
    return {"ranks": group.world} if group.is_main else None


def _streamed(plan: QuantizePlan) -> dict | None:
    """Calibrate and quantize the folder streamed (lowbit.streamed)."""
    from lowbit.report.smoothing import smoothing_summary
    from lowbit.streamed.stream import release_freed_blocks

    err_console.print(f"[dim]calibrating on {_calib_desc(plan.calibration)} (streamed)[/dim]", highlight=False)
    release_freed_blocks()  # this process quantizes one layer after another: freed layers go back at once
    group = _joined(plan.device)
    try:
        res = _checkpoint(plan, group)
    finally:
        _leave(group)
    if not group.is_main:
        return None
    return {"quantized": res.summary, "smoothquant": res.report.smoothquant, "kv_cache": None, "kv_scales": None,
            "streamed": True, "ranks": res.ranks, "peak_rss": res.peak_rss, "calibration": res.report.data,
            "smoothing": smoothing_summary(res.report), "layer_seconds": [round(x, 3) for x in res.layer_seconds]}


def _chosen(plan: QuantizePlan, model, tok) -> tuple[object, dict]:
    """The recipe ``lowbit.auto_recipe`` chooses for ``plan``'s budget, and its summary fields."""
    import lowbit

    a = plan.assignment
    err_console.print(f"[dim]measuring each layer's sensitivity to {', '.join(s.name for s in a.candidates)} "
                      f"on {_calib_desc(plan.calibration)}[/dim]", highlight=False)
    # measured on the windows the quantization calibrates on (the same options)
    auto = lowbit.auto_recipe(model, a.candidates, a.target_bits, plan.calibration or "builtin", tokenizer=tok,
                              ignore=list(plan.ignore), config=plan.config)
    return auto.recipe, {"chosen_recipe": auto.recipe, "auto_recipe": {
        "target_bits": auto.target_bits, "average_bits": auto.average_bits, "counts": auto.counts(),
        "predicted_loss": auto.predicted_loss, "seconds": auto.seconds, "windows": auto.windows,
        "calibration": auto.calibration}}


def _smoothquant_report(assignment, method):
    """The alpha of a one-scheme run (``--scheme``), or {scheme name: alpha} of a recipe (the
    summary's field)."""
    if assignment.scheme is not None:
        return method.alphas[assignment.scheme]
    return {s.name: a for s, a in method.alphas.items()}


def _in_memory(plan: QuantizePlan, t0: float) -> dict:
    """Load the folder, quantize it under the plan's Method (calibrated when it says so:
    ``Method.calibrates``, or for the KV-cache scales; with a budget the Method is resolved after
    choosing the recipe on the loaded model) and save."""
    import dataclasses

    import lowbit
    from lowbit.files.outlock import output_lock
    from lowbit.method import CalibrationChoice, TargetChoice, resolve_method
    from lowbit.model_quant import InMemoryPlan, run_in_memory
    from lowbit.models import load_model
    from lowbit.report.quantized import quantized_summary
    from lowbit.report.smoothing import smoothing_summary

    with output_lock(plan.output):  # held from loading to the rename: a second run into the output is refused now
        qmodel, tok = load_model(plan.source)
        method, extra, kv = plan.method, {}, plan.kv_cache
        if plan.assignment.target_bits is not None:
            given, extra = _chosen(plan, qmodel, tok)
            method = resolve_method(given, CalibrationChoice(plan.calibration or "builtin", smoothquant=plan.smoothquant,
                                                             config=plan.config))
        method = dataclasses.replace(method, calibration=dataclasses.replace(method.calibration, tokenizer=tok))
        needs = method.calibrates(method.schemes) or kv is not None
        if not needs and plan.calibration_options_given:
            err_console.print(f"[yellow]note:[/yellow] {plan.assignment.label} needs no calibration; --calib options "
                              "ignored")
        if needs:
            err_console.print(f"[dim]calibrating on {_calib_desc(plan.calibration)}[/dim]", highlight=False)
        targets = TargetChoice(ignore=plan.ignore, allow_unquantized=plan.allow_unquantized)
        qmodel = run_in_memory(qmodel, InMemoryPlan(method, targets, kv))
        t_quant = time.perf_counter() - t0
        lowbit.save(qmodel, plan.output, format=plan.checkpoint_format, tokenizer=tok, source_dir=plan.source,
                    overwrite=plan.overwrite)
    report = getattr(qmodel, "lowbit_calibration", None)
    return {"quant_seconds": t_quant, "smoothquant": _smoothquant_report(plan.assignment, method), "quantized": quantized_summary(qmodel),
            "kv_cache": kv, "kv_scales": getattr(qmodel, "lowbit_kv_calibration", None),
            "calibration": report.data if report is not None else None, "smoothing": smoothing_summary(report),
            **extra}


def run_plan(plan: QuantizePlan) -> tuple[dict, object] | None:
    """Execute ``plan``; on rank 0 the summary and the recipe the automatic choice made (None
    without one), None on the other ranks of a torchrun job."""
    from lowbit.cli.recipe_options import save_used_recipe

    t0 = time.perf_counter()
    from lowbit.cli.quantize_gguf import run_gguf

    run = {RunPath.MODEL_FREE: _model_free, RunPath.STREAMED: _streamed, RunPath.GGUF: run_gguf}.get(plan.path)
    extra = run(plan) if run is not None else _in_memory(plan, t0)
    if extra is None:
        return None  # not rank 0 of a torchrun job: rank 0 reports
    chosen = extra.pop("chosen_recipe", None)
    if plan.assignment.recipe is not None or chosen is not None:
        extra["recipe"] = str(save_used_recipe(plan.output, chosen or plan.assignment.recipe))
    summary = {"output": str(plan.output), "scheme": plan.assignment.label, "format": plan.checkpoint_format,
               "model_free": plan.path is RunPath.MODEL_FREE, "seconds": time.perf_counter() - t0,
               "size_bytes": _weight_bytes(plan.output), **extra}
    return summary, chosen
