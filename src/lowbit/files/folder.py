"""Reading a Hugging Face folder's safetensors lazily, with clear errors for damaged files.

    folder = SafetensorsFolder(path)          # validates the index and every shard header
    "model.embed_tokens.weight" in folder     # names come from the headers; nothing is loaded
    t = folder["model.embed_tokens.weight"]   # one tensor, read through safetensors.safe_open
    folder.info(name)                          # (dtype string, shape, shard file) from the header

Every shard's header is parsed by hand first (8-byte little-endian length, JSON, data offsets),
so a missing shard, a truncated file or a corrupt header is a FormatError naming the file.

Weight file names (``WeightFiles``): the standard Hugging Face names (stem ``model``:
``model.safetensors``, ``model-0000i-of-0000n.safetensors``, ``model.safetensors.index.json``), used
by the ``fake`` and ``compressed-tensors`` formats, which stock loaders read correctly; and the
``lowbit`` format's own names (stem ``lowbit-model``), which stock loaders do not look for, so
transformers fails loudly (no weights file) instead of loading uninitialised weights for layers
it does not understand. The reader finds either naming (a folder holding both is an error);
without an index or a single file of either naming it reads every ``*.safetensors`` in the folder.
"""

from __future__ import annotations

import copy
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from lowbit.errors import FormatError

STANDARD_STEM = "model"        # what transformers, vLLM and other stock loaders look for
LOWBIT_STEM = "lowbit-model"   # the lowbit format's weights: invisible to stock loaders
WEIGHT_STEMS = (STANDARD_STEM, LOWBIT_STEM)


@dataclass(frozen=True)
class WeightFiles:
    """The safetensors file names of one weights stem (see the module docstring)."""

    stem: str = STANDARD_STEM

    @property
    def single(self) -> str:
        return f"{self.stem}.safetensors"

    @property
    def index(self) -> str:
        return f"{self.stem}.safetensors.index.json"

    def shard(self, i: int, n: int) -> str:
        """Shard ``i`` (1-based) of ``n``."""
        return f"{self.stem}-{i:05d}-of-{n:05d}.safetensors"

    def owns(self, filename: str) -> bool:
        """A shard file name of this stem (the single file or ``<stem>-...safetensors``)."""
        return filename == self.single or (filename.startswith(self.stem + "-") and filename.endswith(".safetensors"))


def weight_files(stem: str) -> WeightFiles:
    """The file names of a known weights stem (FormatError for any other)."""
    if stem not in WEIGHT_STEMS:
        raise FormatError(f"unknown weights file stem {stem!r}; expected one of {', '.join(WEIGHT_STEMS)}")
    return WeightFiles(stem)


def find_weight_files(path: Path) -> WeightFiles | None:
    """The naming a folder's weights use: the stem whose index or single file is present (None: no
    such file). A folder holding files of both namings is ambiguous: FormatError."""
    found = [WeightFiles(s) for s in WEIGHT_STEMS
             if (path / WeightFiles(s).index).is_file() or (path / WeightFiles(s).single).is_file()]
    if len(found) > 1:
        names = [n for f in found for n in (f.index, f.single) if (path / n).is_file()]
        raise FormatError(f"checkpoint folder {str(path)!r} holds weights under two namings ({', '.join(names)}); "
                          f"remove the stale ones")
    return found[0] if found else None


INDEX_NAME = WeightFiles(STANDARD_STEM).index
SINGLE_NAME = WeightFiles(STANDARD_STEM).single
MAX_HEADER = 100 * 1024 * 1024

#: safetensors dtype codes of the float weights lowbit quantizes from (formats.base.FLOAT_DTYPES as stored)
#: safetensors dtype codes and the torch dtypes they hold (one table, read and written alike)
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
FLOAT_DTYPE_CODES = frozenset({"F32", "F16", "BF16"})
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
               "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}


def check_shard_name(index: Path, shard: object) -> None:
    """FormatError unless ``shard``, a shard named by the index file ``index``, is a plain
    ``*.safetensors`` file name: no folder part (``../outside.safetensors``, ``sub/x.safetensors``), no
    absolute path, so a checkpoint is only ever read from inside its own folder."""
    if not isinstance(shard, str) or Path(shard).name != shard or "\\" in shard or \
            not shard.endswith(".safetensors"):
        raise FormatError(f"{str(index)!r} names an invalid shard file {shard!r} (a plain *.safetensors file name "
                          f"in the folder is expected)")


PICKLED_WEIGHTS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")


def refuse_pickled_only(path: Path) -> None:
    """FormatError when a folder with no ``*.safetensors`` file holds pickled PyTorch weights:
    lowbit reads safetensors only and never unpickles a file (unpickling runs code)."""
    if any(path.glob("*.safetensors")):
        return
    pickled = sorted(p.name for pat in PICKLED_WEIGHTS for p in path.glob(pat))
    if pickled:
        raise FormatError(f"{str(path)!r} holds only {pickled[0]} (pickled PyTorch weights); lowbit reads "
                          f"safetensors weights only and never unpickles them: convert the folder to "
                          f"model.safetensors first")


