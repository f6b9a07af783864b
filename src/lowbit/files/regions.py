"""Safetensors shards written in place: the file is created at its final size with its final
header, then tensors go straight to their byte ranges as they are produced (never a whole shard in
memory), by one or several writers at once, each owning a contiguous run of entries and writing
them in any order.

The header's JSON is padded with spaces to a multiple of 8 bytes, as the safetensors format allows
and its own writer does. Output is deterministic: entries in plan order, ``__metadata__`` first,
no timestamps. The file lives under a temporary name until the caller renames it. A write the
system refuses is an OSError naming the file (lowbit.files.refused.writing).
"""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path

import torch

from lowbit.errors import LowbitError
from lowbit.files.folder import DTYPE_NAMES
from lowbit.files.refused import writing


def header_bytes(entries: list[tuple[str, str, tuple[int, ...], int, int]], metadata: dict[str, str]) -> bytes:
    h: dict[str, object] = {"__metadata__": dict(metadata)}
    for name, dtype, shape, b, e in entries:
        h[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [b, e]}
    return json.dumps(h, separators=(",", ":")).encode("utf-8")


def _copy_range(src, dst, offset_src: int, offset_dst: int, n: int) -> None:
    """Copy n bytes between files at explicit offsets (neither file's position is used, so other
    threads may write elsewhere in ``dst`` meanwhile): os.copy_file_range (in the kernel) where the
    system allows it, else chunked pread/pwrite."""
    kernel = hasattr(os, "copy_file_range")
    while n > 0:
        k = 0
        if kernel:
            try:
                k = os.copy_file_range(src.fileno(), dst.fileno(), min(n, 1 << 30), offset_src, offset_dst)
            except OSError:
                kernel = False
        if k <= 0:
            chunk = os.pread(src.fileno(), min(n, 16 << 20), offset_src)
            if not chunk:
                raise OSError(f"{getattr(src, 'name', 'source')}: unexpected end of file at byte {offset_src}")
            k = 0
            while k < len(chunk):
                k += os.pwrite(dst.fileno(), chunk[k:], offset_dst + k)
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
    with writing(path), open(path, "wb") as f:
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
    laid out one after another from file offset ``start``. Each tensor goes to its entry's offset,
    in any order and from any thread (a raw copy may run beside tensor writes); every tensor is
    checked against its entry, and each entry is written once: a mismatch is an error, never a
    wrong file."""

    def __init__(self, path: Path, start: int, entries) -> None:
        self.path = Path(path)
        self.entries = list(entries)
        self.offsets: dict[str, tuple[int, int]] = {}  # name -> (entry index, file offset)
        pos = start
        for k, e in enumerate(self.entries):
            self.offsets[e.name] = (k, pos)
            pos += e.nbytes
        self.written = [False] * len(self.entries)
        self._lock = threading.Lock()
        self.f = open(self.path, "r+b")

    def _claim(self, name: str, dtype: str, shape: tuple[int, ...], n: int) -> int:
        """The file offset of entry ``name``, after checking the tensor against it."""
        k, pos = self.offsets.get(name, (None, 0))
        e = None if k is None else self.entries[k]
        if e is None or (e.dtype, tuple(e.shape), e.nbytes) != (dtype, tuple(shape), n):
            want = "no such tensor" if e is None else f"{e.name!r} {e.dtype} {tuple(e.shape)}"
            raise LowbitError(f"internal error writing {self.path}: got tensor {name!r} {dtype} {tuple(shape)}, "
                              f"the planned header says {want}")
        with self._lock:
            if self.written[k]:
                raise LowbitError(f"internal error writing {self.path}: tensor {name!r} written twice")
            self.written[k] = True
        return pos

    def add(self, name: str, t: torch.Tensor) -> None:
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"tensor {name!r}: dtype {t.dtype} cannot be stored in safetensors here")
        t = t.detach().contiguous()
        n = t.numel() * t.element_size()
        pos = self._claim(name, DTYPE_NAMES[t.dtype], tuple(t.shape), n)
        view = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if n else memoryview(b"")
        done = 0
        with writing(self.path):
            while done < n:
                done += os.pwrite(self.f.fileno(), view[done:], pos + done)

    def add_raw(self, name: str, dtype: str, shape: tuple[int, ...], src: Path, src_offset: int, n: int) -> None:
        """A tensor copied byte for byte from another file (kernel-side, never in memory)."""
        pos = self._claim(name, dtype, shape, n)
        with open(src, "rb") as fsrc, writing(self.path):
            _copy_range(fsrc, self.f, src_offset, pos, n)

    def finish(self) -> None:
        missing = [e.name for e, w in zip(self.entries, self.written) if not w]
        if missing:
            raise LowbitError(f"internal error writing {self.path}: {len(missing)} planned tensors were not "
                              f"written (first: {missing[0]!r})")
        self.f.close()

    def close(self) -> None:
        self.f.close()
