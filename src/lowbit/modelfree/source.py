"""A Hugging Face safetensors checkpoint as model-free quantization reads it: config, index and
every shard's tensor table (``lowbit.files.tensors``: headers parsed, tensors read as views of
memory maps), without loading a whole shard.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from lowbit.errors import FormatError
from lowbit.files.folder import (
    FLOAT_DTYPE_CODES, INDEX_NAME, SINGLE_NAME, WeightFiles, check_shard_name, find_weight_files,
    refuse_pickled_only,
)
from lowbit.files.tensors import TensorInfo, read_header

FLOAT_SOURCES = FLOAT_DTYPE_CODES
FP8_SOURCES = frozenset({"F8_E4M3"})
CONFIG_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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
