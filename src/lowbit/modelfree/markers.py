"""A model-free run's units of work on disk: output shards under a temporary name until done,
and done markers (written after a unit's last byte, checked against the run's fingerprint)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lowbit.errors import LowbitError
from lowbit.files.writer import write_text_atomic

MARKER_DIR = ".modelfree"


def part_name(shard: str, part: int, n_parts: int) -> str:
    return f"{shard}.part-{part + 1}-of-{n_parts}"


def partial_path(out_dir: str | Path, shard: str) -> Path:
    """The output shard while its jobs write into it."""
    return Path(out_dir) / f"{shard}.partial"


def marker_path(out_dir: str | Path, shard: str) -> Path:
    return Path(out_dir) / MARKER_DIR / f"{shard}.done.json"


def write_marker(out_dir: str | Path, name: str, meta: dict[str, Any]) -> None:
    write_text_atomic(marker_path(out_dir, name), json.dumps(meta))


def finalize_shard(out_dir: str | Path, shard: str, n_parts: int, fingerprint: str) -> dict[str, Any]:
    """Once every job of output shard ``shard`` is done: rename it into place, mark it done, then
    remove its jobs' markers."""
    out_dir = Path(out_dir)
    names = [part_name(shard, k, n_parts) for k in range(n_parts)]
    metas = [read_marker(out_dir, n, fingerprint) for n in names]
    if any(m is None for m in metas):
        raise LowbitError(f"shard {shard}: a part is missing, cannot finish it")  # pragma: no cover
    path = out_dir / shard
    os.replace(partial_path(out_dir, shard), path)
    result = {"shard": shard, "fingerprint": fingerprint, "file_size": path.stat().st_size,
              "quantized": sum(m["quantized"] for m in metas), "source_bytes": sum(m["source_bytes"] for m in metas)}
    write_marker(out_dir, shard, result)
    for n in names:
        marker_path(out_dir, n).unlink(missing_ok=True)
    return result


def read_marker(out_dir: str | Path, shard: str, fingerprint: str) -> dict[str, Any] | None:
    """The metadata of a shard finished by an earlier run with the same arguments, else None."""
    m = marker_path(out_dir, shard)
    try:
        meta = json.loads(m.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if meta.get("fingerprint") != fingerprint:
        return None
    p = Path(out_dir) / shard
    if meta.get("file_size"):
        if not p.is_file() or p.stat().st_size != meta["file_size"]:
            return None
    return meta
