"""How calibration runs: ``CalibrationConfig``, its presets and its defaults per scheme.

The calibration inputs themselves (token ids from texts, files, datasets, conversations) are
built by ``lowbit.calibration.inputs``; the names below are re-exported from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import torch

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
        left out of the static activation scales (attention sinks: the first position's
        activations can be orders of magnitude above the rest). They still run through the
        model and still count for the SmoothQuant statistics. Default 0 (every position sets
        scales): at run time position 0 still goes through the static scale, and clipping the
        sink cost more than the coarser grid (bench/quantize/RESULTS-quantize.md, "Attention sinks").
    smooth_down_proj: also smooth up_proj -> down_proj (exact: the MLP is linear in up_proj),
        which moves down_proj's channel outliers into up_proj's rows, where per-channel and
        per-group weight scales absorb them at no cost.
    auto_alphas: the grid searched by ``smoothquant="auto"``.
    max_sample_rows: rows kept per layer input for the MSE observer and the alpha search.
    weight_rounding: "rtn" (round to nearest) or "gptq" (GPTQ: each weight column's rounding
        error is compensated on the columns not yet quantized, using the Hessian of the linear's
        calibration inputs; scales are the RTN ones, so files stay standard). With "gptq",
        calibration also runs for weight-only and dynamic-activation schemes (it then only
        feeds the Hessians). Default (None): ``default_weight_rounding(scheme)``, decided on
        SmolLM2-135M perplexity (bench/peers/RESULTS.md, bench/quantize/RESULTS-quantize.md, "GPTQ"):
        - GPTQ for symmetric weights of 4 bits or fewer (w4a16, w4a8-*, nvfp4*, mxfp4*), static
          activation scales or not: given calibration data, GPTQ + 20 reconstruction steps is
          what it is for (SmolLM2 w4a16: RTN +29.18%, GPTQ + 20 steps +6.02% to +8.60% by
          host); w4a16-asym stays RTN (GPTQ takes no zero points);
        - GPTQ for the other schemes with static activation scales whose weights are coarser
          than INT8 (w8a8-fp8): they are calibrated layer by layer anyway, the Hessians come
          from the same pass, and GPTQ measured better for a few more minutes of calibration;
        - RTN for w8a8-int8: its per-channel INT8 grid leaves little error to compensate, and
          GPTQ measured worse with SmoothQuant 0.8;
        - RTN for the other weight-only and dynamic-activation schemes (8- and 6-bit weights,
          w4a16-asym):
          passing calibration data alone keeps them bit for bit equal to plain (and
          model-free) RTN. Ask for "gptq" explicitly.
        Without calibration data weights are always RTN ("gptq" is then an error), and
        ``weight_rounding="rtn"`` with calibration data keeps 4-bit weight-only schemes equal
        to model-free RTN.
    gptq_damping: fraction of the mean Hessian diagonal added to its diagonal (GPTQ's
        "percdamp"; raised tenfold automatically if the Hessian is still not positive definite).
    gptq_block_size: columns per lazy batch update of GPTQ (speed only).
    gptq_act_order: quantize columns by decreasing Hessian diagonal (scales still computed up
        front, per group, so the files keep the standard layout).
    gptq_scale_search: GPTQ's up-front scales searched per group around the scheme's rule
        (full-range -> full-range-mse's candidates, max and mse -> mse's) for the smallest
        squared weight error weighted by each input column's Hessian diagonal (the scheme, its
        observer and the file layout are unchanged; off: RTN's own scales). Default (None):
        ``default_gptq_scale_search(scheme)``: on for symmetric weights of 4 bits or fewer
        (every scheme whose default rounding with calibration data is GPTQ + reconstruction),
        off otherwise. SmolLM2, GPTQ + 20 steps, 16 x 256 tokens, Intel Xeon host
        (bench/peers/RESULTS.md): w4a16 +8.60% with the unweighted search -> +6.03% weighted (auto-round
        tuned iters 200: +6.91%); nvfp4 (mse observer) +18.49% -> +16.44%, nvfp4a16 +5.43% ->
        +3.59%, nvfp4-e5m3 +19.20% -> +16.30%. For RTN alone a search on the plain weight error
        is worse on w4a16 (+29.18% -> +32.55%), so the INT schemes' own observer stays full-range.
    layer_inputs: "quantized": each layer sees the outputs of the already quantized layers
        before it (two passes per layer: observe, then run the quantized layer); "float": the
        float model's activations, one float pass per layer (the observe pass gives the next
        layer's inputs), about half the forward cost; what llm-compressor's one-shot calibration
        observes. Default (None): ``default_layer_inputs(rounding)``: "float" with RTN weights,
        "quantized" with GPTQ: with RTN weights float inputs measured better and about twice
        as fast; with GPTQ the two were within noise, so GPTQ keeps the sequential inputs it is
        defined with (bench/quantize/RESULTS-quantize.md, "Layer inputs").
    reconstruct_iters: after each layer is quantized, signed-gradient steps that re-choose each
        weight's rounding direction to reproduce the float layer's output
        (``lowbit.algorithms.reconstruct``; scales unchanged, so files stay standard); 0: off.
        Default (None): ``default_reconstruct_iters(scheme, rounding)``: 20 steps after GPTQ on
        symmetric weights of 4 bits or fewer (nvfp4, w4a16, ...: their default rounding is
        GPTQ; w4a16: +21.16% -> +7.48% on SmolLM2, +6.02% with GPTQ's scale search), 0
        otherwise. nvfp4, 16 x 256 tokens, GPTQ alone
        vs + 20 steps: SmolLM2 +30.12% -> +19.39% (462 CPU-s, ~9x), Gemma-3-270M +18.89% ->
        +16.74% (bench/peers/RESULTS.md).
    reconstruct_batch_size: calibration windows per reconstruction step (each step runs forward and
        backward on the next ``reconstruct_batch_size`` windows, strided over the set); default 1;
        None: one whole calibration batch of ``batch_size`` windows per step. One window a step
        costs a quarter of the steps' compute at the same perplexity: SmolLM2, GPTQ + 20 steps,
        16 x 512 tokens, perplexity on the whole built-in evaluation text (26895 tokens), 4 windows
        -> 1 window a step: nvfp4 +14.32% -> +14.29% (328 -> 156 s), nvfp4-e5m3 +14.77% -> +14.93%
        (314 -> 148 s), AMD EPYC AVX-512, 2 cores (bench/calibrate/RESULTS-calibrate.md).
    reconstruct_lr: the first step, in grid units (default None:
        ``lowbit.algorithms.reconstruct.default_lr``: min(1 / reconstruct_iters, 0.02)).
    reconstruct_scales: reconstruction also re-chooses each per-channel / per-group weight scale
        among the scale format's values (a coefficient 0.5-1 of the block's amax scale).
    rotation: "none" or "hadamard": Hadamard rotations fused into the float model's weights once,
        before SmoothQuant and calibration (``lowbit.algorithms.rotate``: R1 on the residual
        stream, R2 per attention head; exact in float, saved as an ordinary checkpoint with an
        untied lm_head). Applies with and without calibration data; SmoothQuant may follow it (it
        folds into the rotated weights as into any others). Default "none" (bench/peers/RESULTS.md,
        "Hadamard rotation (fused R1/R2)").
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
        if self.num_samples < 1 or self.seq_len < 1 or self.batch_size < 1:
            raise CalibrationError("num_samples, seq_len and batch_size must be positive")
        self._coerce("observer", ActivationObserver, optional=False)
        if not isinstance(self.pack, bool):
            raise CalibrationError(f"pack must be True or False, got {self.pack!r}")
        TemplateChoice.parse(self.chat_template)  # 'auto', 'none' or an existing file
        for name in ("column", "split"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise CalibrationError(f"{name} must be a non-empty string or None, got {v!r}")
        if not 0 < self.percentile <= 100:
            raise CalibrationError(f"percentile must be in (0, 100], got {self.percentile}")
        if self.sink_positions < 0:
            raise CalibrationError(f"sink_positions must be >= 0, got {self.sink_positions}")
        self._coerce("weight_rounding", WeightRounding)
        if isinstance(self.gptq_damping, bool) or not isinstance(self.gptq_damping, (int, float)) \
                or not 0.0 < self.gptq_damping <= 1.0:
            raise CalibrationError(f"gptq_damping must be a fraction in (0, 1], got {self.gptq_damping!r}")
        if isinstance(self.gptq_block_size, bool) or not isinstance(self.gptq_block_size, int) \
                or self.gptq_block_size < 1:
            raise CalibrationError(f"gptq_block_size must be a positive integer, got {self.gptq_block_size!r}")
        self._coerce("layer_inputs", LayerInputs)
        self._coerce("rotation", Rotation, optional=False)
        if self.reconstruct_iters is not None and (
                isinstance(self.reconstruct_iters, bool) or not isinstance(self.reconstruct_iters, int)
                or self.reconstruct_iters < 0):
            raise CalibrationError(f"reconstruct_iters must be an integer >= 0, got {self.reconstruct_iters!r}")
        if self.reconstruct_lr is not None and not (isinstance(self.reconstruct_lr, (int, float))
                                                    and not isinstance(self.reconstruct_lr, bool)
                                                    and self.reconstruct_lr > 0):
            raise CalibrationError(f"reconstruct_lr must be a positive number, got {self.reconstruct_lr!r}")
        if self.reconstruct_batch_size is not None and (
                isinstance(self.reconstruct_batch_size, bool) or not isinstance(self.reconstruct_batch_size, int)
                or self.reconstruct_batch_size < 1):
            raise CalibrationError(f"reconstruct_batch_size must be a positive integer or None, "
                                   f"got {self.reconstruct_batch_size!r}")
        if self.gptq_scale_search is not None and not isinstance(self.gptq_scale_search, bool):
            raise CalibrationError(f"gptq_scale_search must be True, False or None, got {self.gptq_scale_search!r}")
        if not isinstance(self.gptq_act_order, bool):
            raise CalibrationError(f"gptq_act_order must be True or False, got {self.gptq_act_order!r}")
        if not isinstance(self.reconstruct_scales, bool):
            raise CalibrationError(f"reconstruct_scales must be True or False, got {self.reconstruct_scales!r}")

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
