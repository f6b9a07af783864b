"""The parts of a ``CalibrationConfig``, each a frozen value that checks its fields when built
from one rule table (``RULES``: a CalibrationError naming the field and what it must be; enum
fields take their values' strings): what calibration runs on (``DataConfig``), how static
activation scales are observed (``ObserverConfig``), SmoothQuant's options (``SmoothingConfig``),
GPTQ's (``GPTQConfig``) and block reconstruction's (``ReconstructionConfig``).

A field keeps the name users pass flat (``CalibrationConfig(num_samples=..., gptq_damping=...)``),
so one option has one name and one default, here. Measurements behind the defaults:
bench/peers/RESULTS.md, bench/quantize/RESULTS-quantize.md, bench/calibrate/RESULTS-calibrate.md.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Callable, ClassVar

from lowbit.algorithms.gptq import WeightRounding
from lowbit.calibration.chat import DEFAULT_CHAT_TEMPLATE, TemplateChoice
from lowbit.calibration.inputs import DEFAULT_PACK
from lowbit.calibration.observers import ActivationObserver
from lowbit.calibration.records import CalibrationError


@dataclass(frozen=True)
class Rule:
    """What a field accepts (``accepts``, named by ``what`` in the error), or the enum its value
    becomes (a string naming a member; None too when ``optional``)."""

    accepts: Callable[[object], bool] | None = None
    what: str = ""
    enum: type | None = None
    optional: bool = False


def _integer(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _optional(accepts):
    return lambda v: v is None or accepts(v)


POSITIVE = Rule(lambda v: _integer(v) and v >= 1, "a positive integer")
FLAG = Rule(lambda v: isinstance(v, bool), "True or False")
NAME = Rule(_optional(lambda v: isinstance(v, str) and v != ""), "a non-empty string or None")


def check_fields(value, rules: dict[str, Rule]) -> None:
    """Coerce ``value``'s enum fields and check the others against ``rules`` (CalibrationError)."""
    for name, rule in rules.items():
        v = getattr(value, name)
        if rule.enum is not None:
            if v is None and rule.optional:
                continue
            try:
                object.__setattr__(value, name, rule.enum(v))
            except ValueError:
                raise CalibrationError(f"unknown {name} {v!r}; known: "
                                       f"{', '.join(k.value for k in rule.enum)}") from None
        elif not rule.accepts(v):
            raise CalibrationError(f"{name} must be {rule.what}, got {v!r}")


class _Checked:
    """A part that checks its fields against its class's ``RULES`` when built."""

    RULES: ClassVar[dict[str, Rule]] = {}

    def __post_init__(self) -> None:
        check_fields(self, self.RULES)


@dataclass(frozen=True)
class DataConfig(_Checked):
    """What calibration runs on. num_samples, seq_len: windows of token ids cut from the text.
    pack: True: the samples are joined and cut into windows of ``seq_len`` real tokens; False: one
    window per sample, right-padded, the padded positions left out of every statistic
    (``lowbit.calibration.windows``). chat_template: how conversations become text: "auto" (the
    tokenizer's own), "none" (message contents only) or a Jinja file's path
    (``lowbit.calibration.chat``). column, split: the field holding the text or messages of
    JSONL/CSV/Parquet/datasets sources and a dataset's split, for sources naming none
    (``CalibrationSource``). batch_size: windows per forward."""

    num_samples: int = 16
    seq_len: int = 512
    pack: bool = DEFAULT_PACK
    chat_template: str = DEFAULT_CHAT_TEMPLATE
    column: str | None = None
    split: str | None = None
    batch_size: int = 4

    RULES: ClassVar = {"num_samples": POSITIVE, "seq_len": POSITIVE, "batch_size": POSITIVE, "pack": FLAG,
                       "column": NAME, "split": NAME}

    def __post_init__(self) -> None:
        super().__post_init__()
        TemplateChoice.parse(self.chat_template)  # 'auto', 'none' or an existing file

    def options(self) -> dict:
        """The ``calibration_set`` keywords (windows, packing, template, fields)."""
        return {k: getattr(self, k) for k in ("num_samples", "seq_len", "pack", "chat_template", "column", "split")}


