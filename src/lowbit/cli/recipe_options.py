"""The scheme options of ``quantize`` and ``compare``: one scheme (``--scheme``), a recipe file
(``--recipe``: a scheme per group of layers), or a budget for the automatic choice
(``--target-bits`` with ``--candidates``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lowbit.cli.common import OptionError

RECIPE_HELP = ("A recipe file (.json/.yaml): a scheme per group of layers, e.g. {\"re:.*mlp\\\\.down_proj\": "
               "\"w8a8-fp8\", \"default\": \"nvfp4\"} (targets: names, 're:' regexes, 'Linear'; see lowbit.recipes).")
TARGET_BITS_HELP = ("Choose a scheme per layer among --candidates for this average of weight bits (scales "
                    "counted: nvfp4 is 4.5) with the least predicted loss (loads the model in memory; the choice is "
                    "printed and saved as OUTPUT/recipe.json, reusable with --recipe).")
CANDIDATES_HELP = "The schemes --target-bits chooses from, comma-separated (e.g. nvfp4,w8a8-fp8)."
RECIPE_FILE = "recipe.json"  # the recipe a run used, beside its checkpoint's config.json


@dataclass
class SchemePlan:
    """What to quantize with: ``scheme`` (one Scheme), or ``recipe`` (a Recipe), or, for the
    automatic choice, ``target_bits`` and ``candidates`` (the recipe is chosen on the model)."""

    scheme: object = None
    recipe: object = None
    target_bits: float | None = None
    candidates: list | None = None
    label: str = ""

    @property
    def schemes(self) -> list:
        """Every scheme a layer may get."""
        if self.scheme is not None:
            return [self.scheme]
        return list(self.recipe.schemes) if self.recipe is not None else list(self.candidates)

    @property
    def given(self):
        """The ``scheme`` argument of lowbit.quantize / quantize_checkpoint (None: auto)."""
        return self.scheme if self.scheme is not None else self.recipe


def parse_plan(scheme: str | None, recipe: str | None, target_bits: float | None,
               candidates: str | None) -> SchemePlan:
    """One of --scheme, --recipe, --target-bits (which needs --candidates); OptionError otherwise."""
    from lowbit.recipes import Recipe
    from lowbit.schemes import get_scheme

    given = [f for f, v in (("--scheme", scheme), ("--recipe", recipe), ("--target-bits", target_bits)) if v is not None]
    if len(given) != 1:
        raise OptionError("give one of --scheme, --recipe or --target-bits" +
                          (f" (got {' and '.join(given)})" if given else ""))
    if candidates is not None and target_bits is None:
        raise OptionError("--candidates goes with --target-bits")
    if scheme is not None:
        s = get_scheme(scheme)
        return SchemePlan(scheme=s, label=s.name)
    if recipe is not None:
        p = Path(recipe)
        if not p.is_file():
            raise OptionError(f"--recipe {recipe}: no such file")
        r = Recipe.of(p)
        return SchemePlan(scheme=r.default if not r.groups and not r.ignore else None,
                          recipe=None if not r.groups and not r.ignore else r, label=p.stem)
    if candidates is None:
        raise OptionError("--target-bits needs --candidates (the schemes to choose from, e.g. nvfp4,w8a8-fp8)")
    from lowbit.recipes.auto import parse_candidates

    if not target_bits > 0:
        raise OptionError(f"--target-bits {target_bits}: must be a positive number of bits")
    cands = parse_candidates(candidates)
    return SchemePlan(target_bits=float(target_bits), candidates=cands, label=f"auto-{target_bits:g}b")


def save_used_recipe(out: Path, recipe) -> Path:
    """Write the recipe a run used into its (complete) output folder, as ``recipe.json``."""
    return recipe.save(Path(out) / RECIPE_FILE)


def used_schemes(plan: SchemePlan, chosen=None) -> list:
    """The schemes a run quantized with: the plan's, or the automatic choice's ``chosen`` recipe's."""
    if plan.scheme is not None:
        return [plan.scheme]
    return list((chosen or plan.recipe).schemes)
