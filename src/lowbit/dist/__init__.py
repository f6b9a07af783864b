"""Work spread over processes with torch.distributed (``torchrun``), and the one-process case.

    from lowbit.dist import Group
    group = Group.join()          # under torchrun: init the default process group (gloo on CPU,
                                  # NCCL for CUDA work); alone: Group.single()
    group.rank, group.world       # 0 <= rank < world
    group.owns(i)                 # whether item i (a shard, a GPTQ group) is this rank's: i % world
    group.balance(sizes)          # this rank's items, each to the least loaded rank (largest first)
    group.barrier()
    group.max_(t)                 # in place, exact: every rank ends with the elementwise max
    obj = group.broadcast_object(obj, src)

Nothing here changes numerics: a max is exact in any order, and sums that must not depend on
the number of processes are made in a fixed order by their callers (``lowbit.dist.chain``).
``Group.single()`` does every operation locally, so code written against a Group runs the same
with one process and without torch.distributed.
"""

from lowbit.dist.group import Group, DistError

__all__ = ["Group", "DistError"]
