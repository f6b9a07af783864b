"""``lowbit compare [MODEL] --schemes ...``: every scheme against float, table + report files."""

from __future__ import annotations

from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from lowbit.cli.app import app, console, err_console
from lowbit.cli.figures import accuracy_cell, bracket, plus_minus
from lowbit.cli.recipe_options import CANDIDATES_HELP, RECIPE_HELP, parse_budgets, recipe_file
from lowbit.cli.common import (
    OptionError, calib_data_options, calibration_arg, check_model_path, human_bytes, model_arg, parse_calib_preset,
    parse_calib_weights, CALIB_COLUMN_HELP, CALIB_HELP, CALIB_PACK_HELP, CALIB_SPLIT_HELP, CALIB_WEIGHTS_HELP,
    CHAT_TEMPLATE_HELP, parse_kv_cache, parse_list,
    parse_reconstruct_iters, parse_rotation, reconstruct_batch_size_option, parse_smoothquant, parse_weight_rounding, quiet_progress,
    WEIGHT_ROUNDING_HELP,
    CALIB_PRESET_HELP, GPTQ_ACT_ORDER_HELP, GPTQ_SCALE_SEARCH_HELP, RECONSTRUCT_BATCH_SIZE_HELP, RECONSTRUCT_ITERS_HELP, ROTATION_HELP,
)


def short_layer(name: str) -> str:
    """'model.layers.11.mlp.down_proj' -> 'L11 mlp.down_proj' (tables stay narrow)."""
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p.isdigit() and i > 0 and parts[i - 1] in ("layers", "h", "blocks", "layer"):
            return f"L{p} " + ".".join(parts[i + 1:])
    return name


def accuracy_table(report: dict) -> Table:
    """Each row against float on the same tokens: perplexity, its paired change, KL divergence,
    same top token, last word, each with its 95% interval; float-rounding spread; rows within noise."""
    from lowbit.report.compare import row_label

    base = report["float"]
    lw = "lastword_interval" in base
    failed: list[str] = []
    t = Table(title=f"lowbit compare: {report['model']['path']}  ({base['tokens_scored']} tokens"
                    + (f", {base['lastword_examples']} last-word examples)" if lw else ")"))
    cols = ["scheme", "perplexity", "Δ ppl [95% CI]", "KLD ±95%", "KLD p99", "same top ±95%"]
    cols += ["last word [95% CI]"] * lw + ["fp spread", "within noise of"]
    for col in cols:
        t.add_column(col, justify="left" if col in ("scheme", "within noise of") else "right", no_wrap=True)
    t.add_row("float", f"{base['perplexity']:.3f}", "", "", "", "", *([accuracy_cell(base)] * lw), "", "")
    for r in report["schemes"]:
        if r.get("status") != "ok":
            t.add_row(row_label(r), "[red]failed[/red]")
            failed.append(f"{row_label(r)}: {r.get('error', 'failed')}")
            continue
        spread = f"±{r['ppl_change_sd_pct']:.2f}%" if r.get("ppl_change_sd_pct") is not None else "-"
        p99 = r.get("kld_percentiles", {}).get("p99")
        row = [row_label(r), f"{r['perplexity']:.3f}", bracket(r.get("ppl_change_interval"), unit="%", signed=True),
               plus_minus(r.get("kld")), "-" if p99 is None else f"{p99:.3g}",
               plus_minus(r.get("same_top"), 100, "%")]
        row += [accuracy_cell(r)] * lw + [spread, ", ".join(r.get("within_noise_of", [])) or "-"]
        t.add_row(*row)
    iv = report.get("intervals", {})
    notes = [f"95% intervals; per-token ones from {iv.get('blocks', '?')} blocks of tokens (batch means), "
             "Δ ppl paired with float; KLD = KL(float || scheme), nats per token; fp spread: sd of the perplexity "
             "change under float-rounding input perturbations, not sampling error; within noise: the paired "
             "KLD interval contains 0"]
    t.caption = "\n".join(notes + failed)
    return t


