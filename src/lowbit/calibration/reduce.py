"""Calibration statistics of several ranks combined into what one process computes, bit for bit.

Each rank observes a contiguous share of the calibration batches, the batches one process runs
(``Group.share`` over the batches: rank 0 the first ones), so a batch never spans two ranks and
every number is computed from the same batches as in one process. With fewer batches than ranks
(4 windows in batches of 4 on 2 ranks) the last ranks hold none: they observe nothing, add
max's identity to the maxima and nothing to the Hessians, and still take their share of the GPTQ
solves (and, in ``lowbit.streamed``, of the shards). A job given fewer windows than ranks is
refused, with the same line on every rank: before any work when fewer are asked for
(``check_distributable``), when the layers start when the data makes fewer (``check_windows``).

Maxima are combined with an all-reduce (exact in any order). The GPTQ Hessian is a
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
from lowbit.errors import OptionRef


def _samples(n: int) -> OptionRef:
    return OptionRef("num_samples", n, flag="calib_samples")


def check_distributable(group: Group, cfg, smoothquant) -> None:
    """Refuse (DistError, the same line on every rank, before any other collective) what the
    ranks cannot compute as one process does: sample-keeping observers, the alpha search, and
    fewer calibration windows asked for than ranks. The ranks meet at a barrier before refusing,
    so that none exits (and has the launcher stop the others) before every rank has said why."""
    if not group.distributed:
        return
    refusal = None
    if str(cfg.observer) != "max":
        refusal = DistError(f"observer={cfg.observer!s} keeps sample rows, which are not combined across ranks "
                            f"yet: use observer='max' (the default) or run one process")
    elif smoothquant == "auto":
        refusal = DistError("smoothquant='auto' searches on sample rows, which are not combined across ranks yet: "
                            "give an alpha, or run one process")
    elif cfg.num_samples < group.world:
        refusal = DistError(f"{{asked}} is fewer than the {group.world} ranks of this job: give at least {{least}} "
                            f"(one calibration window per rank), or start fewer ranks",
                            asked=_samples(cfg.num_samples), least=_samples(group.world))
    if refusal is not None:
        group.barrier()  # the decision depends only on arguments every rank was given
        raise refusal


def check_windows(group: Group, n_local: int, seq_len: int) -> None:
    """Refuse (DistError on every rank) a job whose calibration windows, all ranks' ``n_local``
    together, are fewer than its ranks (a text too short for the windows asked for). Every rank
    calls it at the same point (one gather)."""
    if not group.distributed:
        return
    total = sum(group.gather_objects(int(n_local)))
    if total < group.world:
        raise DistError(f"the calibration data makes {total} window{'s' if total != 1 else ''}, fewer than the "
                        f"{group.world} ranks of this job: give a text long enough for {group.world} windows (or "
                        f"lower {{seq}}), or start fewer ranks", seq=OptionRef("seq_len", seq_len, flag="calib_seq_len"))


def distinct(stats: dict[str, GroupStats]) -> list[GroupStats]:
    """Each statistics object once, in the order of ``stats`` (groups with one input share one)."""
    seen: dict[int, GroupStats] = {}
    for st in stats.values():
        seen.setdefault(id(st), st)
    return list(seen.values())


def _fill_unobserved(group: Group, observers: list, device: torch.device) -> None:
    """An observer this rank saw no data for (it holds no batch) starts from max's identity, -inf,
    in the shape and dtype another rank observed, so the all-reduce gives the maxima of the ranks
    that did observe. An input no rank observed stays unobserved on every rank, as in one process."""
    mine = [None if o.channel_max is None else (tuple(o.channel_max.shape), o.channel_max.dtype) for o in observers]
    seen = group.gather_objects(mine)
    for k, o in enumerate(observers):
        like = next((s[k] for s in seen if s[k] is not None), None)
        if o.channel_max is None and like is not None:
            o.channel_max = torch.full(like[0], float("-inf"), dtype=like[1], device=device)


def reduce_stats(group: Group, stats: list[GroupStats], device: torch.device | None = None) -> None:
    """Combine every rank's statistics in place (every rank calls this with the same list; ``device``:
    where this rank's statistics are, for a rank that observed none). Afterwards every rank holds
    the combined maxima, and the last rank the combined Hessians."""
    if not group.distributed:
        return
    observers = [o for st in stats for o in (st.all_pos, st.scale_chan)]
    _fill_unobserved(group, observers, device or torch.device("cpu"))
    for o in observers:
        if o.channel_max is not None:  # the same on every rank (_fill_unobserved)
            group.max_(o.channel_max)
    last = group.world - 1
    for st in stats:
        h = st.hessian_sum
        if h is None or st.all_pos.channel_max is None:
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
                 global_scales, options, names, workers: int = 1) -> list[list]:
    """``gptq_quantize_groups`` of the groups (weights, their statistics' Hessians), with each of
    its column-loop batches (``gptq_batches``: the unit whose numbers must not be split) solved on
    one rank, ``Group.owner(batch index)``, and the results sent to every rank. One process: the
    plain call (``workers``: column-loop batches solved at once, ``gptq_quantize_groups``). The same
    QuantizedTensors as one process. The solves run where the weights are
    (on an accelerator, the torch column loop there; Hessians are moved to the weights' device);
    results sent between ranks travel as CPU tensors."""
    from lowbit.algorithms.gptq import gptq_batches, gptq_quantize_groups

    device = weights[0][0].device if weights and weights[0] else torch.device("cpu")
    weights = [[w.to(device) for w in ws] for ws in weights]
    global_scales = [[None if g is None else g.to(device) for g in gs] for gs in global_scales]

    def hessian(st):
        h = st.hessian_upper
        return None if h is None else h.to(device)

    if not group.distributed:
        return gptq_quantize_groups(weights, [hessian(st) for st in stats], spec, global_scales=global_scales,
                                    options=options, names=names, workers=workers)
    cpu = torch.device("cpu")
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
            mine = [[qt.to(cpu) for qt in qts] for qts in mine]
        for k, r in zip(ks, group.broadcast_object(mine, src=group.owner(j))):
            out[k] = r
    for st in distinct({str(k): s for k, s in enumerate(stats)}):
        if st.hessian_sum is not None:
            st.hessian_sum.take()  # freed: the solves are done
    return [[qt.to(device) for qt in qts] for qts in out]
