"""A checkpoint run's arguments resolved once into a ``CheckpointPlan``: the recipe (one scheme is a
recipe with a default only), the checkpoint format checked against every scheme it names, each
scheme's SmoothQuant alpha, the CalibrationConfig, and the path: streamed (some linear gets a
scheme that calibrates, and calibration data is given) or model-free (nothing calibrates).

``lowbit.quantize_checkpoint`` and ``lowbit quantize`` (its streamed and model-free paths) build
the plan with ``plan_checkpoint`` and run it with ``run_checkpoint``; nothing after the plan
decides again. The checks run in the order they always ran, so the first error is the same.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from lowbit.algorithms.smoothquant.defaults import DEFAULT
from lowbit.errors import OptionRef, QuantizationError
from lowbit.run_path import RunPath


@dataclass(frozen=True)
class CalibrationChoice:
    """How the run calibrates, as given: the data (``calibration=``), its tokenizer (None: the
    source folder's), the SmoothQuant choice, and a CalibrationConfig, or a preset name and/or
    its fields (``lowbit.calibration.config.calibration_config``)."""

    data: object = None
    tokenizer: object = None
    smoothquant: object = DEFAULT
    config: object = None
    preset: str | None = None
    options: dict = field(default_factory=dict)


@dataclass(frozen=True)
class TargetChoice:
    """Which weights are quantized: linears kept in float (exact names or regexes), the output
    head, and whether targets lowbit cannot quantize stay in float (listed) instead of an error."""

    ignore: tuple[str, ...] = ()
    include_lm_head: bool = False
    allow_unquantized: bool = False


@dataclass(frozen=True)
class RunSettings:
    """How the run goes (not what it writes): resume a killed run, replace the output, progress
    bars, the torch device, activations kept on the CPU (``offload``), model-free worker count and
    ``RunOptions``, and the ranks (``lowbit.dist.Group``; None: ``Group.join``)."""

    resume: bool = True
    overwrite: bool = False
    progress: bool | None = None
    device: str | None = None
    offload: bool = False
    workers: int = 2
    run_options: object = None
    group: object = None


@dataclass(frozen=True)
class CheckpointPlan:
    """One checkpoint run, decided. ``planned`` (streamed only): the source's skeleton with the
    recipe resolved on its linears (``lowbit.streamed.planned.Planned``; ``run_checkpoint``
    closes it). ``config``: the CalibrationConfig; ``alphas``: each scheme's SmoothQuant alpha."""

    source: Path
    output: Path
    recipe: object
    checkpoint_format: object
    alphas: dict
    config: object
    calibration: CalibrationChoice
    targets: TargetChoice
    settings: RunSettings
    planned: object = None

    @property
    def path(self) -> RunPath:
        return RunPath.STREAMED if self.planned is not None else RunPath.MODEL_FREE

    @property
    def ignore(self) -> list[str]:
        return list(self.targets.ignore)

    def smoothquant(self):
        """What the calibrator takes: one alpha, or scheme -> alpha (a mixed recipe)."""
        return self.planned.smoothquant(self.alphas)


def plan_checkpoint(src, out, scheme, checkpoint_format, calibration: CalibrationChoice = CalibrationChoice(),
                    targets: TargetChoice = TargetChoice(), settings: RunSettings = RunSettings()) -> CheckpointPlan:
    """The plan of a run quantizing folder ``src`` into ``out`` with ``scheme`` (a preset name,
    Scheme or anything ``Recipe.of`` takes) in ``checkpoint_format``. SchemeError / RecipeError /
    FormatError / QuantizationError naming the option before anything is written."""
    from lowbit.algorithms.gptq import WeightRounding
    from lowbit.algorithms.rotate.options import DEFAULT_ROTATION
    from lowbit.calibration.config import calibration_config
    from lowbit.formats import Format, get_layout
    from lowbit.recipes.plan import recipe_of
    from lowbit.streamed.planned import alphas_of, calibrating, open_planned

    recipe = recipe_of(scheme)  # SchemeError / RecipeError, before anything is read
    checkpoint_format = Format.parse(checkpoint_format)
    for s in recipe.schemes:
        get_layout(checkpoint_format).check_scheme(s)
    alphas = alphas_of(recipe.schemes, calibration.smoothquant)
    cfg = calibration_config(calibration.config, calibration.preset, calibration.options)
    if cfg.rotation is not DEFAULT_ROTATION:
        raise QuantizationError(f"rotation={cfg.rotation.value!r} rewrites the embeddings, every layer and lm_head "
                                f"together, which a run streamed one layer at a time (or model-free) cannot do: "
                                f"quantize in memory (lowbit.quantize, then lowbit.save)")
    plan = CheckpointPlan(Path(src), Path(out), recipe, checkpoint_format, alphas, cfg, calibration, targets, settings)
    if calibration.data is not None and calibrating(recipe.schemes, alphas, cfg):
        if targets.include_lm_head:
            raise QuantizationError("a calibrated output head is not streamed yet: drop {head}, or quantize in "
                                    "memory (lowbit.quantize, then lowbit.save)", head=OptionRef("include_lm_head"))
        planned = open_planned(Path(src), recipe, list(targets.ignore))  # the recipe resolved (lowbit.recipes.plan)
        if calibrating(planned.schemes, alphas, cfg):
            return dataclasses.replace(plan, planned=planned)
        planned.close()  # no linear got a scheme that calibrates: round-to-nearest, as in memory
    # model-free: it refuses schemes that need calibration, naming the dynamic alternatives
    # (asked for: without calibration data the 4-bit schemes' default GPTQ is plain RTN)
    if calibration.data is None and not any(s.needs_calibration for s in recipe.schemes) and (
            any(a is not None for a in alphas.values()) or cfg.weight_rounding is WeightRounding.GPTQ):
        raise QuantizationError(f"{recipe.label} with SmoothQuant or GPTQ needs calibration data (pass "
                                f"{{calibration}})", calibration=OptionRef("calibration", "builtin"))
    return plan


def run_checkpoint(plan: CheckpointPlan):
    """Run ``plan``: the ``StreamResult`` of what was done (model-free: the output and peak RSS)."""
    from lowbit.streamed.api import StreamResult, peak_rss_bytes

    if plan.path is RunPath.STREAMED:
        from lowbit.streamed.run import streamed

        return streamed(plan)
    from lowbit.modelfree import quantize_model_free

    s, t = plan.settings, plan.targets
    path = quantize_model_free(plan.source, plan.output, plan.recipe, plan.checkpoint_format.value,
                               workers=s.workers, ignore=t.ignore, include_lm_head=t.include_lm_head, resume=s.resume,
                               overwrite=s.overwrite, progress=s.progress, device=s.device,
                               run_options=s.run_options, group=s.group)
    return StreamResult(Path(path), {}, peak_rss=peak_rss_bytes())
