"""A model-free run's plan under a recipe: the recipe resolved on the modules the plan quantizes,
by the rules ``lowbit.quantize`` applies to the loaded model (``lowbit.recipes.plan``).

The names resolved are the model's: a checkpoint name maps to it through ``lowbit.moe.naming``
(Mixtral's ``block_sparse_moe.experts.{e}.w1`` is the model's ``mlp.experts.{e}.gate_proj``;
fused experts on disk are planned per expert already, ``<block>.experts.{e}.<proj>``), so a
recipe claims the same linears here as in memory, and the fused-group and expert-block rules
see the same units. The modules the recipe leaves in float are kept as the plan keeps ignored
ones (copied, listed in the config's ``ignore``); the others get their scheme per tensor.
"""

from __future__ import annotations

from typing import Iterable

from lowbit.modelfree.plan import plan_of, survey
from lowbit.modelfree.plan_types import Plan
from lowbit.modelfree.source import Checkpoint
from lowbit.moe.naming import model_names
from lowbit.recipes import Assignment, Recipe
from lowbit.recipes.plan import is_plain, plan


def plan_recipe(ckpt: Checkpoint, recipe: Recipe, ignore: Iterable[str] = (), include_lm_head: bool = False) -> Plan:
    """The plan of ``ckpt`` under ``recipe``: the checkpoint surveyed once (``survey``: which
    modules are quantized), the recipe resolved on them, then ``plan_of`` with one scheme for all
    (``Assignment.for_all``: a plain recipe, or one that gives every linear the same scheme), or
    with a scheme per module and the modules it leaves in float kept so (``Survey.keep_float``,
    what ignoring them by exact name did). RecipeError / QuantizationError as
    ``lowbit.recipes.plan`` raises them, before anything is written."""
    found = survey(ckpt, ignore, include_lm_head)
    if is_plain(recipe):
        return plan_of(found, Assignment.for_all(recipe.default, recipe))
    names = found.quantized  # checkpoint names
    as_model = model_names(ckpt.get("model_type"), names)
    disk = {as_model[n]: n for n in names}
    chosen = plan(recipe, [as_model[n] for n in names])
    if chosen.uniform is not None:
        return plan_of(found, Assignment.for_all(chosen.uniform, recipe))
    one = chosen.distinct[0] if len(chosen.distinct) == 1 else None
    by_disk = Assignment.for_all(one, recipe) if one is not None else \
        Assignment({disk[n]: s for n, s in chosen.items()}, (), recipe)
    return plan_of(found.keep_float(disk[n] for n in chosen.left), by_disk)
