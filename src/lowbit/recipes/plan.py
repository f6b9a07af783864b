"""What a ``scheme`` argument means, the same on every quantization path (in memory, streamed,
model-free).

- ``recipe_of(value)``: the argument as a Recipe. A Scheme or a preset name is the uniform recipe
  (an unknown name is the SchemeError one scheme gives); a Recipe, a mapping or a ``.json`` /
  ``.yaml`` / ``.yml`` path is read by ``Recipe.of`` (a RecipeError naming the entry or file).
- ``plan(recipe, names)``: the recipe applied to ``names``, the quantizable linears a path found
  (model names, in its order): the ``Assignment`` (``lowbit.recipes.resolve``: its errors are the
  same on every path; one scheme for every linear is its ``uniform`` case). A recipe leaving every
  linear in float is a QuantizationError.
- ``recipe_key(recipe)``: a JSON value that is equal exactly for recipes that quantize alike, for
  resume fingerprints and rank agreement (a uniform recipe: its scheme's ``to_dict()``, what those
  held before recipes existed).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Mapping

from lowbit.errors import QuantizationError
from lowbit.recipes.recipe import Recipe
from lowbit.recipes.resolve import Assignment, resolve
from lowbit.schemes import get_scheme

RECIPE_SUFFIXES = (".json", ".yaml", ".yml")


def is_recipe_file(value: Any) -> bool:
    """A string or path naming a recipe file (by its suffix)."""
    return isinstance(value, (str, os.PathLike)) and Path(value).suffix.lower() in RECIPE_SUFFIXES


def recipe_of(value: Any) -> Recipe:
    """``value`` as a Recipe (see the module's docstring)."""
    if isinstance(value, (Recipe, Mapping, os.PathLike)) or is_recipe_file(value):
        return Recipe.of(value)
    return Recipe.uniform(get_scheme(value))


def is_plain(recipe: Recipe) -> bool:
    """One scheme for every quantizable linear: no group, no ignore entry (only a default)."""
    return not recipe.groups and not recipe.ignore


def plan(recipe: Recipe, names: Iterable[str]) -> Assignment:
    """The scheme of each of ``names`` under ``recipe`` (``Assignment.uniform``: the one scheme
    when every linear gets it and none stays float). RecipeError for a target claiming nothing,
    conflicting claims, a split fused or expert group; QuantizationError when every linear
    stays float."""
    if is_plain(recipe):
        return Assignment.of_one(recipe.default, names, recipe)
    assign = resolve(recipe, list(names))
    if not assign:
        raise QuantizationError("the recipe leaves every linear in float: nothing to quantize")
    return assign


def recipe_key(recipe: Recipe) -> Any:
    """A JSON value equal for recipes that quantize alike: the scheme's ``to_dict()`` for a plain
    recipe, else every group's targets and full scheme, the default and the ignore entries (the
    groups' names, which decide nothing, are left out)."""
    if is_plain(recipe):
        return recipe.default.to_dict()
    return {"groups": [[list(g.targets), g.scheme.to_dict()] for g in recipe.groups],
            "default": None if recipe.default is None else recipe.default.to_dict(),
            "ignore": list(recipe.ignore)}
