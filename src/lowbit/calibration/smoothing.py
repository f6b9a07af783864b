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