def read_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file, checked against the file size."""
    return read_header_and_offset(path)[0]


def read_header_and_offset(path: Path) -> tuple[dict[str, Any], int]:
    """(header, byte offset where the tensor data starts), checked against the file size: every
    tensor's byte range matches its dtype and shape and the ranges end exactly at the file end."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise FormatError(f"safetensors file {str(path)!r} is truncated: {size} bytes, no header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise FormatError(f"safetensors file {str(path)!r} has a corrupt or truncated header "
                                  f"(declares {n} header bytes, file has {size} bytes)")
            raw = f.read(n)
    except FileNotFoundError:
        raise FormatError(f"safetensors file {str(path)!r} is missing") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"safetensors file {str(path)!r} has a corrupt header: {e}") from None
    if not isinstance(header, dict):
        raise FormatError(f"safetensors file {str(path)!r} has a corrupt header (not a JSON object)")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = info["dtype"], info["shape"], info["data_offsets"]
            numel = 1
            for d in shape:
                numel *= int(d)
            want = numel * DTYPE_BYTES[dtype]
        except (KeyError, TypeError, ValueError):
            raise FormatError(f"safetensors file {str(path)!r}: corrupt header entry for tensor {name!r}") from None
        if b - a != want or a < 0:
            raise FormatError(f"safetensors file {str(path)!r}: tensor {name!r} offsets {a}..{b} do not match "
                              f"dtype {dtype} shape {shape}")
        end = max(end, b)
    if 8 + n + end != size:
        raise FormatError(f"safetensors file {str(path)!r} is truncated or has trailing bytes: header declares "
                          f"{8 + n + end} bytes, file has {size}")
    return header, 8 + n


class SafetensorsFolder(Mapping):
    """A read-only, lazy mapping of every tensor in a folder's safetensors shards."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise FormatError(f"checkpoint folder {str(self.path)!r} does not exist or is not a folder")
        self._where: dict[str, str] = {}
        self._disk: dict[str, str] = {}  # name -> the name in the file, where they differ (with_names)
        self._headers: dict[str, dict[str, Any]] = {}
        self._handles: dict[str, Any] = {}
        refuse_pickled_only(self.path)
        self.files = find_weight_files(self.path)
        index = self.path / (self.files or WeightFiles()).index
        self.index_path: Path | None = index if index.is_file() else None
        if self.index_path is not None:
            try:
                wm = json.loads(index.read_text())["weight_map"]
                assert isinstance(wm, dict)
            except (json.JSONDecodeError, KeyError, AssertionError, TypeError):
                raise FormatError(f"{str(index)!r} is not a valid index (needs a 'weight_map' object)") from None
            for shard in sorted(set(wm.values()), key=str):
                check_shard_name(index, shard)
                if not (self.path / shard).exists():
                    raise FormatError(f"shard {shard!r} named by {index.name} is missing from {str(self.path)!r}")
                self._headers[shard] = read_header(self.path / shard)
            for name, shard in wm.items():
                if name not in self._headers[shard]:
                    raise FormatError(f"{index.name} puts tensor {name!r} in {shard!r}, which does not contain it")
            self._where = dict(wm)
            for shard, h in self._headers.items():  # tensors present but not indexed are still readable
                for name in h:
                    if name != "__metadata__":
                        self._where.setdefault(name, shard)
        else:
            shards = [self.files.single] if self.files is not None else \
                sorted(p.name for p in self.path.glob("*.safetensors"))
            if not shards:
                expected = " or ".join(n for s in WEIGHT_STEMS for n in (WeightFiles(s).single, WeightFiles(s).index))
                raise FormatError(f"no safetensors weights in {str(self.path)!r} (expected {expected})")
            for shard in shards:
                self._headers[shard] = read_header(self.path / shard)
                for name in self._headers[shard]:
                    if name == "__metadata__":
                        continue
                    if name in self._where:
                        raise FormatError(f"tensor {name!r} appears in both {self._where[name]!r} and {shard!r}")
                    self._where[name] = shard

    # ------------------------------------------------------------------ Mapping
    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def __getitem__(self, name: str) -> torch.Tensor:
        shard = self._where[name]
        h = self._handles.get(shard)
        if h is None:
            try:
                h = safe_open(str(self.path / shard), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types
                raise FormatError(f"cannot open safetensors file {str(self.path / shard)!r}: {e}") from None
            self._handles[shard] = h
        try:
            return h.get_tensor(self._disk.get(name, name))
        except Exception as e:
            raise FormatError(f"cannot read tensor {name!r} from {str(self.path / shard)!r}: {e}") from None

    # ------------------------------------------------------------------ metadata
    def describe(self, name: str) -> str:
        return f"{self._disk.get(name, name)!r} in {self._where.get(name, '?')}"

    def shard_of(self, name: str) -> str:
        return self._where[name]

    def info(self, name: str) -> tuple[str, list[int], str]:
        shard = self._where[name]
        e = self._headers[shard][self._disk.get(name, name)]
        return e["dtype"], list(e["shape"]), shard

    def nbytes(self, name: str) -> int:
        dtype, shape, _ = self.info(name)
        n = DTYPE_BYTES[dtype]
        for d in shape:
            n *= d
        return n

    def with_names(self, names: dict[str, str]) -> "SafetensorsFolder":
        """A view of the same files whose tensors are called ``names[file name]`` (names not in
        ``names`` keep theirs); ``describe`` still shows the name in the file. Two file names
        mapped to one name are a FormatError."""
        view = copy.copy(self)
        view._where, view._disk = {}, {}
        for disk, shard in self._where.items():
            new = names.get(disk, disk)
            if new in view._where:
                raise FormatError(f"tensors {view._disk.get(new, new)!r} and {disk!r} in {str(self.path)!r} "
                                  f"both stand for {new!r}")
            view._where[new] = shard
            if new != disk:
                view._disk[new] = self._disk.get(disk, disk)
        return view

    def shards(self) -> list[str]:
        return sorted(self._headers)

    def close(self) -> None:
        self._handles.clear()


def read_config(path: str | Path) -> dict[str, Any]:
    p = Path(path) / "config.json"
    if not p.exists():
        raise FormatError(f"{str(p)!r} is missing: a checkpoint folder needs its config.json")
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise FormatError(f"{str(p)!r} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise FormatError(f"{str(p)!r} must hold a JSON object")
    return cfg
