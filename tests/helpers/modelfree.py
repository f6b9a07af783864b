"""Model-free runs as the tests start them, and what they leave behind."""

from __future__ import annotations

import hashlib
from pathlib import Path

import lowbit


def mf(src: Path, out: Path, scheme: str, **kw) -> Path:
    """``lowbit.quantize_checkpoint`` in this process, quietly (workers=0: no worker processes)."""
    kw.setdefault("workers", 0)
    kw.setdefault("progress", False)
    return lowbit.quantize_checkpoint(src, out, scheme=scheme, **kw)


def no_output(out: Path) -> bool:
    """Neither the folder nor its temporary folder or lock exists."""
    return not out.exists() and not any(out.parent.glob(f".{out.name}*"))


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every file in ``folder`` (nothing else may be there)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(folder).iterdir())}
