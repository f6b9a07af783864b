"""Quantize a model in memory: ``lowbit.quantize(model, scheme, ...)`` resolves its arguments
into an ``InMemoryPlan`` (around the ``lowbit.method.Method`` every path shares) and runs it
(``run_in_memory``).

Without calibration this is plain round-to-nearest of every target linear (the model-free
path must reproduce it bit for bit). NVFP4 weight global scales are shared across fused
siblings (q/k/v, gate/up): the amax is taken over the group.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn as nn

from lowbit.backends import use_backend
from lowbit.errors import OptionRef, QuantizationError
from lowbit.fusion import shared_weight_global_scales
from lowbit.kvcache import DEFAULT_KV_CACHE, check_kv_cache
from lowbit.modules import QuantLinear
from lowbit.linearize import linearize
from lowbit.algorithms.rotate.options import DEFAULT_ROTATION
from lowbit.method import CalibrationChoice, Method, TargetChoice, resolve_method
from lowbit.recipes import Assignment
from lowbit.schemes import Scheme, get_scheme
from lowbit.algorithms.smoothquant.defaults import DEFAULT
from lowbit.targets import (
    READ_DIRECTLY, float_weights, matmul_targets, quantizable_linears, set_submodule, survey_weights,
)


@torch.no_grad()
def quantize_rtn(model: nn.Module, assign: Assignment) -> nn.Module:
    """Replace the linears of ``assign`` (a scheme per linear name: ``lowbit.recipes.plan``; one
    scheme for all is ``Assignment.of_one``) with QuantLinear by round-to-nearest (no activation
    scales); every layer gets the automatic backend."""
    linearize(model)
    schemes = dict(assign)
    linears = {n: model.get_submodule(n) for n in schemes}
    gscales: dict[str, torch.Tensor] = {}
    for s in dict.fromkeys(schemes.values()):  # fused siblings share one scheme (recipes.resolve)
        gscales.update(shared_weight_global_scales({n: linears[n].weight for n in linears if schemes[n] == s}, s))
    for n, lin in linears.items():
        q = QuantLinear.from_linear(lin, schemes[n], name=n, weight_global_scale=gscales.get(n))
        set_submodule(model, n, q)
    use_backend(model, "auto")
    return model


def every_linear(model: nn.Module, scheme, ignore: Iterable[str] = (), include_lm_head: bool = False) -> Assignment:
    """``scheme`` (a preset name or Scheme) for every quantizable linear of ``model`` not in
    ``ignore``: the one-scheme Assignment ``quantize_rtn`` takes (MoE experts split first)."""
    linearize(model)
    return Assignment.of_one(get_scheme(scheme), quantizable_linears(model, ignore, include_lm_head))


def check_targets(model: nn.Module, ignore: Iterable[str], include_lm_head: bool, allow_unquantized: bool,
                  survey=None) -> list:
    """Refuse (QuantizationError) a model with weight matrices the scheme targets but lowbit cannot
    quantize (``targets.unquantizable_targets``), unless ``allow_unquantized``: then warn, listing
    them. Returns them. ``survey``: ``targets.survey_weights`` already made (else made here). The weights that are not targets (depthwise convolutions, ``A_log``, ...:
    ``targets.float_weights``) are left on ``model.lowbit_float_weights`` (name -> kind)."""
    survey = survey or survey_weights(model, ignore, include_lm_head)
    model.lowbit_float_weights = float_weights(survey)
    left = matmul_targets(model, survey.kinds)
    if left:
        shown = ", ".join(f"{n} {list(s)}" for n, s in left[:3]) + (f" and {len(left) - 3} more" if len(left) > 3 else "")
        msg = (f"{len(left)} weight matrices are not nn.Linear and cannot be quantized by lowbit: {shown} "
               f"(e.g. fused MoE experts)")
        if not allow_unquantized:
            raise QuantizationError(msg + "; pass {allow} to keep them in float, or {ignore} for the modules",
                                    allow=OptionRef("allow_unquantized"), ignore=OptionRef("ignore", "NAME"))
        warnings.warn(f"lowbit: {msg}; they stay in float (allow_unquantized)", stacklevel=3)
    return left


def _set_apart(ignore: Iterable[str], survey) -> list[str]:
    """``ignore`` and, by exact name, the linears the forward showed are not to be quantized:
    routers found by their top-k (in float like every router), linears whose outputs weight hidden
    vectors (``targets.COEFFICIENTS``, listed in the summary's float weights) and linears whose
    weight the forward reads without calling them (a warning lists them)."""
    if survey.read_directly:
        shown = ", ".join(survey.read_directly[:3]) + (f" and {len(survey.read_directly) - 3} more"
                                                      if len(survey.read_directly) > 3 else "")
        warnings.warn(f"lowbit: {len(survey.read_directly)} linears stay in float, a {READ_DIRECTLY}: {shown}",
                      stacklevel=3)
    return list(ignore) + survey.routers + survey.read_directly + survey.coefficients


def quantized_layers(model: nn.Module) -> list[str]:
    """Names of the modules that already hold a lowbit scheme (QuantLinear, FakeQuantLinear)."""
    return [n for n, m in model.named_modules() if isinstance(getattr(m, "scheme", None), Scheme)]


def _check_float_states(float_states) -> None:
    from lowbit.calibration.float_states import FloatStates

    if float_states is not None and not isinstance(float_states, FloatStates):
        raise QuantizationError(f"float_states must be a lowbit.calibration.FloatStates or None, "
                                f"got {type(float_states).__name__}")


def _refuse_quantized(model: nn.Module) -> None:
    done = quantized_layers(model)
    if done:
        raise QuantizationError(
            f"the model is already quantized ({len(done)} lowbit layers, e.g. {done[0]!r} with scheme "
            f"{model.get_submodule(done[0]).scheme.name}): lowbit.quantize works in "
            f"place, so quantize a fresh float model (load it again, or copy.deepcopy it before quantizing)")


@dataclass(frozen=True)
class InMemoryPlan:
    """An in-memory run, decided: how it quantizes (``lowbit.method.Method``), which weights, and
    the KV cache (None, or "fp8" checked by ``check_kv_cache``)."""

    method: Method
    targets: TargetChoice = TargetChoice()
    kv_cache: str | None = DEFAULT_KV_CACHE


def quantize(model: nn.Module, scheme: Scheme | str | None, calibration=None, *, smoothquant=DEFAULT,
             ignore: Iterable[str] = (), include_lm_head: bool = False, tokenizer=None,
             config=None, preset: str | None = None, progress: bool | None = None,
             allow_unquantized: bool = False, kv_cache: str | None = DEFAULT_KV_CACHE,
             float_states=None, **calibration_options) -> nn.Module:
    """Quantize ``model`` in place and return it.

    scheme: a preset name or Scheme (every target linear), or a recipe (mixed precision,
        ``lowbit.recipes.Recipe``): a mapping such as ``{"re:.*mlp\\.down_proj": "w8a8-fp8",
        "default": "nvfp4"}``, a Recipe, or a ``.json`` / ``.yaml`` recipe file. The recipe is
        resolved on the quantizable linears (``lowbit.recipes.resolve``: a pattern matching
        nothing, conflicting claims and split fused groups are errors); the Assignment it gave is
        left on ``model.lowbit_recipe`` (None for one scheme). A llama.cpp GGML type or mix ("q4_k",
        "Q4_K_M") quantizes under llama-quantize's rules for ``lowbit.save(..., format="gguf")``
        (``lowbit.gguf_memory``; with ``calibration``, its importance matrix and GPTQ,
        ``lowbit.gguf_calibrate``, which also reads ``importance_search``). A model that already holds lowbit layers is
    refused (QuantizationError): quantize a fresh float model, or a ``copy.deepcopy`` of one.
    Mixture-of-experts blocks are split first (``lowbit.moe.split_experts``): every expert's
    projections become linears ``experts.{e}.gate_proj`` ... and are quantized per expert; the
    routers stay in float.

    calibration: token ids [n, seq_len], a list of strings, a text file path (one paragraph a
        line) or "builtin" (the packaged text); strings need ``tokenizer``.
    smoothquant: "default" (the default: ``lowbit.algorithms.smoothquant.defaults.default_alpha(scheme)``,
        alpha 0.8 for static per-tensor INT8 inputs, 0.5 for FP8 ones, no smoothing for every
        other scheme; the CLI's and ``compare``'s default too), an alpha in [0, 1], "auto"
        (per-layer search) or "none" (no smoothing; None means the same).
    config / calibration_options: a ``lowbit.calibration.CalibrationConfig`` or its fields
        (num_samples, seq_len, batch_size, observer, sink_positions, smooth_down_proj...).
        ``rotation="hadamard"`` first fuses Hadamard rotations into the float weights
        (``lowbit.algorithms.rotate.rotate_model``; with or without calibration data, before
        SmoothQuant); what it did is left on ``model.lowbit_rotation`` (a ``RotationReport``).
    allow_unquantized: weight matrices the scheme targets that lowbit cannot quantize (fused MoE
        experts, non-Linear projections) are an error by default; True keeps them in float with a
        warning listing them (they are left on ``model.lowbit_unquantized``).
    progress: a progress bar per calibrated decoder layer on stderr (default None: when stderr is
        a terminal).
    kv_cache: None (the default: K and V stay in float) or "fp8": a calibrated FP8 (E4M3) KV
        cache as vLLM runs it (``lowbit.kvcache``): after the weights are quantized, one
        full-model pass over the calibration tokens sets static per-tensor scales
        ``k_scale = amax(K) / 448``, ``v_scale = amax(V) / 448`` per attention module (K after
        RoPE), and the model's forward QDQs K and V under them from then on. Needs calibration
        data; the report is left on ``model.lowbit_kv_calibration``.
    float_states: a ``lowbit.calibration.FloatStates`` given to several calibrated quantizations
        of one float model (copies of it) on the same calibration windows: the float model's
        hidden states that reconstruction aims at are computed by the first and reused by the
        others (one float pass of every decoder layer saved each; the same codes as without it;
        not used with a rotation or SmoothQuant). ``lowbit compare`` shares one across its rows.
        Anything else is a QuantizationError before any work.
    preset: a named calibration budget (``lowbit.calibration.CALIBRATION_PRESETS``, e.g.
        "gptq-fast"); calibration_options given with it override its fields.

    scheme=None with ``kv_cache`` keeps every weight in float and quantizes only K and V (in
    memory: saving needs quantized layers).

    Without calibration, schemes that need none (weight-only, dynamic activations) are plain
    round-to-nearest (``quantize_rtn``; model-free quantization reproduces it bit for bit).
    With calibration data, symmetric weights of 4 bits or fewer default to GPTQ + 20
    reconstruction steps (the data feeds GPTQ's Hessians: ``default_weight_rounding``); the
    others (w8a16, dynamic INT8/FP8, MXFP6/MXFP8, w4a16-asym) stay plain RTN
    unless SmoothQuant or ``weight_rounding="gptq"`` is asked for, and ``weight_rounding="rtn"``
    keeps any of them RTN. The calibration report
    is left on ``model.lowbit_calibration``.
    """
    from lowbit.gguf_memory import ggml_target

    target = ggml_target(scheme)
    if target is not None:  # a GGML type or llama-quantize mix: lowbit.gguf_memory
        _refuse_for_ggml(target, smoothquant=smoothquant is not DEFAULT, ignore=bool(tuple(ignore)),
                         include_lm_head=include_lm_head, allow_unquantized=allow_unquantized,
                         kv_cache=kv_cache is not None, float_states=float_states is not None)
        from lowbit.gguf_memory import quantize_ggml

        cal = None
        if calibration is not None:
            from lowbit.gguf_calibrate import ggml_calibration

            cal = ggml_calibration(target, calibration, tokenizer, config, preset, calibration_options)
        else:
            _refuse_for_ggml(target, config=config is not None, preset=preset is not None,
                             tokenizer=tokenizer is not None, **{k: True for k in calibration_options})
        return quantize_ggml(model, target, calibration=cal)
    kv_cache = check_kv_cache(kv_cache)
    _check_float_states(float_states)
    choice = CalibrationChoice(calibration, tokenizer, smoothquant, config, preset, calibration_options)
    if scheme is None and kv_cache is not None:
        return _kv_only(model, choice, kv_cache)
    plan = InMemoryPlan(resolve_method(scheme, choice), TargetChoice(tuple(ignore), include_lm_head, allow_unquantized),
                        kv_cache)
    return run_in_memory(model, plan, progress=progress, float_states=float_states)


def _refuse_for_ggml(target, **given: bool) -> None:
    """A GGML target is quantized under llama-quantize's own rules of which tensors get which type,
    calibrated by its importance matrix and GPTQ only (``lowbit.gguf_calibrate``; options without
    calibration data have nothing to act on): QuantizationError naming the first option given."""
    for option, on in given.items():
        if on:
            raise QuantizationError(f"scheme {target.value!r} (llama.cpp's GGML types) takes no {option!r} here: "
                                    f"llama-quantize's rules choose every tensor's type, and calibration (with "
                                    f"calibration=...) is its importance matrix and GPTQ (lowbit.gguf_calibrate)")


def run_in_memory(model: nn.Module, plan: InMemoryPlan, progress: bool | None = None,
                  float_states=None) -> nn.Module:
    """Quantize ``model`` in place under ``plan`` (``lowbit.quantize``'s run, after its resolve
    step; ``lowbit compare`` and ``lowbit quantize --in-memory`` call it with their own plan)."""
    from lowbit.calibration import LayerwiseCalibrator

    method, t, kv_cache = plan.method, plan.targets, plan.kv_cache
    _refuse_quantized(model)
    if kv_cache is not None:
        from lowbit.kvcache.calibrate import check_kv_model

        check_kv_model(model, kv_cache)  # before any work
    linearize(model)
    survey = survey_weights(model, t.ignore, t.include_lm_head)
    ignore = _set_apart(t.ignore, survey)
    assign = method.assignment(quantizable_linears(model, ignore, t.include_lm_head))
    schemes = assign.distinct
    left = check_targets(model, ignore, t.include_lm_head, t.allow_unquantized, survey)
    cfg, choice = method.config, method.calibration
    if not method.has_data:
        method.check_without_data(schemes, kv_cache)
        _rotate(model, cfg)
        return _unquantized(quantize_rtn(model, assign), left, assign)
    if not method.calibrates(schemes):
        data = None
        if kv_cache is not None:
            data = _calibration_data(choice, cfg, kv_cache)
        _rotate(model, cfg)
        quantize_rtn(model, assign)
        if kv_cache is not None:
            _calibrate_kv(model, data.ids, kv_cache, cfg)
        return _unquantized(model, left, assign)
    data = _calibration_data(choice, cfg, kv_cache)
    _rotate(model, cfg)  # the float model, before SmoothQuant and calibration
    was_training = model.training
    model.eval()
    shared = float_states if cfg.rotation is DEFAULT_ROTATION else None  # a rotation changes the float layers
    report = LayerwiseCalibrator(model, assign, cfg, method.alphas_of(schemes),
                                 float_states=shared).run(data.ids, list(assign), progress=progress, valid=data.valid)
    report.data = data.info.as_dict()
    model.train(was_training)
    model.lowbit_calibration = report
    use_backend(model, "auto")
    if kv_cache is not None:
        _calibrate_kv(model, data.ids, kv_cache, cfg)
    return _unquantized(model, left, assign)


def _kv_only(model: nn.Module, choice: CalibrationChoice, kv_cache: str) -> nn.Module:
    """``scheme=None`` with a KV cache: the weights stay float, only K and V are quantized (to
    measure the KV cache's own cost in memory; ``lowbit.save`` refuses a model without quantized
    layers)."""
    from lowbit.calibration.config import calibration_config
    from lowbit.kvcache.calibrate import check_kv_model

    _refuse_quantized(model)
    check_kv_model(model, kv_cache)
    cfg = calibration_config(choice.config, choice.preset, choice.options)
    if cfg.rotation is not DEFAULT_ROTATION:
        raise QuantizationError(f"rotation={cfg.rotation.value!r} rotates weights before quantizing them: pass a "
                                f"weight scheme (scheme=None quantizes only the KV cache)")
    if choice.data is None:
        raise QuantizationError(f"kv_cache={kv_cache!r} needs calibration data (pass calibration=...)")
    _calibrate_kv(model, _calibration_data(choice, cfg, kv_cache).ids, kv_cache, cfg)
    model.lowbit_unquantized = []
    return model


def _calibration_data(choice: CalibrationChoice, cfg, kv_cache):
    """The calibration windows of ``choice``'s data (``lowbit.calibration.calibration_set``) under
    ``cfg``'s data options; padded windows with a KV cache are refused (its scales would count the
    padding)."""
    from lowbit.calibration import calibration_set

    data = calibration_set(choice.data, choice.tokenizer, **cfg.data_options())
    if kv_cache is not None and data.valid is not None:
        raise QuantizationError("{kv} calibrates on packed windows only (its K/V scales would count the padding): "
                                "pass {pack}", kv=OptionRef("kv_cache", kv_cache),
                                pack=OptionRef("pack", True, flag="calib_pack"))
    return data


def _rotate(model: nn.Module, cfg) -> None:
    """Fuse ``cfg.rotation`` into the float model (nothing for Rotation.NONE); the report goes on
    ``model.lowbit_rotation`` (None when not rotated)."""
    from lowbit.algorithms.rotate import rotate_model

    model.lowbit_rotation = rotate_model(model, cfg.rotation)


def _calibrate_kv(model: nn.Module, tokens, kv_cache: str, cfg) -> None:
    """The KV-cache scales from a full pass of the weight-quantized model (lowbit.kvcache.calibrate)."""
    from lowbit.kvcache.calibrate import calibrate_kv_cache

    calibrate_kv_cache(model, tokens, kv_cache, batch_size=cfg.batch_size)


def _unquantized(model: nn.Module, left: list, assign: Assignment) -> nn.Module:
    """Leave on the model what stayed in float: ``lowbit_unquantized`` (targets lowbit cannot
    quantize) and ``lowbit_recipe`` (the Assignment of a mixed recipe, None for one scheme)."""
    model.lowbit_unquantized = [name for name, _ in left]
    model.lowbit_recipe = None if assign.uniform is not None else assign
    return model
