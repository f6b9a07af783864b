"""Helpers shared by the quantize / eval / compare commands."""

from __future__ import annotations

from lowbit.errors import LowbitError

BUILTIN_ALIASES = ("builtin", "default")


class OptionError(LowbitError, ValueError):
    """A command-line option has a bad value."""


def quiet_progress(progress: bool) -> None:
    """--no-progress also silences transformers' own bars (weight loading)."""
    if not progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def model_arg(value: str | None) -> str | None:
    """None (the built-in model) for no MODEL or 'builtin'; otherwise the path as given."""
    if value is None or value in BUILTIN_ALIASES:
        return None
    return value


def check_model_path(value: str | None) -> None:
    """A MODEL argument that names a folder must be a model folder: checked before anything heavy
    (torch) is imported, so a wrong path fails at once. The built-in model is not checked here."""
    from pathlib import Path

    from lowbit.models.builtin import is_gguf_path, resolve_model_path

    if model_arg(value) is not None:
        if is_gguf_path(Path(value)):
            return  # expanded (heavy, cached) when the model is loaded
        resolve_model_path(value)


def check_folder(value: str) -> None:
    """A checkpoint folder argument must exist (checked before torch is imported)."""
    from pathlib import Path

    from lowbit.models.builtin import ModelNotFoundError

    if not Path(value).is_dir():
        raise ModelNotFoundError(f"checkpoint folder not found: {value}")


def parse_smoothquant(value: str) -> float | str | None:
    """--smoothquant: 'default' (the scheme's alpha, lowbit.algorithms.smoothquant.defaults), an alpha in
    [0, 1], 'auto' (per-layer search) or 'none'; the values ``lowbit.quantize(smoothquant=...)``
    takes, 'none' returned as None."""
    from lowbit.algorithms.smoothquant.defaults import AUTO, DEFAULT, OFF, check_choice

    if value in (DEFAULT, AUTO, OFF):
        return check_choice(value)
    try:
        return check_choice(float(value))
    except ValueError:
        raise OptionError(f"--smoothquant must be an alpha in [0, 1], {AUTO!r}, {DEFAULT!r} or {OFF!r}, "
                          f"got {value!r}") from None


def _enum_option(key: str, given: str, enum, option: str):
    """``enum(key)``, or an OptionError naming ``option``, its choices and the ``given`` text."""
    try:
        return enum(key)
    except ValueError:
        raise OptionError(f"{option} must be one of {', '.join(k.value for k in enum)}, got {given!r}") from None


def parse_weight_rounding(value: str | None):
    """--weight-rounding: None (not given) or a lowbit.algorithms.WeightRounding."""
    from lowbit.algorithms import WeightRounding

    return None if value is None else _enum_option(value.lower(), value, WeightRounding, "--weight-rounding")


def parse_list(value: str, option: str) -> list[str]:
    items = [s.strip() for s in value.split(",") if s.strip()]
    if not items:
        raise OptionError(f"{option} needs at least one name")
    return items


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def parse_layer_inputs(value: str | None):
    """--layer-inputs: None (not given) or a lowbit.calibration.LayerInputs."""
    from lowbit.calibration import LayerInputs

    return None if value is None else _enum_option(value, value, LayerInputs, "--layer-inputs")


def parse_rotation(value: str | None):
    """--rotation: None (not given) or a lowbit.algorithms.rotate.Rotation."""
    from lowbit.algorithms.rotate.options import Rotation

    return None if value is None else _enum_option(value.lower(), value, Rotation, "--rotation")


ROTATION_HELP = ("Hadamard rotations fused into the float weights before quantizing: 'hadamard' (residual stream "
                 "R1 + per-head R2; exact in float, the checkpoint is an ordinary one with an untied lm_head; "
                 "needs the whole model in memory) or 'none' (the default).")


# the budgets are lowbit.calibration.CALIBRATION_PRESETS' (not imported here: torch); a test pins them
CALIB_PRESET_HELP = ("A named calibration budget: fast (RTN, 4 x 128 tokens), default, gptq-fast (GPTQ on 4 x 128 "
                     "tokens: for INT8 weights) or best (GPTQ, then 50 block-reconstruction steps a layer, on "
                     "64 x 512 tokens); explicit calibration options override its fields.")


# the number is lowbit.calibration.config.DEFAULT_RECONSTRUCT_ITERS (not imported here: torch); a test pins it
RECONSTRUCT_ITERS_HELP = ("Block-output reconstruction steps per decoder layer after quantization (re-chooses rounding "
                          "directions to reproduce the float layer's output; scales unchanged; default: 20 after GPTQ "
                          "on symmetric 4-bit weights (nvfp4, w4a16, ...), else 0: off; --format gguf: 0, and 20 "
                          "lowered KLD by 10-38% at the same file size for 2-3x the time, except Gemma-3 Q2_K).")

RECONSTRUCT_BATCH_SIZE_HELP = ("Calibration windows per reconstruction step (default 1; 0: one whole calibration "
                               "batch). A whole batch of 4 costs 4x the steps' compute at the same perplexity on "
                               "SmolLM2 (bench/calibrate/RESULTS-calibrate.md).")

WEIGHT_ROUNDING_HELP = ("Weight rounding with calibration: 'rtn' (round to nearest) or 'gptq' (error-compensating; "
                        "calibrates weight-only and dynamic schemes too). Default: GPTQ for symmetric weights of 4 bits or fewer "
                        "(w4a16 +29% -> +6-9% on SmolLM2 with the 20 reconstruction steps) and for w8a8-fp8, RTN "
                        "otherwise; --weight-rounding rtn keeps 4-bit weight-only schemes plain RTN.")

