"""How calibration runs: ``CalibrationConfig``, its presets and its defaults per scheme.

The calibration inputs themselves (token ids from texts, files, datasets, conversations) are
built by ``lowbit.calibration.inputs``; the names below are re-exported from there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from lowbit.calibration.config_parts import (
    PART_OF, PARTS, DataConfig, GPTQConfig, ObserverConfig, ReconstructionConfig, Rule, SmoothingConfig, check_fields,
)
from lowbit.calibration.inputs import calibration_set, calibration_tokens, read_paragraphs, token_ids
from lowbit.calibration.windows import windows
from lowbit.calibration.records import CalibrationError
from lowbit.calibration.sources import BUILTIN, CalibrationSource
from lowbit.algorithms.gptq import GPTQOptions, WeightRounding
from lowbit.algorithms.rotate.options import DEFAULT_ROTATION, Rotation
from lowbit.schemes import Scheme
from lowbit.textfiles import builtin_calibration_text_path

__all__ = ["BUILTIN", "CalibrationError", "CalibrationSource", "calibration_set", "calibration_tokens", "windows",
           "read_paragraphs", "token_ids", "CalibrationConfig", "LayerInputs", "CALIBRATION_PRESETS", "DataConfig",
           "ObserverConfig", "SmoothingConfig", "GPTQConfig", "ReconstructionConfig"]


class LayerInputs(str, Enum):
    """What each decoder layer is calibrated on (see ``CalibrationConfig.layer_inputs``)."""

    QUANTIZED = "quantized"  # the outputs of the layers before it, already quantized
    FLOAT = "float"          # the float model's activations (one float forward per layer)

    def __str__(self) -> str:
        return self.value


class _Flat:
    """A flat option of ``CalibrationConfig`` read from its part: on the class its one default
    (the part's), on a config its value."""

    def __init__(self, part: str, name: str) -> None:
        self.part, self.name = part, name

    def __get__(self, config, owner=None):
        if config is None:
            return getattr(dict(PARTS)[self.part], self.name)
        return getattr(getattr(config, self.part), self.name)


@dataclass(frozen=True, init=False)
class CalibrationConfig:
    """How calibration runs, in parts (``lowbit.calibration.config_parts``): ``data`` (what it runs
    on), ``observing`` (static activation scales), ``smoothing`` (SmoothQuant's options), ``gptq``
    (weight rounding), ``reconstruction`` (block reconstruction), and two choices of its own:

    layer_inputs: "quantized": each layer sees the outputs of the already quantized layers before
        it (two passes per layer); "float": the float model's activations, one float pass per
        layer. Default (None): ``default_layer_inputs(rounding)``.
    rotation: "none" or "hadamard": Hadamard rotations fused into the float model's weights once,
        before SmoothQuant and calibration (``lowbit.algorithms.rotate``). Default "none".

    Built from the parts, or flat: ``CalibrationConfig(num_samples=4, weight_rounding="gptq")``
    puts each option in its part (an unknown name is a TypeError), and ``config.num_samples``
    reads it there (``CalibrationConfig.num_samples``: its default). Every field is checked when
    built (CalibrationError naming it). Why the defaults: bench/peers/RESULTS.md,
    bench/quantize/RESULTS-quantize.md, bench/calibrate/RESULTS-calibrate.md.
    """

    data: DataConfig
    observing: ObserverConfig
    smoothing: SmoothingConfig
    gptq: GPTQConfig
    reconstruction: ReconstructionConfig
    layer_inputs: LayerInputs | None
    rotation: Rotation

    def __init__(self, *, data: DataConfig | None = None, observing: ObserverConfig | None = None,
                 smoothing: SmoothingConfig | None = None, gptq: GPTQConfig | None = None,
                 reconstruction: ReconstructionConfig | None = None, layer_inputs: LayerInputs | str | None = None,
                 rotation: Rotation | str = DEFAULT_ROTATION, **options) -> None:
        unknown = [k for k in options if k not in PART_OF]
        if unknown:
            raise TypeError(f"CalibrationConfig() got an unexpected keyword argument {unknown[0]!r}")
        given = {"data": data, "observing": observing, "smoothing": smoothing, "gptq": gptq,
                 "reconstruction": reconstruction}
        for part, cls in PARTS:
            mine = {k: v for k, v in options.items() if PART_OF[k] == part}
            base = given[part] if given[part] is not None else cls()
            object.__setattr__(self, part, dataclasses.replace(base, **mine) if mine else base)
        object.__setattr__(self, "layer_inputs", layer_inputs)
        object.__setattr__(self, "rotation", rotation)
        check_fields(self, _OWN_RULES)

    @classmethod
    def preset(cls, name: str, **overrides) -> "CalibrationConfig":
        """The named preset of ``CALIBRATION_PRESETS`` with ``overrides`` (fields) on top."""
        if name not in CALIBRATION_PRESETS:
            raise CalibrationError(f"unknown calibration preset {name!r}; known: {', '.join(CALIBRATION_PRESETS)}")
        return cls(**{**CALIBRATION_PRESETS[name], **overrides})

    def data_options(self) -> dict:
        """The ``calibration_set`` keywords of this config (windows, packing, template, fields)."""
        return self.data.options()

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


#: CalibrationConfig's own fields' rules (its parts check theirs)
_OWN_RULES = {"layer_inputs": Rule(enum=LayerInputs, optional=True), "rotation": Rule(enum=Rotation)}

for _name, _part in PART_OF.items():  # the flat options, read from their parts
    setattr(CalibrationConfig, _name, _Flat(_part, _name))


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
    # extra steps overfit (bench/peers/RESULTS.md, "`best` on 64 calibration windows").
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


DEFAULT_RECONSTRUCT_ITERS = 20  # after GPTQ on coarse weights: bench/peers/RESULTS.md


def default_reconstruct_iters(scheme: Scheme, rounding: WeightRounding) -> int:
    """Reconstruction steps when none are asked for (see ``CalibrationConfig.reconstruct_iters``):
    ``DEFAULT_RECONSTRUCT_ITERS`` after GPTQ on symmetric weights of 4 bits or fewer (whose
    default rounding is GPTQ given calibration data), else 0 (measured against GPTQ alone and
    auto-round's tuning: bench/peers/RESULTS.md)."""
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
