"""A streaming safetensors writer: tensors go to disk as they are produced, never a whole shard
in memory.

The data section is written after a reserved header region; at the end the header (its JSON
padded with spaces, as the safetensors format allows and its own writer does for alignment) is
written into that region. If the header outgrows the reservation, the data is moved once with
``os.copy_file_range``. The file is written under ``<name>.partial`` and renamed when complete.
Output is deterministic: entries in write order, ``__metadata__`` first, no timestamps.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

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


def header_block(entries: list[tuple[str, str, tuple[int, ...], int, int]], metadata: dict[str, str],
                 reserve: int) -> bytes:
    """8-byte length + header JSON padded with spaces: to exactly ``reserve`` bytes when it fits,
    else to the next multiple of 8. The data section starts right after it."""
    h = header_bytes(entries, metadata)
    room = reserve - 8
    if len(h) <= room:
        h = h + b" " * (room - len(h))
    else:
        h = h + b" " * ((-(8 + len(h))) % 8)
    return struct.pack("<Q", len(h)) + h


def reserve_for(names_and_kinds: list[tuple[str, bool]]) -> int:
    """Header room for a shard, from its tensor names (True: a quantized linear, several tensors)."""
    r = 96 + sum(8 * (len(n) + 112) if q else len(n) + 96 for n, q in names_and_kinds)
    return max(64, -(-r // 8) * 8)


def entries_from_meta(meta: dict[str, list]) -> list[tuple[str, str, tuple[int, ...], int, int]]:
    out, off = [], 0
    for name, (dtype, shape, n) in meta.items():
        out.append((name, dtype, tuple(shape), off, off + n))
        off += n
    return out


class StreamingShardWriter:
    """Writes a shard (``data_only=False``: header room, then data) or one part of a shard's data
    section (``data_only=True``: raw bytes, assembled later by ``assemble``)."""

    def __init__(self, path: Path, reserve: int, metadata: dict[str, str] | None = None,
                 data_only: bool = False) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".partial")
        self.metadata = dict(metadata or {"format": "pt"})
        self.data_only = data_only
        self.reserve = 0 if data_only else max(64, -(-int(reserve) // 8) * 8)
        self.entries: list[tuple[str, str, tuple[int, ...], int, int]] = []
        self.names: set[str] = set()
        self.offset = 0
        self.f = open(self.tmp, "wb")
        self.f.seek(self.reserve)

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self.names:
            raise ValueError(f"tensor {name!r} written twice to {self.path}")
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"tensor {name!r}: dtype {t.dtype} cannot be stored in safetensors here")
        t = t.detach().contiguous()
        n = t.numel() * t.element_size()
        if n:
            self.f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        self.entries.append((name, DTYPE_NAMES[t.dtype], tuple(t.shape), self.offset, self.offset + n))
        self.names.add(name)
        self.offset += n

    def add_raw(self, name: str, dtype: str, shape: tuple[int, ...], src: Path, src_offset: int, n: int) -> None:
        """A tensor copied byte for byte from another file (kernel-side, never in memory)."""
        if name in self.names:
            raise ValueError(f"tensor {name!r} written twice to {self.path}")
        self.f.flush()
        pos = self.reserve + self.offset
        with open(src, "rb") as fsrc:
            _copy_range(fsrc, self.f, src_offset, pos, n)
        self.f.seek(pos + n)
        self.entries.append((name, dtype, tuple(shape), self.offset, self.offset + n))
        self.names.add(name)
        self.offset += n

    def entries_meta(self) -> dict[str, list]:
        """{name: [dtype, shape, nbytes]} in write order."""
        return {n: [d, list(s), e - b] for n, d, s, b, e in self.entries}

    def finish(self) -> int:
        """Write the header (unless data only), rename into place; returns the file size."""
        if self.data_only:
            self.f.close()
        else:
            block = header_block(self.entries, self.metadata, self.reserve)
            if len(block) == self.reserve:
                self.f.seek(0)
                self.f.write(block)
                self.f.close()
            else:  # header larger than reserved: move the data once
                self.f.close()
                moved = self.tmp.with_name(self.tmp.name + "2")
                with open(self.tmp, "rb") as src, open(moved, "wb") as dst:
                    dst.write(block)
                    dst.flush()
                    _copy_range(src, dst, self.reserve, len(block), self.offset)
                os.replace(moved, self.tmp)
        size = self.tmp.stat().st_size
        os.replace(self.tmp, self.path)
        return size

    def abort(self) -> None:
        try:
            self.f.close()
        finally:
            for p in (self.tmp, self.tmp.with_name(self.tmp.name + "2")):
                p.unlink(missing_ok=True)


def assemble(path: Path, reserve: int, parts: list[tuple[Path, dict[str, list]]],
             metadata: dict[str, str] | None = None) -> int:
    """One shard from data-only parts (in order): the same bytes a single StreamingShardWriter
    with this ``reserve`` would have written. Returns the file size."""
    path = Path(path)
    meta: dict[str, list] = {}
    for _, m in parts:
        meta.update(m)
    block = header_block(entries_from_meta(meta), dict(metadata or {"format": "pt"}),
                         max(64, -(-int(reserve) // 8) * 8))
    tmp = path.with_name(path.name + ".partial")
    try:
        with open(tmp, "wb") as dst:
            dst.write(block)
            dst.flush()
            off = len(block)
            for p, m in parts:
                n = sum(v[2] for v in m.values())
                with open(p, "rb") as src:
                    _copy_range(src, dst, 0, off, n)
                off += n
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size
