"""Every output shard's exact contents, known before any weight is quantized.

Each entry's name, dtype and shape (so its byte range) follows from the source header, the
scheme and the layout alone. Knowing them up front lets the shard file be created at its final
size with its final header, and every unit of work (a shard, or one part of a large shard)
write its tensors straight to their offsets, in parallel, with nothing joined afterwards.

A quantized linear's tensors are found by running the real quantizer and layout on two zero
weights of one and two rows with the real input width: every weight scale is per row or per
group of a row (``bands.quantize_rows`` relies on the same fact), so each output tensor either
keeps its shape or grows by whole rows. The writer checks every tensor it writes against its
entry, so a layout that broke this rule would stop the run with an error, never write a wrong file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowbit.errors import LowbitError
from lowbit.modelfree.plan import Item, Kind
from lowbit.files.folder import DTYPE_NAMES, DTYPES
from lowbit.modelfree.source import FP8_SOURCES
from lowbit.files.regions import header_block
from lowbit.schemes import Granularity, Scheme

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
    """Predicts the entries each plan item writes (quantized linears probed once per scheme, input
    width and dtype). ``scheme``: the run's one scheme, for items that carry none (Item.scheme)."""

    def __init__(self, scheme: Scheme | None, layout, model_dtype: torch.dtype) -> None:
        self.scheme = scheme
        self.layout = layout
        self.model_dtype = model_dtype
        self._probed: dict[tuple, list[tuple[str, str, tuple[int, ...], int]]] = {}

    def entries(self, item: Item) -> list[Entry]:
        info, shape0 = item.src.info, item.src.shape
        if item.kind is Kind.DROP:
            return []
        if item.kind is Kind.COPY:
            dtype = info.dtype if item.src.scale_inv is None and item.src.mx_scales is None \
                else DTYPE_NAMES[self.model_dtype]
            return [Entry(item.name, dtype, shape0, _nbytes(dtype, shape0))]
        rows = shape0[0]
        out = []
        scheme = item.scheme if item.scheme is not None else self.scheme
        for suffix, dtype, shape, unit in self._probe(scheme, shape0[1:], source_dtype(item, self.model_dtype)):
            full = (-(-rows // unit),) + shape[1:] if unit else shape
            out.append(Entry(item.name + suffix, dtype, full, _nbytes(dtype, full)))
        return out

    def _probe(self, scheme: Scheme, tail: tuple[int, ...], dtype: torch.dtype
               ) -> list[tuple[str, str, tuple[int, ...], int]]:
        key = (scheme, tail, dtype)
        if key not in self._probed:
            from lowbit.modelfree.bands import quantize_rows
            from lowbit.quant import global_scale_from_amax

            spec = scheme.weights
            gs = global_scale_from_amax(torch.ones(1), spec) if spec.global_scale else None
            # L rows and 2L: L is a multiple of every row unit a layout groups by (a BLOCK tile, the 8
            # or 16 zero points of an int32 word packed along the rows)
            L = math.lcm(spec.group_size if spec.granularity is Granularity.BLOCK else 1, 32)
            got = []
            for r in (L, 2 * L):
                qt = quantize_rows(torch.zeros((r,) + tail, dtype=dtype), spec, gs, "probe",
                                   pack=self.layout.nibble_packed(scheme, tail[-1]))
                got.append(self.layout.linear_tensors("", qt, scheme, dtype=dtype))
            found = []
            for (k1, a), (k2, b) in zip(got[0].items(), got[1].items(), strict=True):
                one, two = tuple(a.shape), tuple(b.shape)
                if k1 != k2 or a.dtype != b.dtype or not (one == two or (one and two == (2 * one[0],) + one[1:])):
                    raise LowbitError(f"internal error: the {self.layout.format.value} layout's tensor {k1!r} "
                                      f"does not grow by rows ({one} for {L} rows, {two} for {2 * L})")
                # rows per entry of the first dimension: 1 (codes, per-row scales), a tile (BLOCK scales),
                # the values of a packed word (zero points packed along the rows); 0: a fixed shape
                unit = 0 if one == two else L // one[0]
                found.append((k1, DTYPE_NAMES[a.dtype], (1,) + one[1:] if unit else one, unit))
            self._probed[key] = found
        return self._probed[key]
