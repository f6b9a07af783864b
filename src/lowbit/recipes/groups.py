"""The config groups a checkpoint lists for its quantized linears, in one order every writer
(``lowbit.save``, the streamed and the model-free paths) reproduces from the names alone.

One scheme: one group targeting ``Linear`` (the float linears are the config's ``ignore``).
Several: a group per scheme listing its layers; layers in ``name_order`` and groups in the
order of their first layer. ``name_order`` needs no model (a model-free run has none): the
dot-separated components compared one by one, numbers by value (``layers.2`` before
``layers.10``), names as strings.
"""

from __future__ import annotations

from typing import Mapping

from lowbit.recipes.recipe import CLASS_TARGET
from lowbit.schemes import Scheme


def name_order(name: str) -> tuple[tuple[int, int, str], ...]:
    """The sort key of a layer name (see the module's docstring)."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))


def config_groups(schemes: Mapping[str, Scheme]) -> list[tuple[Scheme, list[str]]]:
    """(scheme, targets) per scheme of ``schemes`` (layer name, as the checkpoint names it ->
    its scheme): ``[(s, ["Linear"])]`` for one scheme, else the layers of each scheme by name."""
    if not schemes:
        raise ValueError("config_groups needs at least one quantized layer")
    by: dict[Scheme, list[str]] = {}
    for n in sorted(schemes, key=name_order):
        by.setdefault(schemes[n], []).append(n)
    if len(by) == 1:
        return [(next(iter(by)), [CLASS_TARGET])]
    return list(by.items())