def cost_table(report: dict) -> Table:
    """What each row costs and buys: weight bits, size, quantization time, worst layer."""
    from lowbit.report.compare import row_label

    base = report["float"]
    t = Table(title="size and time")
    for col in ("scheme", "w bits", "size", "× float", "quant s", "worst layer (SQNR dB)"):
        t.add_column(col, justify="left" if col in ("scheme", "worst layer (SQNR dB)") else "right", no_wrap=True)
    t.add_row("float", "", human_bytes(base["size_bytes"]), "1.00", "", "")
    for r in report["schemes"]:
        if r.get("status") != "ok":
            continue
        worst = r["worst_layers"][0] if r.get("worst_layers") else None
        bits = f"{r['average_bits']:.3f}" if r.get("average_bits") is not None else ""
        t.add_row(row_label(r), bits, human_bytes(r["size_bytes"]), f"{r['size_ratio']:.2f}",
                  f"{r['quant_seconds']:.1f}",
                  f"{short_layer(worst[0])} ({worst[1]:.1f})" if worst else
                  ("- (smoothed)" if r.get("smoothquant") is not None else "-"))
    return t


@app.command("compare")
def compare_cmd(
    model: Optional[str] = typer.Argument(None, help="Model folder (default: the built-in SmolLM2-135M)."),
    schemes: Optional[str] = typer.Option(
        None, "--schemes",
        help="Comma-separated schemes (default: nvfp4,nvfp4-e5m3,w8a8-int8,w8a8-fp8 when no --recipe/--target-bits "
             "rows are asked for, else none)."),
    recipe: Optional[list[str]] = typer.Option(None, "--recipe", help="A recipe file as a row (repeatable). " + RECIPE_HELP),
    target_bits: Optional[str] = typer.Option(
        None, "--target-bits", help="Automatic-recipe rows: comma-separated average weight bits, each a row "
                                    "choosing among --candidates (e.g. 4.5,6)."),
    candidates: Optional[str] = typer.Option(None, "--candidates", help=CANDIDATES_HELP),
    output: str = typer.Option("lowbit-report", "--output", "-o", help="Folder for report.json and report.png."),
    limit: int = typer.Option(1024, "--limit", help="Perplexity tokens to score."),
    window: int = typer.Option(512, "--window", help="Perplexity window (tokens)."),
    stride: Optional[int] = typer.Option(None, "--stride", help="Window stride (default: the window)."),
    lastword: int = typer.Option(16, "--lastword", help="Last-word examples (0 skips)."),
    lastword_context: int = typer.Option(96, "--lastword-context", help="Context tokens per last-word example."),
    text: Optional[str] = typer.Option(None, "--text", help="Evaluation text, one paragraph a line (default: built-in)."),
    calib: Optional[list[str]] = typer.Option(None, "--calib", help=CALIB_HELP),
    calib_weights: Optional[str] = typer.Option(None, "--calib-weights", help=CALIB_WEIGHTS_HELP),
    calib_column: Optional[str] = typer.Option(None, "--calib-column", help=CALIB_COLUMN_HELP),
    calib_split: Optional[str] = typer.Option(None, "--calib-split", help=CALIB_SPLIT_HELP),
    chat_template: Optional[str] = typer.Option(None, "--chat-template", help=CHAT_TEMPLATE_HELP),
    calib_pack: Optional[bool] = typer.Option(None, "--calib-pack/--no-calib-pack", help=CALIB_PACK_HELP),
    calib_samples: Optional[int] = typer.Option(None, "--calib-samples", help="Calibration windows (default 16, as lowbit quantize and lowbit.quantize)."),
    calib_seq_len: Optional[int] = typer.Option(None, "--calib-seq-len",
                                                help="Tokens per calibration window (default 512, as lowbit quantize and lowbit.quantize)."),
    calib_preset: Optional[str] = typer.Option(
        None, "--calib-preset",
        help=CALIB_PRESET_HELP),
    smoothquant: str = typer.Option("default", "--smoothquant",
                                    help="SmoothQuant alpha in [0, 1] or 'auto' (every scheme row and recipe group, as "
                                         "lowbit quantize), 'none', or 'default': 0.8 for static per-tensor INT8 "
                                         "inputs (w8a8-int8), 0.5 for FP8 ones (w8a8-fp8), none for the others."),
    sink_positions: Optional[int] = typer.Option(None, "--sink-positions",
                                                 help="Leading positions per calibration window kept out of static scales."),
    weight_rounding: Optional[str] = typer.Option(
        None, "--weight-rounding",
        help=WEIGHT_ROUNDING_HELP),
    reconstruct_iters: Optional[int] = typer.Option(
        None, "--reconstruct-iters",
        help=RECONSTRUCT_ITERS_HELP),
    reconstruct_batch_size: Optional[int] = typer.Option(
        None, "--reconstruct-batch-size", help=RECONSTRUCT_BATCH_SIZE_HELP),
    gptq_act_order: bool = typer.Option(False, "--gptq-act-order", help=GPTQ_ACT_ORDER_HELP),
    gptq_scale_search: Optional[bool] = typer.Option(None, "--gptq-scale-search/--no-gptq-scale-search",
                                                     help=GPTQ_SCALE_SEARCH_HELP),
    rotation: Optional[str] = typer.Option(None, "--rotation", help=ROTATION_HELP),
    backend: str = typer.Option("auto", "--backend",
                                help="Backend for quantized layers: 'auto' (as lowbit.load), 'reference', 'cpu-int8', "
                                     "'weight-cache'..."),
    save_format: Optional[str] = typer.Option(None, "--save-format",
                                              help="Also save each checkpoint in this format and report its size on disk."),
    spread: Optional[int] = typer.Option(
        None, "--spread",
        help="Perturbed perplexity evaluations per scheme with quantized activations, to show the float-rounding "
             "noise of each change as ±sd (default 2, as lowbit eval; 0 skips)."),
    kv_cache: Optional[str] = typer.Option(
        None, "--kv-cache",
        help="'fp8': add a calibrated FP8 (E4M3) KV cache to every scheme row (rows named SCHEME+kv-fp8; "
             "default: none, K and V in float)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show progress bars."),
) -> None:
    """Quantize MODEL with each scheme and compare perplexity, last-word accuracy, size and time with float."""
    if limit <= 0:
        raise OptionError(f"--limit must be a positive number of tokens to score, got {limit}")
    if spread is not None and spread < 0:
        raise OptionError(f"--spread must be 0 (skip) or a number of perturbed evaluations, got {spread}")
    if lastword < 0:
        raise OptionError(f"--lastword must be 0 (skip) or a positive number of examples, got {lastword}")
    kv = parse_kv_cache(kv_cache)
    weights = parse_calib_weights(calib, calib_weights)
    check_model_path(model)
    from lowbit.report import CompareOptions, run_compare
    from lowbit.report.writer import report_json

    quiet_progress(progress)
    calib_options: dict = {} if sink_positions is None else {"sink_positions": sink_positions}
    calib_options.update(calib_data_options(calib_pack, chat_template, calib_column, calib_split))
    preset = parse_calib_preset(calib_preset)  # expanded by CompareOptions / resolve_method, as quantize's
    wr = parse_weight_rounding(weight_rounding)
    if wr is not None:
        calib_options["weight_rounding"] = wr.value
    if parse_reconstruct_iters(reconstruct_iters) is not None:
        calib_options["reconstruct_iters"] = reconstruct_iters
    calib_options.update(reconstruct_batch_size_option(reconstruct_batch_size))
    if gptq_act_order:
        calib_options["gptq_act_order"] = True
    if gptq_scale_search is not None:
        calib_options["gptq_scale_search"] = gptq_scale_search
    rot = parse_rotation(rotation)
    if rot is not None:
        calib_options["rotation"] = rot.value
    budgets, cands = parse_budgets(target_bits, candidates)  # quantize's parser: the same error lines
    from lowbit.report.compare import DEFAULT_SCHEMES

    rows = parse_list(schemes, "--schemes") if schemes is not None else \
        ([] if recipe or budgets else list(DEFAULT_SCHEMES))
    for r in recipe or ():
        recipe_file(r)
    opts = CompareOptions(schemes=rows, recipes=list(recipe or ()), target_bits=budgets,
                          candidates=[c.name for c in cands], limit=limit, window=window, stride=stride,
                          lastword=lastword, lastword_context=lastword_context, text_file=text,
                          calib=calibration_arg(calib, weights), calib_preset=preset,
                          calib_samples=calib_samples, calib_seq_len=calib_seq_len,
                          calib_options=calib_options, smoothquant=parse_smoothquant(smoothquant),
                          backend=backend, save_format=save_format, progress=progress, kv_cache=kv,
                          **({} if spread is None else {"spread": spread}))
    log = (lambda s: err_console.print(f"[dim]{s}[/dim]", highlight=False)) if progress else (lambda s: None)
    report = run_compare(model_path=model_arg(model), opts=opts, output_dir=output, log=log)
    if as_json:
        print(report_json(report))
        return
    # piped output gets Rich's 80 columns by default: give the table the width it needs
    out = console if console.is_terminal and console.width >= 140 else Console(width=160)
    out.print(accuracy_table(report))
    out.print(cost_table(report))
    files = report.get("files", {})
    if files:
        console.print(f"report: {files['json']}  plot: {files['png']}", highlight=False)
