"""The worker pool of a model-free run: spawned processes, one compute thread each, that run the
units of work (lowbit.modelfree.worker.run_job) and send progress events back.

``RunOptions.pool`` names the factory a run uses, ``pool(n)`` for ``n`` workers (None: ``ProcessPool``).
A pool has two methods: ``run(jobs, progress)`` runs every job and returns when all are done,
re-raising the first error (and closing the pool at once, before the caller removes the folder
the other workers write into); ``close(ok)`` ends it (``ok``: wait for the workers to finish,
else terminate them).
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

from lowbit.kernels.select import current
from lowbit.modelfree.progress import ShardProgress
from lowbit.modelfree.worker import ShardJob, init_worker, run_job, warm_up


class ProcessPool:
    """Spawned worker processes, started early (while the plan is made) and warmed up; each adopts
    this process's kernel setting."""

    def __init__(self, n: int) -> None:
        ctx = mp.get_context("spawn")
        self.events = ctx.Queue()
        self.ex = ProcessPoolExecutor(max_workers=n, mp_context=ctx, initializer=init_worker,
                                      initargs=(self.events, 1, current()))
        self.warm = [self.ex.submit(warm_up) for _ in range(n)]  # spawns them all now

    def run(self, jobs: list[ShardJob], prog: ShardProgress) -> None:
        def drain() -> None:
            while True:
                try:
                    prog.handle(self.events.get_nowait())
                except queue_mod.Empty:
                    return

        try:
            pending = {self.ex.submit(run_job, job) for job in jobs}
            while pending:
                done, pending = wait(pending, timeout=0.1, return_when=FIRST_COMPLETED)
                drain()
                for f in done:
                    f.result()  # re-raises a worker's error here
            drain()
        except BaseException:
            self.close(ok=False)  # before the caller removes the folder the other workers write into
            raise

    def close(self, ok: bool) -> None:
        """End the pool; a second call (``run`` closed it on an error, the run's end closes it again)
        does nothing more: a shut-down executor holds no processes (``_processes`` is None)."""
        if ok:
            self.ex.shutdown(wait=True)
            return
        for p in list((getattr(self.ex, "_processes", None) or {}).values()):
            if p.is_alive():
                p.terminate()
        self.ex.shutdown(wait=True, cancel_futures=True)
