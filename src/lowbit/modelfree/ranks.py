"""The steps of a model-free run that every rank of a torch.distributed job takes together.

A run split over ranks (``torchrun``; lowbit.dist.Group) is a fixed sequence of steps, and every
rank enters every step in the same order: a step is a collective. ``together(group, what)`` runs
its block on this rank, then waits for every rank to finish it. When the block raised on any
rank, the step raises on every rank, so no rank waits forever for one that has given up: the
rank's own exception where it failed, ``RankFailed`` (naming the first failed rank and its
error, in one line) on the others. In one process (``Group.single()``) it is the block alone.

A rank that fails does not stop the others at once: they finish the block (their share of the
units of work) first, then all raise; the failed rank waits for them at most the process group's
timeout (``Group.join``'s ``timeout_s``), after which it raises the timeout and torchrun ends the job. A rank that is killed never reaches the step; torchrun
then tears the whole job down, and the same command again resumes from the finished units.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from lowbit.dist import DistError, Group
from lowbit.errors import LowbitError, OutputError


class RankFailed(DistError):
    """Another rank of the job failed a step. ``data``: its error was a data or argument error
    (a LowbitError: the output is abandoned, as in one process) rather than a refused write or an
    interruption (the finished units stay in the temporary folder for a resumed run)."""

    def __init__(self, message: str, data: bool) -> None:
        super().__init__(message)
        self.data = data


def is_data_error(e: BaseException) -> bool:
    """Whether ``e`` abandons the output (removes the temporary folder) rather than leaving it to
    resume: a LowbitError, unless it is a refused write (OutputError: disk full, read-only) or
    reports another rank's refused write or interruption."""
    if isinstance(e, RankFailed):
        return e.data
    return isinstance(e, LowbitError) and not isinstance(e, OutputError)


def _one_line(e: BaseException) -> str:
    text = e.cli_message() if isinstance(e, LowbitError) else str(e)
    return " ".join(f"{type(e).__name__}: {text}".split())


@contextmanager
def together(group: Group, what: str) -> Iterator[None]:
    """Run the block on this rank, then wait for every rank to end it; raise on every rank if it
    raised on any (see the module's docstring). ``what`` names the step in the error."""
    if not group.distributed:
        yield
        return
    err: BaseException | None = None
    try:
        yield
    except BaseException as e:  # noqa: BLE001 - reported to the other ranks, then raised
        err = e
    mine = None if err is None else (_one_line(err), is_data_error(err))
    reports = group.gather_objects((what, mine))
    if err is not None:
        raise err
    for rank, (step, report) in enumerate(reports):
        if step != what:
            raise DistError(f"rank {rank} is at step {step!r} while rank {group.rank} is at {what!r}: "
                            f"the ranks run different code")
        if report is not None:
            msg, data = report
            raise RankFailed(f"rank {rank} of {group.world} failed while {what}: {msg}", data)
