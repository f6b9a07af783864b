"""An OS-level lock on an output folder, so two runs never write the same folder at once.

    with output_lock(out):      # OutputError at once if another process holds it
        ...                      # build .<name>.lowbit-tmp, rename it to out

The lock is ``fcntl.flock`` on ``<parent>/.<name>.lowbit-lock``: the kernel releases it when the
holder exits, however it exits (a killed run never leaves a stale lock). The holder removes the
file on release; a waiter that locked a file removed meanwhile retries on the new one, so two
processes never both believe they hold the lock. In one process the lock is reentrant for the
thread holding it (``lowbit quantize`` holds it across loading, calibration and ``lowbit.save``,
which takes it again), and the outermost holder releases it; another thread of the same process is
refused like another process.
Without ``fcntl`` (Windows) no lock is taken.
"""

from __future__ import annotations

import errno
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from lowbit.errors import OutputError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

_held: dict[str, tuple[int, int]] = {}  # lock path -> (fd or -1 without fcntl, owner thread)
_guard = threading.Lock()


def lock_path(out: str | os.PathLike) -> Path:
    """The lock file of output folder ``out`` (next to it, in its parent folder)."""
    out_p = Path(out).resolve()
    return out_p.parent / f".{out_p.name}.lowbit-lock"


def _busy(out: Path, path: Path) -> OutputError:
    return OutputError(f"output folder {out} is being written by another lowbit run (it holds the lock "
                       f"{path}); wait for it to finish or choose another --output")


def _missing_parents(path: Path) -> list[Path]:
    """The folders above ``path`` that do not exist yet, innermost first."""
    out = []
    for p in path.parents:
        if p.exists():
            break
        out.append(p)
    return out


def _remove_empty(folders: list[Path]) -> None:
    for p in folders:  # innermost first; one that is not empty (a finished output) stops it
        try:
            p.rmdir()
        except OSError:
            return


def _acquire(out: Path, path: Path) -> int:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create the output folder's parent {path.parent}: {e.strerror}") from None
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise OutputError(f"cannot write next to the output folder {out}: {path}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise _busy(out, path) from None
            raise OutputError(f"cannot lock {path}: {e.strerror}") from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the holder removed this file as we locked it: lock the new one


@contextmanager
def output_lock(out: str | os.PathLike) -> Iterator[Path]:
    """Hold the lock of output folder ``out`` for the ``with`` block; yields the lock file's path.
    OutputError (naming the folder and the lock file) when another process or thread holds it.
    Inside a block of the same thread holding it, this is a no-op: the outermost block releases it
    when it ends, whatever the inner ones did."""
    out_p = Path(out).resolve()
    path = lock_path(out_p)
    key = str(path)
    me = threading.get_ident()
    with _guard:
        held = _held.get(key)
        if held is not None:
            if held[1] != me:
                raise _busy(out_p, path)
            outermost = False
        else:
            made = _missing_parents(path)  # created for the lock: removed again if nothing was written
            try:
                _held[key] = (_acquire(out_p, path) if fcntl is not None else -1, me)
            except BaseException:
                _remove_empty(made)
                raise
            outermost = True
    try:
        yield path
    finally:
        if outermost:
            with _guard:
                fd, _ = _held.pop(key)
                if fd >= 0:
                    try:
                        path.unlink()
                    except OSError:
                        pass
                    os.close(fd)  # closing the last descriptor releases the flock
                _remove_empty(made)
