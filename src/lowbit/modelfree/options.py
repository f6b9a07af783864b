"""RunOptions: how a model-free run cuts and schedules its work (never what it computes).

- ``part_bytes``: source bytes per unit of work; larger shards are split into parts (the parts
  of a shard are the same whatever ``workers`` is, and it is part of the resume fingerprint).
- ``pool_min_bytes`` / ``pool_min_workers``: less source, or fewer workers, runs in this process
  in threads (a spawned worker's start-up, importing torch, costs more than it saves on small
  checkpoints; threads beat spawned workers with 2 workers: bench/modelfree/RESULTS-modelfree.md,
  sections 3 and 7). Processes are for many workers on large checkpoints, a threshold a
  machine with more cores should decide.
- ``reopen_bytes``: bytes read from a shard's memory map before it is replaced (what bounds the
  resident memory of a shard being read; lowbit.files.tensors.TensorReader).
- ``pool``: makes the worker pool of a run that uses one, ``pool(n)`` for ``n`` workers (None:
  spawned processes, lowbit.modelfree.pool.ProcessPool; the protocol is stated there).
- ``on_event``: called as ``(event, job, tensor)`` after each tensor (``"tensor"``) and each
  finished unit of work (``"shard"``, tensor ``""``), in the thread that ran it; an exception it
  raises stops the run as any error does. A run with ``on_event`` stays in this process (a
  callable does not cross into worker processes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from lowbit.files.tensors import REOPEN_BYTES

Event = Callable[[str, str, str], None]
PoolFactory = Callable[[int], Any]  # n -> a pool with run(jobs, progress) and close(ok)


@dataclass(frozen=True)
class RunOptions:
    part_bytes: int = 128 << 20
    pool_min_bytes: int = 4 << 30
    pool_min_workers: int = 4
    reopen_bytes: int = REOPEN_BYTES
    on_event: Event | None = None
    pool: PoolFactory | None = None

    def __post_init__(self) -> None:
        for name in ("part_bytes", "pool_min_bytes", "pool_min_workers", "reopen_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"RunOptions.{name} must be a non-negative integer, got {value!r}")
