"""Mixed precision: a scheme per group of layers (``Recipe``), and the automatic choice of one
under an average-bits budget (``lowbit.recipes.auto``)."""

from lowbit.recipes.recipe import Recipe, RecipeError, RecipeGroup
from lowbit.recipes.resolve import Assignment, resolve

__all__ = ["Assignment", "Recipe", "RecipeError", "RecipeGroup", "resolve"]
