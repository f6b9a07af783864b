"""Calibration statistics of several ranks combined into what one process computes, bit for bit.

Each rank observes a contiguous share of the calibration batches (``Group.share``: rank 0 the
first ones). Maxima are combined with an all-reduce (exact in any order). The GPTQ Hessian is a
float64 sum whose value depends on the order of its additions, so it is passed along the ranks
in batch order: rank 0 sums its batches as one process would, sends the sum to rank 1, which
adds its own batches' products (kept until then: ``HessianSum(deferred=True)``) in order, and
so on; the last rank then holds the exact one-process sum and sends it to the rank that solves
the group (``send_hessian``).

Observers that keep sample rows (percentile, mse) and the alpha search (smoothquant="auto")
are not combined: ``check_distributable`` refuses them.
"""

from __future__ import annotations

import torch

from lowbit.calibration.stats import GroupStats
from lowbit.dist import DistError, Group


def check_distributable(group: Group, cfg, smoothquant) -> None:
    if not group.distributed:
        return
    if str(cfg.observer) != "max":
        raise DistError(f"observer={cfg.observer!s} keeps sample rows, which are not combined across ranks yet: "
                        f"use observer='max' (the default) or run one process")
    if smoothquant == "auto":
        raise DistError("smoothquant='auto' searches on sample rows, which are not combined across ranks yet: "
                        "give an alpha, or run one process")


def distinct(stats: dict[str, GroupStats]) -> list[GroupStats]:
    """Each statistics object once, in the order of ``stats`` (groups with one input share one)."""
    seen: dict[int, GroupStats] = {}
    for st in stats.values():
        seen.setdefault(id(st), st)
    return list(seen.values())


def _max(group: Group, obs) -> None:
    if obs.channel_max is None:
        raise DistError("a rank observed no calibration data for a layer input: give every rank at least one "
                        "calibration batch (fewer ranks, or more samples)")
    group.max_(obs.channel_max)


def reduce_stats(group: Group, stats: list[GroupStats]) -> None:
    """Combine every rank's statistics in place (every rank calls this with the same list).
    Afterwards every rank holds the combined maxima, and the last rank the combined Hessians."""
    if not group.distributed:
        return
    for st in stats:
        _max(group, st.all_pos)
        _max(group, st.scale_chan)
    last = group.world - 1
    for st in stats:
        h = st.hessian_sum
        if h is None:
            continue
        n = st.all_pos.channel_max.shape[0]
        prev = None
        if group.rank > 0:
            prev = group.recv(torch.empty(n, n, dtype=torch.float64, device=st.all_pos.channel_max.device), group.rank - 1)
            h.continue_from(prev, n)
        if group.rank < last:
            group.send(h.take(), group.rank + 1)


def send_hessian(group: Group, st: GroupStats, dst: int) -> None:
    """Move the combined Hessian of ``st`` from the last rank to rank ``dst`` (every rank calls it)."""
    last = group.world - 1
    if not group.distributed or dst == last:
        return
    h = st.hessian_sum
    n = st.all_pos.channel_max.shape[0]
    if group.rank == last:
        group.send(h.upper(), dst)  # kept: another batch may need it too
    elif group.rank == dst:
        h.put(group.recv(torch.empty(n, n, dtype=torch.float64, device=st.all_pos.channel_max.device), last))


def solve_spread(group: Group, weights: list[list[torch.Tensor]], stats: list[GroupStats], spec, *,
                 global_scales, options, names) -> list[list]:
    """``gptq_quantize_groups`` of the groups (weights, their statistics' Hessians), with each of
    its column-loop batches (``gptq_batches``: the unit whose numbers must not be split) solved on
    one rank, ``Group.owner(batch index)``, and the results sent to every rank. One process: the
    plain call. The same QuantizedTensors as one process. The solves run on the CPU (weights and
    Hessians computed on an accelerator are copied); the results are CPU tensors."""
    from lowbit.algorithms.gptq import gptq_batches, gptq_quantize_groups

    cpu = torch.device("cpu")
    weights = [[w.to(cpu) for w in ws] for ws in weights]  # GPTQ's column loop runs on the CPU (C or torch)
    global_scales = [[None if g is None else g.to(cpu) for g in gs] for gs in global_scales]

    def hessian(st):
        h = st.hessian_upper
        return None if h is None else h.to(cpu)

    if not group.distributed:
        return gptq_quantize_groups(weights, [hessian(st) for st in stats], spec, global_scales=global_scales,
                                    options=options, names=names)
    batches = gptq_batches(weights, stats, options)  # sharing decided by object identity, as with the Hessians
    for j, ks in enumerate(batches):
        for st in distinct({str(k): stats[k] for k in ks}):
            send_hessian(group, st, group.owner(j))
    out: list[list | None] = [None] * len(weights)
    for j, ks in enumerate(batches):
        mine = None
        if group.owns(j):
            mine = gptq_quantize_groups([weights[k] for k in ks], [hessian(stats[k]) for k in ks], spec,
                                        global_scales=[global_scales[k] for k in ks], options=options,
                                        names=[names[k] for k in ks])
        for k, r in zip(ks, group.broadcast_object(mine, src=group.owner(j))):
            out[k] = r
    for st in distinct({str(k): s for k, s in enumerate(stats)}):
        if st.hessian_sum is not None:
            st.hessian_sum.take()  # freed: the solves are done
    return out
