"""A checkpoint run's arguments resolved once into a ``CheckpointPlan``: the ``Method`` (the recipe,
one scheme being its uniform case; each scheme's SmoothQuant alpha; the CalibrationConfig: the
resolve step ``lowbit.method.resolve_method`` every path shares), the checkpoint format checked
against every scheme the recipe names, and the path: streamed (some linear gets a scheme that
calibrates, and calibration data is given) or model-free (nothing calibrates).

``lowbit.quantize_checkpoint`` and ``lowbit quantize`` (its streamed and model-free paths) build
the plan with ``plan_checkpoint`` (or, with a Method already resolved, ``checkpoint_plan_of``) and
run it with ``run_checkpoint``; nothing after the plan decides again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from lowbit.errors import OptionRef, QuantizationError
from lowbit.method import CalibrationChoice, Method, TargetChoice, resolve_method
from lowbit.run_path import RunPath

__all__ = ["CalibrationChoice", "CheckpointPlan", "RunSettings", "TargetChoice", "checkpoint_plan_of",
           "plan_checkpoint", "run_checkpoint"]


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
    """One checkpoint run, decided. ``method``: how it quantizes (``lowbit.method.Method``);
    ``planned`` (streamed only): the source's skeleton with the recipe resolved on its linears
    (``lowbit.streamed.planned.Planned``; ``run_checkpoint`` closes it)."""

    source: Path
    output: Path
    method: Method
    checkpoint_format: object
    targets: TargetChoice
    settings: RunSettings
    planned: object = None

    @property
    def recipe(self):
        return self.method.recipe

    @property
    def config(self):
        """The CalibrationConfig."""
        return self.method.config

    @property
    def calibration(self) -> CalibrationChoice:
        return self.method.calibration

    @property
    def path(self) -> RunPath:
        return RunPath.STREAMED if self.planned is not None else RunPath.MODEL_FREE

    @property
    def ignore(self) -> list[str]:
        return list(self.targets.ignore)

    def smoothquant(self):
        """What the calibrator takes: one alpha, or scheme -> alpha (a mixed recipe)."""
        return self.method.smoothquant(self.planned.chosen)


def plan_checkpoint(src, out, scheme, checkpoint_format, calibration: CalibrationChoice = CalibrationChoice(),
                    targets: TargetChoice = TargetChoice(), settings: RunSettings = RunSettings()) -> CheckpointPlan:
    """The plan of a run quantizing folder ``src`` into ``out`` with ``scheme`` (a preset name,
    Scheme or anything ``Recipe.of`` takes) in ``checkpoint_format``. SchemeError / RecipeError /
    FormatError / QuantizationError naming the option before anything is written."""
    return checkpoint_plan_of(resolve_method(scheme, calibration), src, out, checkpoint_format, targets, settings)


def checkpoint_plan_of(method: Method, src, out, checkpoint_format, targets: TargetChoice = TargetChoice(),
                       settings: RunSettings = RunSettings()) -> CheckpointPlan:
    """``plan_checkpoint`` for a Method already resolved (``lowbit quantize`` resolves it once)."""
    from lowbit.algorithms.rotate.options import DEFAULT_ROTATION
    from lowbit.formats import Format, get_layout
    from lowbit.streamed.planned import open_planned

    checkpoint_format = Format.parse(checkpoint_format)
    for s in method.schemes:
        get_layout(checkpoint_format).check_scheme(s)
    cfg = method.config
    if cfg.rotation is not DEFAULT_ROTATION:
        raise QuantizationError(f"rotation={cfg.rotation.value!r} rewrites the embeddings, every layer and lm_head "
                                f"together, which a run streamed one layer at a time (or model-free) cannot do: "
                                f"quantize in memory (lowbit.quantize, then lowbit.save)")
    plan = CheckpointPlan(Path(src), Path(out), method, checkpoint_format, targets, settings)
    if method.has_data and method.calibrates(method.schemes):
        if targets.include_lm_head:
            raise QuantizationError("a calibrated output head is not streamed yet: drop {head}, or quantize in "
                                    "memory (lowbit.quantize, then lowbit.save)", head=OptionRef("include_lm_head"))
        planned = open_planned(Path(src), method.recipe, list(targets.ignore))  # the recipe resolved (lowbit.recipes.plan)
        if method.calibrates(planned.schemes):
            return dataclasses.replace(plan, planned=planned)
        planned.close()  # no linear got a scheme that calibrates: round-to-nearest, as in memory
    method.check_model_free()
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
