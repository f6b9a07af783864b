"""A GGUF file's key/values and tensor types read straight from its header, without its tensors.

gguf-py's ``GGUFReader`` parses every key into numpy views, one per array element: on a file
with a 262144-token vocabulary (Gemma 3) that is 0.8 M views and about 23 s, for keys that take
about 0.3 s to read as the layout has them. The layout (GGUF v2 / v3, little-endian): magic
``GGUF``, uint32 version, uint64 tensor count, uint64 key count, then per key a string (uint64
length, UTF-8 bytes), a uint32 value type and the value: a scalar, a string, or an array (uint32
element type, uint64 count, the elements); then per tensor its name (a string), uint32 axis
count, uint64 per axis, uint32 GGML type and uint64 data offset. ``read_keys`` gives what
``GGUFReader``'s ``fields[key].contents()`` gives, with the value and element types;
``read_tensor_types`` each tensor's GGML type code, in the file's order. A file they do not read
(another byte order, an array of arrays) is left to ``GGUFReader`` by the caller.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

#: value type -> (struct format, numpy dtype) of the scalar types (gguf.GGUFValueType's codes)
SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"), 5: ("<i", "<i4"),
    6: ("<f", "<f4"), 7: ("<?", "?"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}
STRING, ARRAY = 8, 9


class Unsupported(ValueError):
    """A header ``read_keys`` does not read (big-endian, an array of arrays, an unknown type)."""


def read_keys(path: str | Path) -> dict[str, tuple[Any, int, int | None]]:
    """key -> (value, value type, element type of an array or None), in the file's order. Raises
    ``Unsupported`` for a header this reader leaves to ``GGUFReader``, ValueError for a file that
    is not GGUF or is cut short, OSError when it cannot be opened."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _Header(buf).keys()


def read_tensor_types(path: str | Path) -> dict[str, int]:
    """Tensor name -> GGML type code (``gguf.GGMLQuantizationType``'s), in the file's order; the
    errors of ``read_keys``."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        head = _Header(buf)
        head.keys()
        return head.tensor_types()


class _Header:
    def __init__(self, buf) -> None:
        self.buf, self.at = buf, 0

    def take(self, fmt: str) -> Any:
        try:
            (v,) = struct.unpack_from(fmt, self.buf, self.at)
        except struct.error:
            raise ValueError("the header is cut short") from None
        self.at += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("<Q")
        if self.at + n > len(self.buf):
            raise ValueError("the header is cut short")
        s = str(self.buf[self.at:self.at + n], encoding="utf-8")
        self.at += n
        return s

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind not in SCALARS:
            raise Unsupported(f"value type {kind}")
        return self.take(SCALARS[kind][0])

    def keys(self) -> dict[str, tuple[Any, int, int | None]]:
        if bytes(self.buf[:4]) != b"GGUF":
            raise ValueError("not a GGUF file (no GGUF magic)")
        self.at = 4
        version = self.take("<I")
        if version not in (2, 3):
            raise Unsupported(f"version {version} (another byte order?)")
        self.n_tensors = self.take("<Q")
        out = {}
        for _ in range(self.take("<Q")):
            key = self.string()
            kind = self.take("<I")
            if kind != ARRAY:
                out[key] = (self.value(kind), kind, None)
                continue
            sub, count = self.take("<I"), self.take("<Q")
            if sub == STRING:
                out[key] = ([self.string() for _ in range(count)], kind, sub)
            elif sub in SCALARS:
                dtype = np.dtype(SCALARS[sub][1])
                if self.at + count * dtype.itemsize > len(self.buf):
                    raise ValueError("the header is cut short")
                out[key] = (np.frombuffer(self.buf, dtype, count, self.at).tolist(), kind, sub)
                self.at += count * dtype.itemsize
            else:
                raise Unsupported(f"array of type {sub} in key {key!r}")
        return out

    def tensor_types(self) -> dict[str, int]:
        """After ``keys``: each tensor's GGML type code."""
        out = {}
        for _ in range(self.n_tensors):
            name = self.string()
            for _ in range(self.take("<I")):
                self.take("<Q")
            out[name] = self.take("<I")
            self.take("<Q")  # data offset
        return out
