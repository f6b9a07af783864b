"""SmoothQuant inside layer-by-layer calibration: the mappings of one decoder layer applied on
the statistics its observe pass gathered (``lowbit.calibration.pipeline``, step 2)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from lowbit.algorithms.smoothquant.fold import fold_smoothing, smooth_scales
from lowbit.algorithms.smoothquant.mappings import SmoothMapping, expand_for_layer
from lowbit.algorithms.smoothquant.search import search_alpha
from lowbit.calibration.stats import GroupReport, GroupStats
from lowbit.schemes import Scheme


def smoothing_maps(layer: nn.Module, prefix: str, targets: list[str], call, table, include_mlp_inner: bool,
                   report, group=None) -> tuple[SmoothMapping, ...]:
    """The SmoothQuant mappings of one decoder layer: read from its data flow on ``call``, the first
    window of its first calibration batch (``capture.first_window``; None: no batch), on the device
    the layer runs on (``lowbit.algorithms.smoothquant.dataflow``, every expert on every
    token), without the linear -> linear ones unless ``include_mlp_inner``; the sources that cannot
    be folded go to ``report.unsmoothed[layer]``. A layer whose forward cannot be followed falls back
    to the family ``table`` (None: no smoothing for it, said in the report). Several ranks
    (``group``): rank 0 reads them and every rank folds the same."""
    found = _read_flow(layer, targets, call) if call is not None else None
    if group is not None and group.distributed:
        found = group.broadcast_object(found, src=0)
    name = prefix.rstrip(".")
    if found is None or isinstance(found, str):
        if table is None:
            report.unsmoothed[name] = {"*": f"its data flow could not be read ({found or 'no calibration batch'})"}
            return ()
        return table
    maps, skipped = found
    if skipped:
        report.unsmoothed[name] = skipped
    elif not maps:
        report.unsmoothed[name] = {"*": "no norm or linear with a weight feeds its linears"}
    return tuple(m for m in maps if include_mlp_inner or not m.is_mlp_inner)


def _read_flow(layer: nn.Module, targets: list[str], call):
    """(mappings, unfoldable sources) of the layer on ``call``, or the error's type name."""
    from lowbit.algorithms.smoothquant.dataflow import layer_mappings
    from lowbit.moe import all_tokens

    try:
        with all_tokens(layer):
            return layer_mappings(layer, call, targets)
    except Exception as e:  # noqa: BLE001 - a forward the flow cannot follow: the table, or nothing
        return type(e).__name__


def smooth_layer(layer: nn.Module, rel: dict[str, str], groups: list[list[str]], stats: dict[str, GroupStats],
                 maps: tuple[SmoothMapping, ...], scheme_of: Callable[[str], Scheme], alphas: dict,
                 reports: dict[str, GroupReport], auto_alphas) -> list[str]:
    """Apply the mappings (``maps``, expanded for ``layer``) whose targets are all quantized here
    (``rel``: full linear name -> name in ``layer``), each with the alpha of its targets' scheme
    (``alphas[scheme_of(full name)]``; "auto": searched on the kept samples, ``auto_alphas``), and
    record it in ``reports`` (group head -> GroupReport). The folded scales rescale the groups'
    statistics; returns the heads of the groups whose observers must see the data again."""
    inv = {v: k for k, v in rel.items()}  # relative -> full
    stale = []
    for m in expand_for_layer(maps, layer):
        if not all(t in inv for t in m.targets):
            continue
        try:
            layer.get_submodule(m.source)
        except AttributeError:
            continue
        full = {inv[t] for t in m.targets}
        # MoE: every expert's group reads the source; groups with one input share one statistics
        # object (_layer), rescaled once: the first group holding each object
        first: dict[int, str] = {}
        for g in groups:
            if full.intersection(g):
                first.setdefault(id(stats[g[0]]), g[0])
        keys = list(first.values())
        key = keys[0]
        st = stats[key]
        ws = [layer.get_submodule(t).weight for t in m.targets]
        act = st.all_pos.amax()
        target_scheme = scheme_of(inv[m.targets[0]])
        alpha, errs = alphas.get(target_scheme), None
        if alpha == "auto":
            x = torch.cat(st.samples)
            alpha, errs = search_alpha(x, act, st.scale_chan.amax(), ws, target_scheme, auto_alphas)
        rep = reports.setdefault(key, GroupReport(members=[n for g in groups if key in g for n in g]))
        rep.alpha, rep.alpha_errors = alpha, errs
        if alpha is None:
            continue
        s = smooth_scales(act, ws, float(alpha))
        fold_smoothing(layer, m, s)
        stale += [k for k in keys if not stats[k].rescale(s)]
    return stale
