"""How calibration runs: ``CalibrationConfig``, its presets and its defaults per scheme.

The calibration inputs themselves (token ids from texts, files, datasets, conversations) are
built by ``lowbit.calibration.inputs``; the names below are re-exported from there.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from lowbit.calibration.chat import DEFAULT_CHAT_TEMPLATE, TemplateChoice
from lowbit.calibration.inputs import DEFAULT_PACK, calibration_set, calibration_tokens, read_paragraphs, token_ids
from lowbit.calibration.observers import ActivationObserver
from lowbit.calibration.windows import windows
from lowbit.calibration.records import CalibrationError
from lowbit.calibration.sources import BUILTIN, CalibrationSource
from lowbit.algorithms.gptq import GPTQOptions, WeightRounding
from lowbit.algorithms.rotate.options import DEFAULT_ROTATION, Rotation
from lowbit.schemes import Scheme
from lowbit.textfiles import builtin_calibration_text_path

__all__ = ["BUILTIN", "CalibrationError", "CalibrationSource", "calibration_set", "calibration_tokens", "windows",
           "read_paragraphs", "token_ids", "CalibrationConfig", "LayerInputs", "CALIBRATION_PRESETS"]


class LayerInputs(str, Enum):
    """What each decoder layer is calibrated on (see ``CalibrationConfig.layer_inputs``)."""

    QUANTIZED = "quantized"  # the outputs of the layers before it, already quantized
    FLOAT = "float"          # the float model's activations (one float forward per layer)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class CalibrationConfig:
    """How calibration runs. The defaults are sized for a 135M model on 2 CPU cores (times in
    bench/peers/RESULTS.md and bench/quantize/RESULTS-quantize.md).

    num_samples, seq_len: windows of token ids cut from the text.
    pack: True (the default): the samples are joined and cut into windows of ``seq_len`` real
        tokens (as auto-round concatenates samples); False: one window per sample, right-padded,
        the padded positions left out of every statistic (observers, SmoothQuant, GPTQ Hessians,
        reconstruction losses; ``lowbit.calibration.windows``).
    chat_template: how conversations become text: "auto" (the tokenizer's own template), "none"
        (message contents only) or a Jinja file's path (``lowbit.calibration.chat``).
    column, split: the field holding the text or the messages of JSONL/CSV/Parquet/datasets
        sources (default: ``text``, else ``messages``) and a dataset's split (default: its only
        one, else ``train``), for the sources that name none (``CalibrationSource``).
    batch_size: windows per forward.
    observer: "max" (running max), "percentile" or "mse" (MSE-optimal clipping) for static
        per-tensor activation scales (and the NVFP4 input global scale).
    percentile: for the percentile observer.
    sink_positions: the first ``sink_positions`` positions of every calibration window are
        left out of the static activation scales (attention sinks); they still run through the
        model and count for the SmoothQuant statistics. Default 0: at run time position 0 still
        goes through the static scale (bench/quantize/RESULTS-quantize.md, "Attention sinks").
    smooth_down_proj: also smooth up_proj -> down_proj (exact: the MLP is linear in up_proj),
        which moves down_proj's channel outliers into up_proj's rows, where per-channel and
        per-group weight scales absorb them at no cost.
    auto_alphas: the grid searched by ``smoothquant="auto"``.
    max_sample_rows: rows kept per layer input for the MSE observer and the alpha search.
    weight_rounding: "rtn" (round to nearest) or "gptq" (each weight column's rounding error
        compensated on the columns not yet quantized, using the Hessian of the linear's calibration
        inputs; scales are the RTN ones, so files stay standard). With "gptq", calibration also runs
        for weight-only and dynamic-activation schemes (it then only feeds the Hessians). Default
        (None): ``default_weight_rounding(scheme)``: GPTQ for symmetric weights of 4 bits or fewer
        and for static-activation schemes with weights coarser than INT8 (w8a8-fp8); RTN for
        w8a8-int8, 8- and 6-bit weight-only and dynamic schemes, and w4a16-asym (GPTQ takes no
        zero points). Without calibration data weights are always RTN ("gptq" is then an error);
        ``"rtn"`` with calibration data keeps weight-only schemes equal to model-free RTN. Why each
        default: bench/quantize/RESULTS-quantize.md ("GPTQ"), bench/peers/RESULTS.md.
    gptq_damping: fraction of the mean Hessian diagonal added to its diagonal (GPTQ's
        "percdamp"; raised tenfold automatically if the Hessian is still not positive definite).
    gptq_block_size: columns per lazy batch update of GPTQ (speed only).
    gptq_act_order: quantize columns by decreasing Hessian diagonal (scales still computed up
        front, per group, so the files keep the standard layout).
    gptq_scale_search: GPTQ's up-front scales searched per group around the scheme's rule
        (full-range -> full-range-mse's candidates, max and mse -> mse's) for the smallest squared
        weight error weighted by each input column's Hessian diagonal (scheme, observer and file
        layout unchanged). Default (None): ``default_gptq_scale_search(scheme)``: on for symmetric
        weights of 4 bits or fewer, off otherwise (measured: bench/peers/RESULTS.md).
    layer_inputs: "quantized": each layer sees the outputs of the already quantized layers before
        it (two passes per layer); "float": the float model's activations, one float pass per
        layer (what llm-compressor's one-shot calibration observes). Default (None):
        ``default_layer_inputs(rounding)``: "float" with RTN weights, "quantized" with GPTQ
        (bench/quantize/RESULTS-quantize.md, "Layer inputs").
    reconstruct_iters: after each layer is quantized, signed-gradient steps that re-choose each
        weight's rounding direction to reproduce the float layer's output
        (``lowbit.algorithms.reconstruct``; scales unchanged, files standard); 0: off. Default
        (None): ``default_reconstruct_iters(scheme, rounding)``: 20 steps after GPTQ on symmetric
        weights of 4 bits or fewer, 0 otherwise (bench/peers/RESULTS.md).
    reconstruct_batch_size: calibration windows per reconstruction step (each step runs forward
        and backward on the next ``reconstruct_batch_size`` windows, strided over the set); default
        1; None: one whole calibration batch of ``batch_size`` windows per step
        (bench/calibrate/RESULTS-calibrate.md).
    reconstruct_lr: the first step, in grid units (default None:
        ``lowbit.algorithms.reconstruct.default_lr``: min(1 / reconstruct_iters, 0.02)).
    reconstruct_scales: reconstruction also re-chooses each per-channel / per-group weight scale
        among the scale format's values (a coefficient 0.5-1 of the block's amax scale).
    rotation: "none" or "hadamard": Hadamard rotations fused into the float model's weights once,
        before SmoothQuant and calibration (``lowbit.algorithms.rotate``: R1 on the residual
        stream, R2 per attention head; exact in float, saved as an ordinary checkpoint with an
        untied lm_head). Default "none" (bench/peers/RESULTS.md, "Hadamard rotation (fused R1/R2)").

    Every field is checked when the config is built (``_FIELD_RULES``: a CalibrationError naming
    the field and what it must be); enum fields take their values' strings.
    """

    num_samples: int = 16
    seq_len: int = 512
    pack: bool = DEFAULT_PACK
    chat_template: str = DEFAULT_CHAT_TEMPLATE
    column: str | None = None
    split: str | None = None
    batch_size: int = 4
    observer: ActivationObserver = ActivationObserver.MAX
    percentile: float = 99.99
    sink_positions: int = 0
    smooth_down_proj: bool = True
    auto_alphas: tuple[float, ...] = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    max_sample_rows: int = 2048
    weight_rounding: WeightRounding | None = None
    gptq_damping: float = 0.01
    gptq_block_size: int = 128
    gptq_act_order: bool = False
    gptq_scale_search: bool | None = None
    layer_inputs: LayerInputs | None = None
    reconstruct_iters: int | None = None
    reconstruct_lr: float | None = None
    reconstruct_batch_size: int | None = 1
    reconstruct_scales: bool = False
    rotation: Rotation = DEFAULT_ROTATION

    def __post_init__(self) -> None:
        for name, enum, optional in _ENUM_FIELDS:
            self._coerce(name, enum, optional)
        for name, (accepts, what) in _FIELD_RULES.items():
            value = getattr(self, name)
            if not accepts(value):
                raise CalibrationError(f"{name} must be {what}, got {value!r}")
        TemplateChoice.parse(self.chat_template)  # 'auto', 'none' or an existing file

    def _coerce(self, field: str, enum, optional: bool = True) -> None:
        """Field ``field`` as a member of ``enum`` (None stays None when ``optional``), or a
        CalibrationError naming the field and its choices."""
        value = getattr(self, field)
        if value is None and optional:
            return
        try:
            object.__setattr__(self, field, enum(value))
        except ValueError:
            raise CalibrationError(f"unknown {field} {value!r}; known: "
                                   f"{', '.join(k.value for k in enum)}") from None

    @classmethod
    def preset(cls, name: str, **overrides) -> "CalibrationConfig":
        """The named preset of ``CALIBRATION_PRESETS`` with ``overrides`` (fields) on top."""
        if name not in CALIBRATION_PRESETS:
            raise CalibrationError(f"unknown calibration preset {name!r}; known: {', '.join(CALIBRATION_PRESETS)}")
        return cls(**{**CALIBRATION_PRESETS[name], **overrides})

    def data_options(self) -> dict:
        """The ``calibration_set`` keywords of this config (windows, packing, template, fields)."""
        return {"num_samples": self.num_samples, "seq_len": self.seq_len, "pack": self.pack,
                "chat_template": self.chat_template, "column": self.column, "split": self.split}

    def rounding_for(self, scheme: Scheme) -> WeightRounding:
        """The weight rounding used for ``scheme`` when calibration data is given: the one asked
        for, else ``default_weight_rounding(scheme)``."""
        return self.weight_rounding if self.weight_rounding is not None else default_weight_rounding(scheme)

    def inputs_for(self, scheme: Scheme) -> LayerInputs:
        """What layers are calibrated on for ``scheme``: the one asked for, else
        ``default_layer_inputs(self.rounding_for(scheme))``."""
        return self.layer_inputs if self.layer_inputs is not None else default_layer_inputs(self.rounding_for(scheme))

    def inputs_for_all(self, schemes: list[Scheme]) -> LayerInputs:
        """What layers are calibrated on for linears of ``schemes``: ``inputs_for`` of each; with
        several schemes whose defaults differ, the quantized model's outputs (what the GPTQ or
        reconstructed schemes want; the others' static scales are then set on the inputs they see)."""
        seen = {self.inputs_for(s) for s in schemes}
        return seen.pop() if len(seen) == 1 else LayerInputs.QUANTIZED

    def reconstruct_iters_for(self, scheme: Scheme) -> int:
        """Reconstruction steps per layer for ``scheme``: the number asked for, else
        ``default_reconstruct_iters(scheme, self.rounding_for(scheme))``."""
        if self.reconstruct_iters is not None:
            return self.reconstruct_iters
        return default_reconstruct_iters(scheme, self.rounding_for(scheme))

    def reconstruct_options(self, scheme: Scheme):
        """The block-reconstruction options for ``scheme``, None when it is off."""
        from lowbit.algorithms.reconstruct import ReconstructOptions

        iters = self.reconstruct_iters_for(scheme)
        if iters <= 0:
            return None
        return ReconstructOptions(iters=iters, lr=self.reconstruct_lr, scales=self.reconstruct_scales,
                                  batch_size=self.reconstruct_batch_size)

    def gptq_scale_search_for(self, scheme: Scheme) -> bool:
        """Whether GPTQ searches its up-front scales for ``scheme``: as asked, else
        ``default_gptq_scale_search(scheme)``."""
        return self.gptq_scale_search if self.gptq_scale_search is not None else default_gptq_scale_search(scheme)

    def gptq_options(self, scheme: Scheme) -> GPTQOptions:
        return GPTQOptions(damping=float(self.gptq_damping), block_size=self.gptq_block_size,
                           act_order=self.gptq_act_order, scale_search=self.gptq_scale_search_for(scheme))


