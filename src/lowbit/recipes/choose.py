"""The cheapest mix: one option per unit, least total score within a total-bits budget.

A multiple-choice knapsack, solved by Lagrangian relaxation then a greedy fill: for a price
``lam`` each unit takes the option minimising score + lam * bits; the smallest price whose
choice fits the budget is found by bisection, and the bits it leaves are spent on the upgrades
with the largest score reduction per extra bit that still fit. Deterministic (ties: the option
with fewer bits, then the earlier one).
"""

from __future__ import annotations

from dataclasses import dataclass

from lowbit.recipes.recipe import RecipeError


@dataclass(frozen=True)
class Option:
    bits: int
    score: float


def _pick(options: list[list[Option]], lam: float) -> list[int]:
    return [min(range(len(opts)), key=lambda k: (opts[k].score + lam * opts[k].bits, opts[k].bits, k))
            for opts in options]


def _total(options: list[list[Option]], pick: list[int]) -> int:
    return sum(opts[k].bits for opts, k in zip(options, pick))


def choose(options: list[list[Option]], budget_bits: float, elements: int) -> list[int]:
    """The option index per unit; RecipeError when even the smallest options exceed the budget
    (the message gives the smallest and largest reachable averages over ``elements``)."""
    lo_bits = sum(min(o.bits for o in opts) for opts in options)
    hi_bits = sum(max(o.bits for o in opts) for opts in options)
    if lo_bits > budget_bits:
        raise RecipeError(f"no mix of the candidates meets {budget_bits / elements:.4g} average bits: they reach "
                          f"{lo_bits / elements:.4g} to {hi_bits / elements:.4g}")
    best = _pick(options, 0.0)
    if _total(options, best) > budget_bits:
        hi = 1.0
        while _total(options, _pick(options, hi)) > budget_bits:
            hi *= 2.0
            if hi > 1e300:
                break
        lo = 0.0
        for _ in range(200):
            mid = (lo + hi) / 2
            if _total(options, _pick(options, mid)) > budget_bits:
                lo = mid
            else:
                hi = mid
        best = _pick(options, hi)
        if _total(options, best) > budget_bits:  # only the cheapest options fit
            best = [min(range(len(o)), key=lambda k: (o[k].bits, o[k].score, k)) for o in options]
    used = _total(options, best)
    while True:  # spend what is left on the best upgrade per extra bit
        move, gain = None, 0.0
        for u, (opts, k) in enumerate(zip(options, best)):
            for j, o in enumerate(opts):
                extra = o.bits - opts[k].bits
                d = opts[k].score - o.score
                if d <= 0 or used + max(extra, 0) > budget_bits:
                    continue
                rate = d / extra if extra > 0 else float("inf")
                if rate > gain:
                    move, gain = (u, j), rate
        if move is None:
            return best
        u, j = move
        used += options[u][j].bits - options[u][best[u]].bits
        best[u] = j
