"""A streamed run's recipe, resolved on the skeleton's linears as ``lowbit.quantize`` resolves it
on the loaded model (``lowbit.recipes.plan``: the same names, in the same order, so the same
Assignment and the same errors).

Whether a run calibrates is asked of its ``Method`` twice (``checkpoint_plan_of``): on the
schemes the recipe names (before anything is built: none calibrating is a model-free run, as for
one scheme), then on the schemes the resolved recipe gives the linears (a default no linear
falls to does not make the run calibrate, as it does not in memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from lowbit.recipes import Assignment, Recipe
from lowbit.recipes.plan import plan
from lowbit.schemes import Scheme


@dataclass
class Planned:
    """The skeleton of the source and its resolved recipe: ``chosen`` (the Assignment; one scheme
    for all is its ``uniform`` case), ``names`` (the linears to quantize, model order)."""

    skel: object
    recipe: Recipe
    chosen: Assignment

    @property
    def names(self) -> list[str]:
        return list(self.chosen)

    @property
    def schemes(self) -> list[Scheme]:
        return self.chosen.distinct

    def by_name(self) -> dict[str, Scheme]:
        """Every quantized linear's scheme (model names)."""
        return dict(self.chosen)

    def close(self) -> None:
        self.skel.close()


def open_planned(src: Path, recipe: Recipe, ignore: list[str]) -> Planned:
    """Open the skeleton of ``src`` and resolve ``recipe`` on its quantizable linears (the output
    head never: a calibrated head is not streamed). Its errors (RecipeError, QuantizationError)
    come before anything is written; the skeleton is closed then."""
    from lowbit.streamed.skeleton import Skeleton
    from lowbit.targets import quantizable_linears

    skel = Skeleton.open(src)
    try:
        names = quantizable_linears(skel.model, ignore, False)
        chosen = plan(recipe, names)
    except BaseException:
        skel.close()
        raise
    return Planned(skel, recipe, chosen)


def representative_alpha(sq):
    """One alpha standing for the calibrator's ``smoothquant`` (for ``check_distributable``):
    "auto" if any scheme searches, else the first alpha set, else None."""
    if not isinstance(sq, Mapping):
        return sq
    values = [a for a in sq.values() if a is not None]
    return "auto" if "auto" in values else (values[0] if values else None)
