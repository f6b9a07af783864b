"""One safetensors shard's tensors read lazily: the header parsed into a table of ``TensorInfo``
(shard, dtype, shape, byte range; checked against the file size by ``lowbit.files.folder``), and
each tensor a view of the shard's memory map (pages are read when touched). ``TensorReader``
replaces a map every ``REOPEN_BYTES`` read from it, so that the pages it touched are released (a
map held over a whole shard keeps the shard resident in RSS).
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from pathlib import Path

import torch

from lowbit.errors import FormatError
from lowbit.files.folder import DTYPES, read_header_and_offset

REOPEN_BYTES = 64 << 20  # the default, also of lowbit.modelfree.options.RunOptions.reopen_bytes


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives and what it is, from its shard's header."""

    name: str
    shard: str
    dtype: str      # safetensors dtype code ("BF16", "F8_E4M3"...)
    shape: tuple[int, ...]
    begin: int      # byte offsets in the shard's data section
    end: int
    data_start: int = 0  # file offset of the data section (8 + header length)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and check one shard's header: (tensors by name, __metadata__).

    A truncated or corrupt file is a FormatError naming it (``lowbit.files.folder`` checks the
    header against the file size, so a shard cut short is caught before anything is written)."""
    header, data_start = read_header_and_offset(path)
    meta = header.pop("__metadata__", None) or {}
    out: dict[str, TensorInfo] = {}
    for name, h in header.items():
        if h["dtype"] not in DTYPES:
            raise FormatError(f"shard {path}: tensor {name!r} has unsupported dtype {h['dtype']}")
        b, e = h["data_offsets"]
        out[name] = TensorInfo(name, path.name, h["dtype"], tuple(int(d) for d in h["shape"]), int(b), int(e),
                               data_start)
    return out, meta


class TensorReader:
    """Tensors as views of their shard's memory map (private and read-only in use: nothing is
    ever written to the file); the map is replaced every ``reopen_bytes`` read from it, and an
    old map is unmapped when the last tensor viewing it is gone; byte ranges were checked with
    the header. (Cheaper than safetensors' ``get_tensor``: bench/modelfree/RESULTS-modelfree.md, section 7.)"""

    def __init__(self, root: Path, reopen_bytes: int | None = None) -> None:
        self.root = Path(root)
        self.reopen_bytes = REOPEN_BYTES if reopen_bytes is None else reopen_bytes
        self._maps: dict[str, torch.Tensor] = {}
        self._read: dict[str, int] = {}

    def _map(self, shard: str) -> torch.Tensor:
        path = self.root / shard
        try:
            with open(path, "rb") as f:
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as e:
            raise FormatError(f"shard {path}: cannot open ({e})") from None
        return torch.frombuffer(m, dtype=torch.uint8)

    def get(self, info: TensorInfo) -> torch.Tensor:
        buf = self._maps.get(info.shard)
        if buf is None or self._read[info.shard] >= self.reopen_bytes:
            self._maps.pop(info.shard, None)
            buf = self._maps[info.shard] = self._map(info.shard)
            self._read[info.shard] = 0
        start = info.data_start + info.begin
        if start + info.nbytes > buf.numel():
            raise FormatError(f"shard {self.root / info.shard}: tensor {info.name!r} extends past the end of "
                              f"the file (changed since its header was read?)")
        raw = buf[start:start + info.nbytes]
        dtype = DTYPES[info.dtype]
        if start % dtype.itemsize:
            raw = raw.clone()  # safetensors does not promise aligned data: a misaligned tensor is copied
        self._read[info.shard] += info.nbytes
        return raw.view(dtype).view(info.shape)

    def close(self) -> None:
        self._maps.clear()
