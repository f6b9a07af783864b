"""``lowbit quantize``'s options resolved once into a ``QuantizePlan``: every option conflict,
the scheme or recipe, the calibration (whether, on what, how), the SmoothQuant alphas, the path
(model-free, streamed, in memory), the checkpoint format and the output folder with its checks.
The run (``quantize_run``) and the summary (``quantize_summary``) only read the plan.

The checks run in the order they always ran, so a command line with several mistakes gets the
same first error; nothing heavy (torch) is imported before the model path is checked.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from lowbit.cli.common import (
    OptionError, calib_data_options, calibration_arg, check_model_path, model_arg, parse_calib_preset,
    parse_calib_weights, parse_kv_cache, parse_layer_inputs, parse_reconstruct_iters, parse_rotation,
    parse_smoothquant, parse_weight_rounding, reconstruct_batch_size_option,
)
from lowbit.cli.recipe_options import SchemePlan, parse_plan
from lowbit.run_path import RunPath


@dataclass(frozen=True)
class QuantizeOptions:
    """The command's options as typed on the command line (typer's values, unparsed)."""

    model: str
    scheme: str | None = None
    recipe: str | None = None
    target_bits: str | None = None
    candidates: str | None = None
    checkpoint_format: str = "lowbit"
    output: str | None = None
    calib: list[str] | None = None
    calib_weights: str | None = None
    calib_column: str | None = None
    calib_split: str | None = None
    chat_template: str | None = None
    calib_pack: bool | None = None
    calib_samples: int | None = None
    calib_seq_len: int | None = None
    smoothquant: str = "default"
    weight_rounding: str | None = None
    importance_search: str | None = None
    layer_inputs: str | None = None
    calib_preset: str | None = None
    reconstruct_iters: int | None = None
    reconstruct_batch_size: int | None = None
    gptq_act_order: bool = False
    gptq_scale_search: bool | None = None
    rotation: str | None = None
    kv_cache: str | None = None
    model_free: bool = False
    workers: int = 1
    device: str | None = None
    in_memory: bool = False
    offload_activations: bool = False
    ignore: list[str] | None = None
    allow_unquantized: bool = False
    overwrite: bool = False
    as_json: bool = False


@dataclass(frozen=True)
class QuantizePlan:
    """One run of ``lowbit quantize``, decided (see the module docstring)."""

    source: Path                 # the model folder
    output: Path
    assignment: SchemePlan       # one scheme, a recipe, or a budget for the automatic choice
    checkpoint_format: str
    path: RunPath
    calibration: object          # lowbit.quantize's calibration= (None: the built-in text)
    config: object               # the CalibrationConfig (None on the model-free path)
    smoothquant: object          # the --smoothquant choice (lowbit.algorithms.smoothquant.defaults)
    method: object               # the lowbit.method.Method (None: GGUF, or --target-bits until the choice)
    kv_cache: str | None
    ignore: tuple[str, ...]
    allow_unquantized: bool
    overwrite: bool
    workers: int
    device: str | None
    offload_activations: bool
    as_json: bool
    importance_search: object = None  # --format gguf: the ImportanceSearch (lowbit.gguf_quantize)

    @property
    def calibration_options_given(self) -> bool:
        """Whether the command line asked anything of a calibration (a note when none runs)."""
        cfg = self.config
        return self.calibration is not None or dataclasses.replace(cfg, rotation=type(cfg)().rotation) != type(cfg)()


@dataclass(frozen=True)
class _Calibration:
    """The calibration options of ``lowbit quantize``, each parsed once."""

    weight_rounding: object
    reconstruct_iters: int | None
    reconstruct_batch: dict
    layer_inputs: object
    preset: object
    rotation: object

    @classmethod
    def parse(cls, o: QuantizeOptions) -> "_Calibration":
        """Parsed in the order they always were, so the first bad value is the one reported."""
        return cls(weight_rounding=parse_weight_rounding(o.weight_rounding),
                   reconstruct_iters=parse_reconstruct_iters(o.reconstruct_iters),
                   reconstruct_batch=reconstruct_batch_size_option(o.reconstruct_batch_size),
                   layer_inputs=parse_layer_inputs(o.layer_inputs), preset=parse_calib_preset(o.calib_preset),
                   rotation=parse_rotation(o.rotation))


def _default_output(model: str | None, label: str) -> Path:
    stem = Path(model).resolve().name if model else "SmolLM2-135M-Instruct"
    return Path(f"{stem}-{label}")


def _check_output(folder: Path, out: Path, overwrite: bool) -> None:
    """Before any work: the output is not the source, and is new, empty or replaced on purpose."""
    from lowbit.files.outguard import check_not_source
    from lowbit.files.writer import check_output_free

    check_not_source(folder, out)
    check_output_free(out, overwrite)


def _calibration_config(o: QuantizeOptions, c: _Calibration, data_opts: dict):
    """The CalibrationConfig of the calibration options given (the others: its defaults)."""
    from lowbit.calibration import CalibrationConfig

    given = {"rotation": c.rotation, "num_samples": o.calib_samples, "seq_len": o.calib_seq_len,
             "weight_rounding": c.weight_rounding, "layer_inputs": c.layer_inputs,
             "reconstruct_iters": c.reconstruct_iters, "gptq_act_order": True if o.gptq_act_order else None,
             "gptq_scale_search": o.gptq_scale_search}
    kwargs = {**{k: v for k, v in given.items() if v is not None}, **c.reconstruct_batch, **data_opts}
    return CalibrationConfig.preset(c.preset, **kwargs) if c.preset is not None else CalibrationConfig(**kwargs)


def _check_model_free(o: QuantizeOptions, c: _Calibration, assignment: SchemePlan, sq_choice, data_opts: dict,
                      kv) -> None:
    from lowbit.algorithms.smoothquant.defaults import DEFAULT

    if c.rotation is not None:
        raise OptionError("--model-free cannot rotate: a fused rotation rewrites the embeddings, every layer and "
                          "lm_head together on the loaded model; drop --rotation or drop --model-free")
    if (o.calib or data_opts or sq_choice != DEFAULT or c.weight_rounding is not None or c.layer_inputs is not None
            or c.preset is not None or kv is not None or c.reconstruct_iters or c.reconstruct_batch
            or o.gptq_act_order or o.gptq_scale_search is not None):
        raise OptionError("--model-free takes no calibration: drop --calib/--calib-weights/--calib-column/"
                          "--calib-split/--chat-template/--calib-pack/--smoothquant/--weight-rounding/"
                          "--layer-inputs/--calib-preset/--kv-cache/--reconstruct-iters/--reconstruct-batch-size/"
                          "--gptq-act-order/--gptq-scale-search, or drop --model-free")
    if assignment.target_bits is not None:
        raise OptionError("--target-bits measures layers on a forward and backward of the model: drop "
                          "--model-free or give --scheme/--recipe")


def _choose_path(o: QuantizeOptions, rotation, assignment: SchemePlan, method, kv) -> RunPath:
    """Streamed when the run calibrates (``method.calibrates``) and nothing needs the whole model;
    else in memory."""
    needs = method is not None and method.calibrates(method.schemes)
    rot = rotation is not None
    # a rotation rewrites the embeddings, every layer and lm_head together, and the automatic
    # choice runs the whole model forward and backward: the whole model is loaded
    stream = not o.in_memory and kv is None and not rot and needs and assignment.target_bits is None
    if (o.device is not None or o.offload_activations) and rot:
        raise OptionError("--rotation loads the whole model in memory on the CPU: drop --device/"
                          "--offload-activations or drop --rotation")
    if (o.device is not None or o.offload_activations) and not stream:
        why = "with --target-bits" if assignment.target_bits is not None else "without calibration options"
        fix = "drop --device/--offload-activations" if assignment.target_bits is not None else "add --model-free"
        raise OptionError(f"--device/--offload-activations apply to model-free and streamed quantization, and "
                          f"{assignment.label} {why} is neither: {fix}")
    return RunPath.STREAMED if stream else RunPath.IN_MEMORY


def resolve_plan(o: QuantizeOptions) -> QuantizePlan:
    """The plan of ``o``, or the first OptionError (or a missing-model error) it has."""
    if o.checkpoint_format == "gguf":
        from lowbit.cli.quantize_gguf import gguf_plan

        return gguf_plan(o, QuantizePlan)
    if o.importance_search is not None:
        raise OptionError("--importance-search applies to --format gguf (an importance matrix for llama.cpp's types)")
    kv = parse_kv_cache(o.kv_cache)
    weights = parse_calib_weights(o.calib, o.calib_weights)
    data_opts = calib_data_options(o.calib_pack, o.chat_template, o.calib_column, o.calib_split)
    if o.device is not None and not o.model_free and (o.in_memory or kv is not None):
        raise OptionError("--device applies to model-free and streamed quantization: drop --in-memory/--kv-cache or "
                          "drop --device")
    if o.offload_activations and (o.model_free or o.in_memory):
        raise OptionError("--offload-activations applies to streamed calibration: drop --model-free/--in-memory")
    check_model_path(o.model)
    from lowbit.method import CalibrationChoice, resolve_method  # noqa: E402 (torch is imported from here on)
    from lowbit.models import resolve_model_path

    assignment = parse_plan(o.scheme, o.recipe, o.target_bits, o.candidates)
    src = model_arg(o.model)
    out = Path(o.output) if o.output else _default_output(src, assignment.label)
    sq_choice = parse_smoothquant(o.smoothquant)
    calib = _Calibration.parse(o)
    common = dict(output=out, assignment=assignment, checkpoint_format=o.checkpoint_format, smoothquant=sq_choice,
                  kv_cache=kv, ignore=tuple(o.ignore or ()), allow_unquantized=o.allow_unquantized,
                  overwrite=o.overwrite, workers=o.workers, device=o.device,
                  offload_activations=o.offload_activations, as_json=o.as_json)
    if o.model_free:
        _check_model_free(o, calib, assignment, sq_choice, data_opts, kv)
        folder = resolve_model_path(src)
        _check_output(folder, out, o.overwrite)
        method = resolve_method(assignment.given, CalibrationChoice())
        return QuantizePlan(source=folder, path=RunPath.MODEL_FREE, calibration=None, config=None, method=method,
                            **common)
    folder = resolve_model_path(src)
    _check_output(folder, out, o.overwrite)
    cfg = _calibration_config(o, calib, data_opts)
    calibration = calibration_arg(o.calib, weights)
    method = None if assignment.target_bits is not None else \
        resolve_method(assignment.given, CalibrationChoice(calibration or "builtin", smoothquant=sq_choice, config=cfg))
    path = _choose_path(o, calib.rotation, assignment, method, kv)
    return QuantizePlan(source=folder, path=path, calibration=calibration, config=cfg, method=method, **common)
