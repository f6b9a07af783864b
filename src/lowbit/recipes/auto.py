"""``lowbit.auto_recipe``: a scheme per group of linears chosen under an average-bits budget.

1. The quantizable linears are cut into units that must share a scheme (``resolve.units``:
   fused q/k/v and gate/up siblings, the experts of one MoE block; every other linear alone).
2. Each unit's cost under each candidate: its weight bits, scales included (``bits``), and its
   sensitivity (``sensitivity``: the Fisher-weighted output error summed over its linears,
   measured on the float model on calibration windows, with the weights the candidate's
   calibration rounds to, ``rounded.calibrated_weights``: GPTQ's, solved on the float model's
   Hessians over the same windows, for the candidates ``lowbit.quantize`` rounds with GPTQ given
   the same options; round to nearest for the others). The windows are the ones
   ``lowbit.quantize`` calibrates on given the same calibration and options (the same
   ``calibration_set``: window count and length, packing, chat template, column, split, and the
   padding mask of unpacked windows), ``sensitivity_samples`` of them, evenly spaced.
3. The units' schemes minimise the total sensitivity with the model's average weight bits at
   most ``target_bits`` (``choose``).

The recipe names every linear exactly (one group per scheme), so it is reusable as it is
(``Recipe.save``, ``--recipe FILE``) and quantizes with each scheme's own calibration defaults.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterable

import torch.nn as nn

from lowbit.recipes.weight_bits import weight_bits
from lowbit.recipes.choose import Option, choose
from lowbit.recipes.recipe import Recipe, RecipeError, RecipeGroup
from lowbit.recipes.resolve import units
from lowbit.schemes import Scheme, get_scheme

#: of the calibration windows, how many the sensitivities are measured on (a forward and a
#: backward of the float model each): the one default of the API, ``lowbit quantize`` and ``compare``
DEFAULT_SENSITIVITY_SAMPLES = 4


@dataclass
class AutoRecipe:
    """What ``auto_recipe`` chose: the recipe, the average weight bits it reaches (target:
    ``target_bits``), its predicted loss increase (half the summed sensitivities: nats of mean next-token
    loss, to second order), the units
    (names, chosen scheme, bits and score per candidate), seconds spent measuring; the
    calibration windows it measured on: ``calibration`` (the ``CalibrationInfo`` dict of the
    windows ``lowbit.quantize`` calibrates on with the same options) and ``windows`` (the indices
    of those measured); ``rounding``: per candidate, the weight rounding its scores were measured
    with ("gptq" or "rtn")."""

    recipe: Recipe
    target_bits: float
    average_bits: float
    predicted_loss: float
    units: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    calibration: dict = field(default_factory=dict)
    windows: list[int] = field(default_factory=list)
    rounding: dict[str, str] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for u in self.units:
            out[u["scheme"]] = out.get(u["scheme"], 0) + len(u["names"])
        return out


def budget_label(target_bits: float) -> str:
    """The name of an automatic choice's run or ``compare`` row: ``auto-6b`` for 6 bits."""
    return f"auto-{target_bits:g}b"


def parse_candidates(candidates: Iterable[str | Scheme] | str) -> list[Scheme]:
    """Candidate schemes from names (a comma-separated string or a list); at least one, no repeats."""
    if isinstance(candidates, str):
        candidates = [c.strip() for c in candidates.split(",") if c.strip()]
    out: list[Scheme] = []
    for c in candidates:
        s = get_scheme(c)
        if s in out:
            raise RecipeError(f"candidate {s.name!r} is given twice")
        out.append(s)
    if not out:
        raise RecipeError("auto_recipe needs at least one candidate scheme")
    return out