def _integer(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _optional(accepts):
    return lambda v: v is None or accepts(v)


#: each field's rule and how its error names what it must be: the whole validation of a config
_FIELD_RULES = {
    "num_samples": (lambda v: _integer(v) and v >= 1, "a positive integer"),
    "seq_len": (lambda v: _integer(v) and v >= 1, "a positive integer"),
    "batch_size": (lambda v: _integer(v) and v >= 1, "a positive integer"),
    "pack": (lambda v: isinstance(v, bool), "True or False"),
    "column": (_optional(lambda v: isinstance(v, str) and v != ""), "a non-empty string or None"),
    "split": (_optional(lambda v: isinstance(v, str) and v != ""), "a non-empty string or None"),
    "percentile": (lambda v: _number(v) and 0 < v <= 100, "in (0, 100]"),
    "sink_positions": (lambda v: _integer(v) and v >= 0, "an integer >= 0"),
    "gptq_damping": (lambda v: _number(v) and 0.0 < v <= 1.0, "a fraction in (0, 1]"),
    "gptq_block_size": (lambda v: _integer(v) and v >= 1, "a positive integer"),
    "gptq_act_order": (lambda v: isinstance(v, bool), "True or False"),
    "gptq_scale_search": (_optional(lambda v: isinstance(v, bool)), "True, False or None"),
    "reconstruct_iters": (_optional(lambda v: _integer(v) and v >= 0), "an integer >= 0 or None"),
    "reconstruct_lr": (_optional(lambda v: _number(v) and v > 0), "a positive number or None"),
    "reconstruct_batch_size": (_optional(lambda v: _integer(v) and v >= 1), "a positive integer or None"),
    "reconstruct_scales": (lambda v: isinstance(v, bool), "True or False"),
}

#: (field, enum, None allowed): string values become the enum's members
_ENUM_FIELDS = (("observer", ActivationObserver, False), ("weight_rounding", WeightRounding, True),
                ("layer_inputs", LayerInputs, True), ("rotation", Rotation, False))


# Named calibration budgets (CalibrationConfig.preset, lowbit.quantize(..., preset=), CLI --calib-preset),
# one per trade-off; measured on SmolLM2 in bench/peers/RESULTS.md ("Calibration presets").
CALIBRATION_PRESETS: dict[str, dict] = {
    # round-to-nearest weights on 4 windows of 128 tokens, float layer inputs (one forward per
    # layer): static scales only, seconds on a small model
    "fast": {"weight_rounding": "rtn", "layer_inputs": "float", "num_samples": 4, "seq_len": 128,
             "reconstruct_iters": 0},
    # CalibrationConfig's own defaults, by name
    "default": {},
    # GPTQ on a small budget, for INT8 weights: 4 windows of 128 tokens, float layer inputs (one
    # forward per layer). A per-channel INT8 grid leaves little error to compensate, and more
    # tokens did not help reliably; most of its time is GPTQ's fixed cost (Hessian
    # factorizations, block updates), not the tokens (bench/peers/RESULTS.md, "gptq-fast").
    "gptq-fast": {"weight_rounding": "gptq", "layer_inputs": "float", "num_samples": 4, "seq_len": 128,
                  "reconstruct_iters": 0},
    # block-output reconstruction (lowbit.algorithms.reconstruct) of every decoder layer toward
    # the float model's outputs, from GPTQ's codes, on the quantized layers' outputs, 50 steps on
    # 4x the default's calibration windows (64 x 512 tokens): the most accurate. Each step takes one
    # batch, so the windows cost the forward passes, not the steps; on the default's 16 windows the
    # extra steps overfit (SmolLM2, 16 x 256 tokens, Intel host: nvfp4 +17.31% against the default's
    # +16.44%; with 64 x 256 +15.24%; bench/peers/RESULTS.md, "`best` on 64 calibration windows").
    # Its steps take a whole batch (4 windows) each, as measured there: 50 steps of one window
    # would not visit all 64 windows.
    "best": {"weight_rounding": "gptq", "layer_inputs": "quantized", "reconstruct_iters": 50, "num_samples": 64,
             "reconstruct_batch_size": None},
}


def calibration_config(config, preset: str | None, options: dict) -> CalibrationConfig:
    """``config``, or the named ``preset`` with ``options`` over its fields, or a CalibrationConfig
    of ``options``: how ``lowbit.quantize``, ``auto_recipe`` and the streamed run read their
    calibration arguments. QuantizationError for both a config and a preset/options, or an
    unknown field."""
    from lowbit.errors import QuantizationError

    if config is not None and (options or preset is not None):
        raise QuantizationError("pass either config=CalibrationConfig(...) or a preset and/or its fields, not both")
    try:
        if config is not None:
            return config
        return CalibrationConfig.preset(preset, **options) if preset is not None else CalibrationConfig(**options)
    except TypeError as e:
        raise QuantizationError(f"unknown calibration option: {e}") from None


def default_layer_inputs(rounding: WeightRounding) -> LayerInputs:
    """Layer inputs when none are asked for (see ``CalibrationConfig.layer_inputs``)."""
    return LayerInputs.QUANTIZED if rounding is WeightRounding.GPTQ else LayerInputs.FLOAT


DEFAULT_RECONSTRUCT_ITERS = 20  # nvfp4 GPTQ alone -> + 20 steps: SmolLM2 +30.12% -> +19.39%, Gemma-3 +18.89% -> +16.74%


def default_reconstruct_iters(scheme: Scheme, rounding: WeightRounding) -> int:
    """Reconstruction steps when none are asked for (see ``CalibrationConfig.reconstruct_iters``):
    ``DEFAULT_RECONSTRUCT_ITERS`` after GPTQ on symmetric weights of 4 bits or fewer (whose
    default rounding is GPTQ given calibration data), else 0. w4a16, SmolLM2, 16 x 256 tokens: GPTQ +21.16%
    -> + 20 steps +7.48% in 281.7 CPU-s (auto-round tuned iters 200: +7.08% in 1198.4)."""
    w = scheme.weights
    coarse = w.bits <= 4 and w.symmetric
    return DEFAULT_RECONSTRUCT_ITERS if rounding is WeightRounding.GPTQ and coarse else 0


def default_gptq_scale_search(scheme: Scheme) -> bool:
    """GPTQ's scale search when none is asked for (see ``CalibrationConfig.gptq_scale_search``):
    on for symmetric weights of 4 bits or fewer, the ones GPTQ + reconstruction rounds by
    default (``default_weight_rounding``)."""
    w = scheme.weights
    return w.symmetric and w.bits <= 4


def default_weight_rounding(scheme: Scheme) -> WeightRounding:
    """Weight rounding when calibration data is given and none is asked for (see
    ``CalibrationConfig.weight_rounding``): GPTQ for symmetric weights of 4 bits or fewer, and for
    static-activation schemes with weights coarser than INT8; RTN otherwise (GPTQ takes no zero
    points, so w4a16-asym stays RTN). Without calibration data it is always RTN."""
    w = scheme.weights
    int8_or_finer = w.is_integer and w.bits >= 8
    coarse = w.bits <= 4 and w.symmetric
    return WeightRounding.GPTQ if coarse or (scheme.needs_calibration and not int8_or_finer) else WeightRounding.RTN


def builtin_text_path() -> Path:
    return builtin_calibration_text_path()