GPTQ_ACT_ORDER_HELP = ("GPTQ rounds columns in decreasing order of their input energy (act-order) instead of in "
                       "order, wherever GPTQ rounds the weights (--weight-rounding gptq or the scheme's default). "
                       "Helps when GPTQ is the last step on 4-bit weights (--reconstruct-iters 0: w4a16 +12.2% "
                       "instead of +21.2% ppl on SmolLM2), not before reconstruction or on INT8 weights "
                       "(bench/peers/RESULTS.md); default: off.")
GPTQ_SCALE_SEARCH_HELP = ("GPTQ's group scales searched around the scheme's rule (full-range -> full-range-mse, "
                          "max and mse -> mse) for the smallest weight error weighted by each input's Hessian "
                          "diagonal; off: RTN's scales. Default: on for symmetric weights of 4 bits or fewer "
                          "(w4a16, w4a8-*, nvfp4*, mxfp4*), off otherwise. Files keep the standard layout.")


CALIB_HELP = ("Calibration data (repeatable: sources mixed by --calib-weights): 'builtin' (the default), a text file "
              "(one paragraph a line), a .jsonl file (a 'text' or 'messages' field a line), a .csv or .parquet file "
              "(--calib-column), a folder saved by datasets' save_to_disk, or a dataset name found in the local "
              "datasets cache (never downloaded).")
CALIB_WEIGHTS_HELP = "Comma-separated weights, one per --calib: each source's share of the calibration windows."
CALIB_COLUMN_HELP = "The field or column holding the text or the messages (default: 'text', else 'messages')."
CALIB_SPLIT_HELP = "The split of a datasets folder or cached dataset (default: its only split, else 'train')."
CHAT_TEMPLATE_HELP = ("How conversations become calibration text: 'auto' (the model's own chat template, the default), "
                      "'none' (message contents only) or a Jinja template file.")
CALIB_PACK_HELP = ("Pack samples into full windows (the default) or pad one sample per window (padding never counts in "
                   "scales, SmoothQuant statistics, GPTQ Hessians or reconstruction losses).")


def parse_calib_weights(calib: list[str] | None, weights: str | None) -> list[float] | None:
    """--calib-weights: None (not given), else one positive number per --calib (checked before
    torch is imported)."""
    if weights is None:
        return None
    n = len(calib or [])
    try:
        ws = [float(w) for w in weights.split(",")]
    except ValueError:
        raise OptionError(f"--calib-weights must be comma-separated numbers, got {weights!r}") from None
    if len(ws) != n:
        raise OptionError(f"--calib-weights gives {len(ws)} weights for {n} --calib sources: give one per --calib")
    if not all(w > 0 and w != float("inf") for w in ws):
        raise OptionError(f"--calib-weights must be positive numbers, got {weights!r}")
    return ws


def calibration_arg(calib: list[str] | None, weights: list[float] | None):
    """--calib (repeatable) as ``lowbit.quantize``'s ``calibration``: None (not given), one source
    as given ('default' is 'builtin'), or CalibrationSources when several or weighted."""
    if not calib:
        return None
    items = ["builtin" if c in BUILTIN_ALIASES else c for c in calib]
    if len(items) == 1 and weights is None:
        return items[0]
    from lowbit.calibration.sources import CalibrationSource

    return [CalibrationSource(c, w) for c, w in zip(items, weights or [1.0] * len(items))]


def calib_data_options(pack: bool | None, chat_template: str | None, column: str | None,
                       split: str | None) -> dict:
    """The calibration-data options given, as CalibrationConfig fields (the others keep its defaults)."""
    given = {"pack": pack, "chat_template": chat_template, "column": column, "split": split}
    return {k: v for k, v in given.items() if v is not None}


def parse_reconstruct_iters(value: int | None) -> int | None:
    """--reconstruct-iters: None (not given) or a number of steps >= 0."""
    if value is not None and value < 0:
        raise OptionError(f"--reconstruct-iters must be >= 0, got {value}")
    return value


def reconstruct_batch_size_option(value: int | None) -> dict:
    """--reconstruct-batch-size as CalibrationConfig fields: {} (not given), else
    reconstruct_batch_size (0: None, one whole calibration batch per step)."""
    if value is None:
        return {}
    if value < 0:
        raise OptionError(f"--reconstruct-batch-size must be >= 0, got {value}")
    return {"reconstruct_batch_size": value or None}


def parse_calib_preset(value: str | None) -> str | None:
    """--calib-preset: None (not given) or a name of lowbit.calibration.CALIBRATION_PRESETS."""
    from lowbit.calibration import CALIBRATION_PRESETS

    if value is not None and value not in CALIBRATION_PRESETS:
        raise OptionError(f"--calib-preset must be one of {', '.join(CALIBRATION_PRESETS)}, got {value!r}")
    return value


def parse_kv_cache(value: str | None) -> str | None:
    """--kv-cache: None (not given: ``lowbit.kvcache.DEFAULT_KV_CACHE``, K and V in float) or
    'fp8'; anything else an OptionError naming --kv-cache (checked before torch is imported)."""
    from lowbit.kvcache import DEFAULT_KV_CACHE, check_kv_cache
    from lowbit.errors import QuantizationError

    if value is None:
        return DEFAULT_KV_CACHE
    try:
        return check_kv_cache(value)
    except QuantizationError as e:
        raise OptionError(e.cli_message()) from None
