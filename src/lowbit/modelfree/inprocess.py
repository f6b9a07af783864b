"""Units of work run in this process: runner threads taking the jobs in turn (the case without a
worker pool: few workers, a small checkpoint, a device, or RunOptions.on_event)."""

from __future__ import annotations

import queue as queue_mod
import threading

from lowbit.modelfree.options import Event
from lowbit.modelfree.progress import ShardProgress
from lowbit.modelfree.worker import JobCancelled, JobIO, ShardJob, run_job


def run_in_process(jobs: list[ShardJob], workers: int, prog: ShardProgress, on_event: Event | None = None) -> None:
    """Jobs in this process: up to ``workers`` runner threads take the jobs in order (largest
    first), each keeping its I/O and buffers from one job to the next (JobIO); the kernels
    release the GIL, and each op is single-threaded (the caller's one_thread: intra-op thread
    pools spin-wait, which on a busy machine burns CPU time for nothing). The first error stops the
    other jobs at their next tensor and is raised."""
    n = min(max(1, workers), len(jobs))
    # I/O threads only where a runner has a core to spare (fewer jobs than workers) or a device
    # does the arithmetic; runners that take every core do their I/O themselves (JobIO)
    io_threads = n < max(1, workers) or any(job.device is not None for job in jobs)
    todo: queue_mod.SimpleQueue[ShardJob] = queue_mod.SimpleQueue()
    for job in jobs:
        todo.put(job)
    cancel = threading.Event()
    errors: list[BaseException] = []

    def runner() -> None:
        with JobIO(threads=io_threads) as io:
            while not cancel.is_set():
                try:
                    job = todo.get_nowait()
                except queue_mod.Empty:
                    return
                try:
                    run_job(job, prog.handle, cancel if n > 1 else None, io, on_event)
                except BaseException as e:  # noqa: BLE001 - handed to the calling thread
                    errors.append(e)
                    cancel.set()
                    return

    if n == 1:
        runner()
    else:
        threads = [threading.Thread(target=runner, name=f"lowbit-job_{k}") for k in range(n)]
        for t in threads:
            t.start()
        try:
            for t in threads:
                t.join()
        except BaseException:
            cancel.set()  # Ctrl-C here: the runners stop at their next tensor
            for t in threads:
                t.join()
            raise
    if errors:
        first = next((e for e in errors if not isinstance(e, JobCancelled)), errors[0])
        raise first
