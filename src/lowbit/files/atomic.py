"""The one atomic write of a file (no torch: the CLI's light paths use it too)."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from lowbit.files.refused import writing


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """The one atomic write of a file: yields a temporary path beside ``path`` (its name plus
    ``.partial``) for the block to write, renamed to ``path`` when the block completes and removed
    when it raises, so ``path`` is either as before or whole. A write the system refuses (disk
    full, read-only, no permission), by Python or by a Rust writer (safetensors, tokenizers),
    leaves as an OSError naming ``path`` (lowbit.files.refused.writing)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    try:
        with writing(path, tmp):
            yield tmp
            os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # a read-only file system: nothing was created to remove
            pass
        raise


def write_text_atomic(path: str | os.PathLike, text: str, encoding: str = "utf-8") -> None:
    """``text`` written to ``path`` atomically (``atomic_path``)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding=encoding)
