"""``lowbit quantize MODEL --scheme S``: quantize (calibrated when needed) and save a checkpoint,
or, with ``--model-free``, quantize the safetensors shards directly without building the model.

The command is its options, then options -> plan (``quantize_plan.resolve_plan``: every check and
decision) -> run (``quantize_run.run_plan``) -> summary (``quantize_summary.print_summary``)."""

from __future__ import annotations

from typing import Optional

import typer

from lowbit.cli.app import app
from lowbit.cli.recipe_options import CANDIDATES_HELP, RECIPE_HELP, TARGET_BITS_HELP
from lowbit.cli.common import (
    CALIB_COLUMN_HELP, CALIB_HELP, CALIB_PACK_HELP, CALIB_SPLIT_HELP, CALIB_WEIGHTS_HELP, CHAT_TEMPLATE_HELP,
    CALIB_PRESET_HELP, GPTQ_ACT_ORDER_HELP, GPTQ_SCALE_SEARCH_HELP, RECONSTRUCT_BATCH_SIZE_HELP, RECONSTRUCT_ITERS_HELP,
    ROTATION_HELP, WEIGHT_ROUNDING_HELP,
)


@app.command("quantize")
def quantize_cmd(
    model: str = typer.Argument(..., help="Model folder (Hugging Face layout), or 'builtin'."),
    scheme: Optional[str] = typer.Option(None, "--scheme", "-s", help="Scheme name (see `lowbit schemes`); or "
                                         "--recipe, or --target-bits."),
    recipe: Optional[str] = typer.Option(None, "--recipe", help=RECIPE_HELP),
    target_bits: Optional[str] = typer.Option(None, "--target-bits", help=TARGET_BITS_HELP),
    candidates: Optional[str] = typer.Option(None, "--candidates", help=CANDIDATES_HELP),
    checkpoint_format: str = typer.Option("lowbit", "--format", "-f", help="Checkpoint format: lowbit, fake, compressed-tensors, or gguf "
                                         "(one llama.cpp file; --scheme is then a mix such as Q4_K_M or a GGML type)."),
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
    importance_search: Optional[str] = typer.Option(
        None, "--importance-search",
        help="--format gguf with calibration: how the importance matrix chooses each block's scale: 'direct' "
             "(default: the importance alone weighs the squared error, a wider grid) or 'llama-cpp' "
             "(llama-quantize --imatrix's search, its bytes given the same importance matrix)."),
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
    options = dict(locals())  # the command's options, exactly as typed (before any name is bound here)
    from lowbit.cli.quantize_plan import QuantizeOptions, resolve_plan
    from lowbit.cli.quantize_run import run_plan
    from lowbit.cli.quantize_summary import print_summary

    plan = resolve_plan(QuantizeOptions(**options))  # every option checked and decided, before any work
    done = run_plan(plan)
    if done is not None:  # None on the ranks of a torchrun job other than 0: rank 0 reports
        print_summary(plan, *done)
