"""Safetensors shards written in place: the file is created at its final size with its final
header, then tensors go straight to their byte ranges as they are produced (never a whole shard in
memory), by one or several writers at once, each owning a contiguous run of entries.

The header's JSON is padded with spaces to a multiple of 8 bytes, as the safetensors format allows
and its own writer does. Output is deterministic: entries in plan order, ``__metadata__`` first,
no timestamps. The file lives under a temporary name until the caller renames it.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from lowbit.errors import LowbitError
from lowbit.modelfree.source import DTYPE_NAMES


def header_bytes(entries: list[tuple[str, str, tuple[int, ...], int, int]], metadata: dict[str, str]) -> bytes:
    h: dict[str, object] = {"__metadata__": dict(metadata)}
    for name, dtype, shape, b, e in entries:
        h[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [b, e]}
    return json.dumps(h, separators=(",", ":")).encode("utf-8")


def _copy_range(src, dst, offset_src: int, offset_dst: int, n: int) -> None:
    """Copy n bytes between files at explicit offsets: os.copy_file_range (in the kernel) where the
    system allows it, else a chunked read/write. ``dst`` must have no unflushed writes."""
    kernel = hasattr(os, "copy_file_range")
    while n > 0:
        k = 0
        if kernel:
            try:
                k = os.copy_file_range(src.fileno(), dst.fileno(), min(n, 1 << 30), offset_src, offset_dst)
            except OSError:
                kernel = False
        if k <= 0:
            src.seek(offset_src)
            chunk = src.read(min(n, 16 << 20))
            if not chunk:
                raise OSError(f"{getattr(src, 'name', 'source')}: unexpected end of file at byte {offset_src}")
            dst.seek(offset_dst)
            dst.write(chunk)
            dst.flush()
            k = len(chunk)
        offset_src += k
        offset_dst += k
        n -= k


def header_block(entries: list[tuple[str, str, tuple[int, ...], int, int]], metadata: dict[str, str]) -> bytes:
    """8-byte length + header JSON padded with spaces to a multiple of 8 bytes; the data section
    starts right after it."""
    h = header_bytes(entries, metadata)
    h = h + b" " * ((-(8 + len(h))) % 8)
    return struct.pack("<Q", len(h)) + h


def create_shard_file(path: Path, header: bytes, size: int) -> None:
    """``path`` with ``header`` at its start and zeros (a sparse hole) up to ``size`` bytes."""
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(size)


def shard_file_matches(path: Path, header: bytes, size: int) -> bool:
    """Whether ``path`` was created by create_shard_file with this header and size (a resumed run
    keeps the tensors already written into it)."""
    try:
        if path.stat().st_size != size:
            return False
        with open(path, "rb") as f:
            return f.read(len(header)) == header
    except FileNotFoundError:
        return False


class RegionWriter:
    """Writes the entries ``entries`` (name, dtype code, shape, byte size) of an existing shard file,
    in order, from file offset ``start``. Every tensor is checked against its entry: a mismatch is
    an error, never a wrong file."""

    def __init__(self, path: Path, start: int, entries) -> None:
        self.path = Path(path)
        self.entries = list(entries)
        self.pos = start
        self.i = 0
        self.f = open(self.path, "r+b")

    def _next(self, name: str, dtype: str, shape: tuple[int, ...], n: int) -> None:
        e = self.entries[self.i] if self.i < len(self.entries) else None
        if e is None or (e.name, e.dtype, tuple(e.shape), e.nbytes) != (name, dtype, tuple(shape), n):
            want = "nothing more" if e is None else f"{e.name!r} {e.dtype} {tuple(e.shape)}"
            raise LowbitError(f"internal error writing {self.path}: got tensor {name!r} {dtype} {tuple(shape)}, "
                              f"the planned header says {want}")
        self.i += 1

    def add(self, name: str, t: torch.Tensor) -> None:
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"tensor {name!r}: dtype {t.dtype} cannot be stored in safetensors here")
        t = t.detach().contiguous()
        n = t.numel() * t.element_size()
        self._next(name, DTYPE_NAMES[t.dtype], tuple(t.shape), n)
        view = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if n else memoryview(b"")
        done = 0
        while done < n:
            done += os.pwrite(self.f.fileno(), view[done:], self.pos + done)
        self.pos += n

    def add_raw(self, name: str, dtype: str, shape: tuple[int, ...], src: Path, src_offset: int, n: int) -> None:
        """A tensor copied byte for byte from another file (kernel-side, never in memory)."""
        self._next(name, dtype, shape, n)
        with open(src, "rb") as fsrc:
            _copy_range(fsrc, self.f, src_offset, self.pos, n)
        self.pos += n

    def finish(self) -> None:
        if self.i != len(self.entries):
            raise LowbitError(f"internal error writing {self.path}: {len(self.entries) - self.i} planned tensors "
                              f"were not written (first: {self.entries[self.i].name!r})")
        self.f.close()

    def close(self) -> None:
        self.f.close()