def auto_recipe(model: nn.Module, candidates: Iterable[str | Scheme] | str, target_bits: float,
                calibration="builtin", *, tokenizer=None, ignore: Iterable[str] = (),
                include_lm_head: bool = False, sensitivity_samples: int | None = DEFAULT_SENSITIVITY_SAMPLES,
                config=None, preset: str | None = None, **calibration_options) -> AutoRecipe:
    """Choose a scheme among ``candidates`` for every unit of ``model``'s quantizable linears,
    least predicted loss at average weight bits <= ``target_bits`` (see the module's docstring).

    ``calibration``, ``tokenizer`` and ``config`` / ``preset`` / ``calibration_options``
    (num_samples, seq_len, pack, chat_template, column, split, ...): as ``lowbit.quantize`` takes
    them; pass the same to both and the sensitivities are measured on windows the quantization
    calibrates on (``sensitivity_samples`` of them, evenly spaced; None: all), padding masked as
    it is there. The model is not changed (MoE experts are split, as ``lowbit.quantize`` splits
    them). RecipeError for an empty or repeated candidate list, a bad ``sensitivity_samples`` or
    a budget below the smallest candidate mix (the message gives the reachable range);
    QuantizationError for an unknown calibration option; CalibrationError for bad data."""
    from lowbit.calibration import calibration_set
    from lowbit.calibration.windows import spaced
    from lowbit.calibration.config import calibration_config
    from lowbit.linearize import linearize
    from lowbit.recipes.rounded import calibrated_weights
    from lowbit.recipes.sensitivity import sensitivities
    from lowbit.targets import quantizable_linears

    t0 = time.perf_counter()
    cands = parse_candidates(candidates)
    try:
        target = float(target_bits)
    except (TypeError, ValueError):
        raise RecipeError(f"target bits must be a number, got {target_bits!r}") from None
    if sensitivity_samples is not None and (isinstance(sensitivity_samples, bool)
                                            or not isinstance(sensitivity_samples, int) or sensitivity_samples < 1):
        raise RecipeError(f"sensitivity_samples must be a positive number of windows or None, "
                          f"got {sensitivity_samples!r}")
    cfg = calibration_config(config, preset, calibration_options)
    linearize(model)
    names = quantizable_linears(model, ignore, include_lm_head)
    if not names:
        raise RecipeError("the model has no quantizable linear to choose schemes for")
    shapes = {n: tuple(model.get_submodule(n).weight.shape) for n in names}
    elements = sum(o * i for o, i in shapes.values())
    groups = units(names)
    bits = [[sum(weight_bits(c, *shapes[n]) for n in u) for c in cands] for u in groups]
    lo, hi = sum(min(b) for b in bits), sum(max(b) for b in bits)
    if lo > target * elements:  # before measuring anything
        raise RecipeError(f"no mix of the candidates meets {target:.4g} average bits: they reach "
                          f"{lo / elements:.4g} to {hi / elements:.4g}")
    data = calibration_set(calibration, tokenizer, **cfg.data_options())  # lowbit.quantize's windows
    n = data.ids.shape[0]
    keep = spaced(n, n if sensitivity_samples is None else sensitivity_samples)
    ids, valid = data.ids[keep], None if data.valid is None else data.valid[keep]
    weights, rounding = calibrated_weights(model, names, cands, ids, valid, cfg)
    sens = sensitivities(model, names, cands, ids, valid=valid, weights=weights)
    del weights
    scores = [[sum(sens[n][c.name] for n in u) for c in cands] for u in groups]
    pick = choose([[Option(b, s) for b, s in zip(bu, su)] for bu, su in zip(bits, scores)], target * elements,
                  elements)
    chosen: dict[Scheme, list[str]] = {}
    table = []
    for u, k, bu, su in zip(groups, pick, bits, scores):
        chosen.setdefault(cands[k], []).extend(u)
        table.append({"names": list(u), "scheme": cands[k].name,
                      "bits": {c.name: b for c, b in zip(cands, bu)}, "score": {c.name: s for c, s in zip(cands, su)}})
    order = {c: i for i, c in enumerate(cands)}
    recipe = Recipe(tuple(RecipeGroup(tuple(ns), s, s.name) for s, ns in sorted(chosen.items(),
                                                                                 key=lambda kv: order[kv[0]])))
    total = sum(b[k] for b, k in zip(bits, pick))
    return AutoRecipe(recipe, target, total / elements, 0.5 * sum(s[k] for s, k in zip(scores, pick)), table,
                      time.perf_counter() - t0, data.info.as_dict(), [int(i) for i in keep], rounding)
