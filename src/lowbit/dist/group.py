"""``Group``: this process's place among the ranks of a torch.distributed job."""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

import torch

from lowbit.errors import LowbitError


class DistError(LowbitError, RuntimeError):
    """The distributed job cannot run as started (a rank failed, mismatched arguments)."""


def _launched() -> bool:
    """Whether this process was started by torchrun (or another launcher setting its variables)
    as one of several ranks."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        raise DistError(f"WORLD_SIZE={os.environ.get('WORLD_SIZE')!r} is not an integer") from None


def _end_started_group() -> None:
    """At exit, end the default process group that ``Group.join`` started, if the caller has not:
    a gloo group left to the interpreter's teardown can abort the process ("terminate called
    without an active exception") after its work is done, failing a finished job."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True)
class Group:
    """The ranks of one job. ``distributed`` False: a single process (every collective is local)."""

    rank: int = 0
    world: int = 1
    distributed: bool = False

    @classmethod
    def single(cls) -> "Group":
        return cls()

    @classmethod
    def join(cls, device: torch.device | None = None, timeout_s: float = 1800.0) -> "Group":
        """The default process group: the one already initialised, else, when started by torchrun
        with WORLD_SIZE > 1, a new one (NCCL when ``device`` is CUDA, gloo otherwise), else a
        single process. A group started here is ended at the interpreter's exit unless the
        caller ends it first (``torch.distributed.destroy_process_group``)."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size(), dist.get_world_size() > 1)
        if not _launched():
            return cls.single()
        if not dist.is_available():
            raise DistError("started as several ranks (WORLD_SIZE > 1) but this torch has no torch.distributed")
        backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        atexit.register(_end_started_group)
        if device is not None and device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return cls(dist.get_rank(), dist.get_world_size(), True)

    # ------------------------------------------------------------------ who does what
    def owns(self, i: int) -> bool:
        return i % self.world == self.rank

    def owner(self, i: int) -> int:
        return i % self.world

    def share(self, n: int) -> range:
        """This rank's contiguous share of n items in order: ranks get ceil or floor of n/world,
        the first ranks the larger shares."""
        base, extra = divmod(n, self.world)
        start = self.rank * base + min(self.rank, extra)
        return range(start, start + base + (1 if self.rank < extra else 0))

    def balance(self, sizes: Sequence[int]) -> list[int]:
        """The indices of this rank's items, given every item's size in the same order on every
        rank: each item in turn goes to the rank with the least size so far (ties: the lowest
        rank), so items sorted largest first give every rank about the same total. The same
        sizes give the same split on every rank."""
        load = [0] * self.world
        mine = []
        for i, size in enumerate(sizes):
            r = min(range(self.world), key=lambda k: (load[k], k))
            load[r] += size
            if r == self.rank:
                mine.append(i)
        return mine

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ collectives
    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        """Elementwise max over the ranks, in place (exact)."""
        if self.distributed:
            import torch.distributed as dist

            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """Elementwise sum over the ranks, in place (exact for integers, and for float64 values
        that are integer multiples of one power of two whose sums stay below 2^53 of it)."""
        if self.distributed:
            import torch.distributed as dist

            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def broadcast_(self, t: torch.Tensor, src: int) -> torch.Tensor:
        """``t`` from rank ``src`` on every rank, in place (shape and dtype must agree)."""
        if self.distributed:
            import torch.distributed as dist

            dist.broadcast(t, src=src)
        return t

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """A picklable object from rank ``src`` (trusted: every rank is this job's own process)."""
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's object, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def send(self, t: torch.Tensor, dst: int) -> None:
        import torch.distributed as dist

        dist.send(t.contiguous(), dst=dst)

    def recv(self, like: torch.Tensor, src: int) -> torch.Tensor:
        import torch.distributed as dist

        out = torch.empty_like(like)
        dist.recv(out, src=src)
        return out

    def agree(self, what: str, value: Any) -> None:
        """Refuse (DistError) a job whose ranks were started with different ``value`` (arguments,
        a fingerprint): they would write different outputs into one folder."""
        seen = self.gather_objects(value)
        if any(v != seen[0] for v in seen):
            raise DistError(f"the ranks of this job disagree on {what}: {seen}; start every rank with the same "
                            f"command")

    def agree_fields(self, what: str, fields: dict[str, Any]) -> None:
        """``agree`` on several named values in one collective; the DistError names the first
        field that differs and its value on each rank."""
        seen = self.gather_objects(fields)
        for key in fields:
            values = [s.get(key) for s in seen]
            if any(v != values[0] for v in values):
                raise DistError(f"the ranks of this job disagree on {what} {key!r}: {values} (rank 0, 1, ...); "
                                f"start every rank with the same command")
        if any(set(s) != set(fields) for s in seen):
            raise DistError(f"the ranks of this job disagree on which {what} they compare: "
                            f"{[sorted(s) for s in seen]}")
