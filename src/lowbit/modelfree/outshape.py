"""Every output shard's exact contents, known before any weight is quantized.

Each entry's name, dtype and shape (so its byte range) follows from the source header, the
scheme and the layout alone. Knowing them up front lets the shard file be created at its final
size with its final header, and every unit of work (a shard, or one part of a large shard)
write its tensors straight to their offsets, in parallel, with nothing joined afterwards.

A quantized linear's tensors are what its checkpoint format declares it writes
(``Layout.tensor_specs``: names, shapes, dtypes, in order, from the scheme and the weight's
shape; tests/formats/test_tensor_specs.py holds every layout to its writer). A shape the format
refuses is refused here, before anything is written. The writer checks every tensor it writes
against its entry, so a declaration that broke that contract would stop the run with an error,
never write a wrong file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowbit.modelfree.plan_types import Item, Kind
from lowbit.files.folder import DTYPE_NAMES, DTYPES
from lowbit.modelfree.source import FP8_SOURCES
from lowbit.files.regions import header_block
from lowbit.schemes import Scheme

METADATA = {"format": "pt"}


@dataclass(frozen=True)
class Entry:
    """One tensor of an output shard: its name, safetensors dtype code, shape and byte size."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class ShardFile:
    """An output shard: its header block (8-byte length + JSON), the data offset of each entry
    (from the start of the file) and the file's size."""

    header: bytes
    offsets: tuple[int, ...]
    size: int

    @classmethod
    def of(cls, entries: list[Entry]) -> "ShardFile":
        spans, off = [], 0
        for e in entries:
            spans.append((e.name, e.dtype, e.shape, off, off + e.nbytes))
            off += e.nbytes
        block = header_block(spans, METADATA)
        return cls(block, tuple(len(block) + s[3] for s in spans), len(block) + off)


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * DTYPES[dtype].itemsize


def source_dtype(item: Item, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a source tensor is worked on in: as stored, or the model dtype for FP8 sources."""
    if item.src.info.dtype in FP8_SOURCES or item.src.mx_scales is not None:
        return model_dtype
    return DTYPES[item.src.info.dtype]


class OutputShapes:
    """The entries each plan item writes. ``scheme``: the run's one scheme, for items that carry
    none (Item.scheme)."""

    def __init__(self, scheme: Scheme | None, layout, model_dtype: torch.dtype) -> None:
        self.scheme = scheme
        self.layout = layout
        self.model_dtype = model_dtype

    def entries(self, item: Item) -> list[Entry]:
        info, shape0 = item.src.info, item.src.shape
        if item.kind is Kind.DROP:
            return []
        if item.kind is Kind.COPY:
            dtype = info.dtype if item.src.scale_inv is None and item.src.mx_scales is None \
                else DTYPE_NAMES[self.model_dtype]
            return [Entry(item.name, dtype, shape0, _nbytes(dtype, shape0))]
        scheme = item.scheme if item.scheme is not None else self.scheme
        specs = self.layout.tensor_specs(scheme, shape0[0], shape0[-1], dtype=source_dtype(item, self.model_dtype),
                                         prefix=item.name)
        out = []
        for suffix, spec in specs.items():
            dtype = DTYPE_NAMES[spec.dtype]
            out.append(Entry(f"{item.name}.{suffix}", dtype, spec.shape, _nbytes(dtype, spec.shape)))
        return out
