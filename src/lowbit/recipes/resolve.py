"""A recipe applied to a model's linears: ``resolve(recipe, names)`` -> ``Assignment``.

Rules (the same for the in-memory, streamed and model-free paths, which all resolve the names of
the quantizable linears they found):

- an ignored name (``Recipe.ignore``) stays in float;
- the explicit targets (names, ``re:`` regexes) claiming a name decide its scheme; two of them
  with different schemes are an error naming both; without an explicit claim, a ``Linear``
  group's scheme, else the recipe's default, else float;
- every explicit target must claim at least one quantizable linear (a pattern matching nothing
  is an error: a typo would otherwise quantize the model differently than meant);
- modules that serving engines run as one tensor share one scheme: fused q/k/v and gate/up
  siblings (``lowbit.fusion``) and every expert of one MoE block
  (``<block>.experts.<int>.<proj>``); a recipe that splits them is an error naming them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterator, Mapping

from lowbit.fusion import fused_groups
from lowbit.recipes.recipe import CLASS_TARGET, Recipe, RecipeError, matches
from lowbit.schemes import Scheme


@dataclass(frozen=True)
class Assignment(Mapping[str, Scheme]):
    """The scheme of every quantized linear (names in model order); ``left``: the names the recipe
    leaves in float (ignored, or claimed by nothing with no default). One scheme for every
    linear is the one-group case (``uniform``), not another type: every path carries an
    Assignment. ``default``: the scheme of a recipe that is one scheme and nothing else (it
    stands for the run even when no linear was found)."""

    schemes: dict[str, Scheme]
    left: tuple[str, ...] = ()
    recipe: Recipe | None = None
    default: Scheme | None = None

    @classmethod
    def of_one(cls, scheme: Scheme, names, recipe: Recipe | None = None) -> "Assignment":
        """``scheme`` for every one of ``names``, none left in float."""
        return cls({n: scheme for n in names}, (), recipe, scheme)

    @classmethod
    def for_all(cls, scheme: Scheme, recipe: Recipe | None = None) -> "Assignment":
        """``scheme`` for every linear a path finds, before it has named them (its ``default``
        stands for them: ``scheme_for``)."""
        return cls({}, (), recipe, scheme)

    def scheme_for(self, name: str) -> Scheme | None:
        """The scheme of linear ``name``: its own, else the one-scheme ``default`` (None: neither)."""
        return self.schemes.get(name, self.default)

    def __getitem__(self, name: str) -> Scheme:
        return self.schemes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.schemes)

    def __len__(self) -> int:
        return len(self.schemes)

    @property
    def distinct(self) -> list[Scheme]:
        out: list[Scheme] = []
        for s in self.schemes.values():
            if s not in out:
                out.append(s)
        if not out and self.default is not None:
            out.append(self.default)
        return out

    @property
    def uniform(self) -> Scheme | None:
        """The one scheme when every linear has it and none is left in float, else None."""
        d = self.distinct
        return d[0] if len(d) == 1 and not self.left else None

    def counts(self) -> dict[str, int]:
        """Linears per scheme name, in first-seen order."""
        return dict(Counter(s.name for s in self.schemes.values()))

    def names_of(self, scheme: Scheme) -> list[str]:
        return [n for n, s in self.schemes.items() if s == scheme]


def units(names: list[str]) -> list[list[str]]:
    """The groups of ``names`` that must share one scheme: fused siblings, and all linears of the
    experts of one MoE block (``X.experts.<int>.*`` share ``X``), in model order."""
    out: list[list[str]] = []
    block_at: dict[str, int] = {}
    for g in fused_groups(names):
        key = _expert_block(g[0])
        if key is None:
            out.append(list(g))
        elif key in block_at:
            out[block_at[key]].extend(g)
        else:
            block_at[key] = len(out)
            out.append(list(g))
    return out


def _expert_block(name: str) -> str | None:
    parts = name.split(".")
    for i in range(len(parts) - 2):
        if parts[i] == "experts" and parts[i + 1].isdigit():
            return ".".join(parts[:i + 1])
    return None


def _claim(recipe: Recipe, name: str) -> Scheme | None:
    explicit = [(t, g.scheme) for g in recipe.groups for t in g.targets if t != CLASS_TARGET and matches(name, t)]
    if explicit:
        first_t, first_s = explicit[0]
        for t, s in explicit[1:]:
            if s != first_s:
                raise RecipeError(f"module {name!r} is claimed by recipe entries {first_t!r} ({first_s.name}) and "
                                  f"{t!r} ({s.name}); give it one scheme")
        return first_s
    by_class = [g.scheme for g in recipe.groups if CLASS_TARGET in g.targets]
    if by_class:
        if any(s != by_class[0] for s in by_class[1:]):
            raise RecipeError(f"several recipe groups target {CLASS_TARGET!r} with different schemes "
                              f"({', '.join(s.name for s in by_class)})")
        return by_class[0]
    return recipe.default


def resolve(recipe: Recipe, names: list[str]) -> Assignment:
    """The scheme of each of ``names`` (the quantizable linears, model order) under ``recipe``;
    a RecipeError for a target claiming nothing, two claims with different schemes, or a split
    unit (see the module's docstring)."""
    explicit = [t for g in recipe.groups for t in g.targets if t != CLASS_TARGET]
    kept = [n for n in names if not any(matches(n, t) for t in recipe.ignore)]
    for t in explicit:
        if not any(matches(n, t) for n in kept):
            hint = " (all it matches is ignored)" if any(matches(n, t) for n in names) else ""
            raise RecipeError(f"recipe entry {t!r} matches no quantizable linear of the model{hint}; e.g. "
                              f"{names[0] if names else 'none'!r}")
    schemes: dict[str, Scheme] = {}
    left = [n for n in names if n not in set(kept)]
    for n in kept:
        s = _claim(recipe, n)
        if s is None:
            left.append(n)
        else:
            schemes[n] = s
    for u in units(names):
        got = {n: schemes.get(n) for n in u}
        if len({id(s) if s is None else s for s in got.values()}) > 1:
            shown = ", ".join(f"{n} ({'float' if s is None else s.name})" for n, s in list(got.items())[:4])
            raise RecipeError(f"the recipe splits modules that engines run as one tensor: {shown}"
                              f"{' ...' if len(got) > 4 else ''}; give them one scheme")
    order = {n: i for i, n in enumerate(names)}
    return Assignment(schemes, tuple(sorted(left, key=order.__getitem__)), recipe)
