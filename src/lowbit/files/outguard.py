"""Refusing an output folder whose writing would destroy the source checkpoint.

    check_not_source(src, out)   # FormatError when writing ``out`` would replace or delete ``src``

Both paths are resolved first (symlinks, ``..``, relative paths), so the same folder reached two
ways is still the same folder. Refused: ``out`` is ``src``; ``out`` is a folder above ``src`` (the
atomic rename would move the source away with the old output); ``out`` is inside ``src`` and
already exists (every existing entry there belongs to the source, e.g. a shard file). A new folder
inside the source is allowed: nothing of the source is touched.
"""

from __future__ import annotations

import os
from pathlib import Path

from lowbit.errors import FormatError


def check_not_source(src: str | os.PathLike, out: str | os.PathLike) -> None:
    """FormatError naming both folders when writing ``out`` would overwrite or remove ``src``."""
    src_p, out_p = Path(src).resolve(), Path(out).resolve()
    if out_p == src_p or out_p in src_p.parents:
        raise FormatError(f"output folder {out_p} would overwrite the source checkpoint {src_p}: "
                          f"choose another --output")
    if src_p in out_p.parents and os.path.lexists(out_p):
        raise FormatError(f"output {out_p} is an existing entry of the source checkpoint {src_p} and would "
                          f"be overwritten: choose another --output")
