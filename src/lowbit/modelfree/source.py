"""A Hugging Face safetensors checkpoint read lazily: config, index, shard headers, tensors.

Nothing here loads a whole shard. Headers are parsed directly (a few KB each, checked against
the file size: lowbit.files.folder) to know every tensor's shard, dtype, shape and byte range;
a tensor is a view of the shard's memory map (pages are read when touched), and the map is
replaced every ``REOPEN_BYTES`` so that the pages it touched are released (a map held over a
whole shard keeps the shard resident in RSS).
"""

from __future__ import annotations

import json
import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lowbit.errors import FormatError
from lowbit.files.folder import (
    DTYPES, FLOAT_DTYPE_CODES, INDEX_NAME, SINGLE_NAME, WeightFiles, check_shard_name, find_weight_files,
    read_header_and_offset, refuse_pickled_only,
)

REOPEN_BYTES = 64 << 20

FLOAT_SOURCES = FLOAT_DTYPE_CODES
FP8_SOURCES = frozenset({"F8_E4M3"})
CONFIG_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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


class Checkpoint:
    """A source checkpoint folder: config.json, shards (from the index or model.safetensors)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise FormatError(f"source checkpoint {self.root} is not a folder")
        cfg_path = self.root / "config.json"
        if not cfg_path.is_file():
            raise FormatError(f"source checkpoint {self.root} has no config.json (model-free quantization "
                              f"reads the architecture facts it needs from it)")
        try:
            self.config: dict[str, Any] = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise FormatError(f"{cfg_path}: invalid JSON ({e})") from None
        refuse_pickled_only(self.root)
        # either naming (a lowbit-format folder is then refused as already quantized, by make_plan)
        files = find_weight_files(self.root) or WeightFiles()
        self.index_path = self.root / files.index
        self.sharded = self.index_path.is_file()
        if self.sharded:
            try:
                index = json.loads(self.index_path.read_text())
                weight_map: dict[str, str] = dict(index["weight_map"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise FormatError(f"{self.index_path}: invalid index ({e!r})") from None
            for s in set(weight_map.values()):
                check_shard_name(self.index_path, s)
            shards = sorted(set(weight_map.values()))
            for s in shards:
                if not (self.root / s).is_file():
                    raise FormatError(f"{self.index_path} names shard {s!r}, which is missing from {self.root}")
        elif (self.root / files.single).is_file():
            weight_map, shards = {}, [files.single]
        else:
            raise FormatError(f"source checkpoint {self.root} has neither {INDEX_NAME} nor {SINGLE_NAME}")
        self.shards: list[str] = shards
        self.tensors: dict[str, TensorInfo] = {}
        self.shard_tensors: dict[str, list[TensorInfo]] = {}
        for s in shards:
            infos, _ = read_header(self.root / s)
            self.shard_tensors[s] = sorted(infos.values(), key=lambda t: t.begin)
            for name, info in infos.items():
                if name in self.tensors:
                    raise FormatError(f"tensor {name!r} appears in both {self.tensors[name].shard} and {s}")
                self.tensors[name] = info
        for name, s in weight_map.items():
            got = self.tensors.get(name)
            if got is None or got.shard != s:
                raise FormatError(f"{self.index_path} places tensor {name!r} in {s}, but that shard does not hold it")

    # ------------------------------------------------------------------ config facts
    @property
    def text_config(self) -> dict[str, Any]:
        """The language model's config (``text_config`` of multimodal models, else the config)."""
        tc = self.config.get("text_config")
        return tc if isinstance(tc, dict) else self.config

    def get(self, key: str, default: Any = None) -> Any:
        tc = self.text_config
        return tc.get(key, self.config.get(key, default))

    @property
    def dtype(self) -> torch.dtype:
        """The model's float dtype (config ``dtype`` / ``torch_dtype``), bf16 when unstated."""
        for cfg in (self.text_config, self.config):
            for key in ("dtype", "torch_dtype"):
                v = cfg.get(key)
                if isinstance(v, str) and v in CONFIG_DTYPES:
                    return CONFIG_DTYPES[v]
        return torch.bfloat16


class TensorReader:
    """Tensors as views of their shard's memory map (private and read-only in use: nothing is
    ever written to the file); the map is replaced every ``reopen_bytes`` read from it, and an
    old map is unmapped when the last tensor viewing it is gone; byte ranges were checked with
    the header. (Cheaper than safetensors' ``get_tensor``: bench/RESULTS-modelfree.md, section 7.)"""

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
