"""Progress bars for model-free quantization: one per shard in flight and one overall, in bytes
of source read, with throughput (rich)."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import (
    BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TimeRemainingColumn, TransferSpeedColumn,
)


class ShardProgress:
    """Consumes worker events ("start"|"advance"|"done", shard, bytes); a no-op when disabled."""

    def __init__(self, enabled: bool | None, total_bytes: int, done_bytes: int = 0, n_shards: int = 0,
                 label: str | None = None) -> None:
        """``label``: the overall bar's (default: "all ``n_shards`` shards")."""
        if enabled is None:
            enabled = sys.stderr.isatty()
        self.enabled = enabled
        self._tasks: dict[str, TaskID] = {}
        if not enabled:
            self._p = None
            return
        self._p = Progress(
            TextColumn("{task.description}", justify="left"), BarColumn(), DownloadColumn(),
            TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True), transient=False,
        )
        self._overall = self._p.add_task(label or f"[bold]all {n_shards} shards", total=max(total_bytes, 1),
                                         completed=done_bytes)

    def __enter__(self) -> "ShardProgress":
        if self._p is not None:
            self._p.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._p is not None:
            self._p.stop()

    def handle(self, event: tuple[str, str, int]) -> None:
        if self._p is None:
            return
        kind, shard, n = event
        if kind == "start":
            self._tasks[shard] = self._p.add_task(f"  {shard}", total=max(n, 1))
        elif kind == "advance":
            if shard in self._tasks:
                self._p.advance(self._tasks[shard], n)
            self._p.advance(self._overall, n)
        elif kind == "done" and shard in self._tasks:
            self._p.remove_task(self._tasks.pop(shard))

    def log(self, msg: str) -> None:
        if self._p is not None:
            self._p.console.print(msg, highlight=False)
