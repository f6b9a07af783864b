"""Where an output folder is built before it is renamed into place."""

from __future__ import annotations

import os
from pathlib import Path


def temporary_folder(out: str | os.PathLike) -> Path:
    """Where the output folder ``out`` is built before it is renamed into place: ``.<name>.lowbit-tmp``
    beside it (lowbit.files.writer.CheckpointWriter)."""
    out = Path(out)
    return out.parent / f".{out.name}.lowbit-tmp"
