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


def parse_plan(scheme: str | None, recipe: str | None, target_bits: str | None,
               candidates: str | None) -> SchemePlan:
    """``lowbit quantize``'s plan: one of --scheme, --recipe, --target-bits (one budget, which
    needs --candidates: ``parse_budgets``, compare's parser); OptionError otherwise."""
    from lowbit.recipes import Recipe
    from lowbit.schemes import get_scheme

    given = [f for f, v in (("--scheme", scheme), ("--recipe", recipe), ("--target-bits", target_bits)) if v is not None]
    if len(given) != 1:
        raise OptionError("give one of --scheme, --recipe or --target-bits" +
                          (f" (got {' and '.join(given)})" if given else ""))
    budgets, cands = parse_budgets(target_bits, candidates)
    if scheme is not None:
        s = get_scheme(scheme)
        return SchemePlan(scheme=s, label=s.name)
    if recipe is not None:
        p = recipe_file(recipe)
        r = Recipe.of(p)
        return SchemePlan(scheme=r.default if not r.groups and not r.ignore else None,
                          recipe=None if not r.groups and not r.ignore else r, label=p.stem)
    if len(budgets) != 1:
        raise OptionError(f"--target-bits {target_bits}: quantize takes one budget (compare takes several, a row each)")
    from lowbit.recipes.auto import budget_label

    return SchemePlan(target_bits=budgets[0], candidates=cands, label=budget_label(budgets[0]))


def parse_budgets(target_bits: str | None, candidates: str | None) -> tuple[list[float], list]:
    """--target-bits (comma-separated average weight bits) with --candidates (comma-separated
    scheme names), as ``quantize`` and ``compare`` both take them: (budgets, candidate Schemes),
    ([], []) when neither is given. OptionError for one without the other, an empty list or a
    budget that is not a positive number; RecipeError / SchemeError for a repeated or unknown
    candidate (``lowbit.recipes.auto.parse_candidates``)."""
    if target_bits is None:
        if candidates is not None:
            raise OptionError("--candidates goes with --target-bits")
        return [], []
    items = [b.strip() for b in str(target_bits).split(",") if b.strip()]
    if not items:
        raise OptionError("--target-bits needs at least one number of bits")
    budgets = [parse_budget(b) for b in items]
    if candidates is None:
        raise OptionError("--target-bits needs --candidates (the schemes to choose from, e.g. nvfp4,w8a8-fp8)")
    from lowbit.cli.common import parse_list
    from lowbit.recipes.auto import parse_candidates

    return budgets, parse_candidates(parse_list(candidates, "--candidates"))


def parse_budget(text: str) -> float:
    """One --target-bits value: a positive (finite) number of bits; OptionError otherwise."""
    try:
        b = float(text)
    except ValueError:
        raise OptionError(f"--target-bits {text!r}: not a number of bits") from None
    if not 0 < b < float("inf"):
        raise OptionError(f"--target-bits {text!r}: must be a positive number of bits")
    return b


def recipe_file(path: str) -> Path:
    """A --recipe value as a path to an existing file; OptionError otherwise."""
    p = Path(path)
    if not p.is_file():
        raise OptionError(f"--recipe {path}: no such file")
    return p


def save_used_recipe(out: Path, recipe) -> Path:
    """Write the recipe a run used into its (complete) output folder, as ``recipe.json``."""
    return recipe.save(Path(out) / RECIPE_FILE)


def used_schemes(plan: SchemePlan, chosen=None) -> list:
    """The schemes a run quantized with: the plan's, or the automatic choice's ``chosen`` recipe's."""
    if plan.scheme is not None:
        return [plan.scheme]
    return list((chosen or plan.recipe).schemes)