@dataclass(frozen=True)
class ObserverConfig(_Checked):
    """How static per-tensor activation scales (and the NVFP4 input global scale) are observed.
    observer: "max" (running max), "percentile" or "mse" (MSE-optimal clipping); percentile: the
    percentile observer's; sink_positions: the first positions of every window left out of the
    static scales (attention sinks; they still count for SmoothQuant's statistics);
    max_sample_rows: rows kept per layer input for the MSE observer and the alpha search."""

    observer: ActivationObserver = ActivationObserver.MAX
    percentile: float = 99.99
    sink_positions: int = 0
    max_sample_rows: int = 2048

    RULES: ClassVar = {"observer": Rule(enum=ActivationObserver),
                       "percentile": Rule(lambda v: _number(v) and 0 < v <= 100, "in (0, 100]"),
                       "sink_positions": Rule(lambda v: _integer(v) and v >= 0, "an integer >= 0")}


@dataclass(frozen=True)
class SmoothingConfig(_Checked):
    """SmoothQuant's options (the alpha itself is ``smoothquant=``). smooth_down_proj: also smooth
    up_proj -> down_proj (exact: the MLP is linear in up_proj); auto_alphas: the grid
    ``smoothquant="auto"`` searches."""

    smooth_down_proj: bool = True
    auto_alphas: tuple[float, ...] = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)

    RULES: ClassVar = {"smooth_down_proj": FLAG}


@dataclass(frozen=True)
class GPTQConfig(_Checked):
    """How weights are rounded with calibration data. weight_rounding: "rtn" or "gptq" (each
    column's rounding error compensated on the columns not yet quantized, from the Hessian of the
    linear's inputs; RTN scales, standard files); None: ``default_weight_rounding(scheme)``.
    gptq_damping: fraction of the mean Hessian diagonal added to it; gptq_block_size: columns per
    lazy batch update (speed only); gptq_act_order: columns by decreasing Hessian diagonal;
    gptq_scale_search: the up-front scales searched per group for the smallest Hessian-weighted
    error (None: ``default_gptq_scale_search(scheme)``)."""

    weight_rounding: WeightRounding | None = None
    gptq_damping: float = 0.01
    gptq_block_size: int = 128
    gptq_act_order: bool = False
    gptq_scale_search: bool | None = None

    RULES: ClassVar = {"weight_rounding": Rule(enum=WeightRounding, optional=True),
                       "gptq_damping": Rule(lambda v: _number(v) and 0.0 < v <= 1.0, "a fraction in (0, 1]"),
                       "gptq_block_size": POSITIVE, "gptq_act_order": FLAG,
                       "gptq_scale_search": Rule(_optional(lambda v: isinstance(v, bool)), "True, False or None")}


@dataclass(frozen=True)
class ReconstructionConfig(_Checked):
    """Block reconstruction after each layer is quantized (``lowbit.algorithms.reconstruct``:
    signed-gradient steps re-choosing each weight's rounding to reproduce the float layer's
    output; scales unchanged). reconstruct_iters: steps, 0 off, None:
    ``default_reconstruct_iters(scheme, rounding)``; reconstruct_lr: the first step in grid units
    (None: ``reconstruct.default_lr``); reconstruct_batch_size: windows per step (None: one whole
    calibration batch); reconstruct_scales: also re-choose per-channel / per-group scales."""

    reconstruct_iters: int | None = None
    reconstruct_lr: float | None = None
    reconstruct_batch_size: int | None = 1
    reconstruct_scales: bool = False

    RULES: ClassVar = {
        "reconstruct_iters": Rule(_optional(lambda v: _integer(v) and v >= 0), "an integer >= 0 or None"),
        "reconstruct_lr": Rule(_optional(lambda v: _number(v) and v > 0), "a positive number or None"),
        "reconstruct_batch_size": Rule(_optional(lambda v: _integer(v) and v >= 1), "a positive integer or None"),
        "reconstruct_scales": FLAG,
    }


#: CalibrationConfig's parts: (attribute, class), in the order their fields are checked
PARTS = (("data", DataConfig), ("observing", ObserverConfig), ("smoothing", SmoothingConfig), ("gptq", GPTQConfig),
         ("reconstruction", ReconstructionConfig))

#: a flat option name -> the part holding it
PART_OF = {f.name: part for part, cls in PARTS for f in dataclasses.fields(cls)}
