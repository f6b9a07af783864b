"""Where the rows of a Hugging Face weight go in a GGUF file, found with index patterns.

lowbit quantizes a weight row by row (a row is one output channel, blocks run along the input
dimension, the last axis of the HF tensor). llama.cpp's converter may permute rows (Llama's q/k
rope order), split a fused tensor, drop rows (Gemma's out-of-vocabulary embeddings) or stack
experts into ``[E, out, in]``; each of these moves whole rows, so codes computed on the HF rows
can be moved the same way. To learn the moves without per-architecture code, the converter is
fed an *index pattern* in place of each weight and what it writes is decoded here.

Pattern of source tensor ``sid`` (float32, rows = every axis but the last, flattened), column ``c``:

    c % 4 == 0: r            c % 4 == 1: -(sid + 1)
    c % 4 == 2: c + 0.25     c % 4 == 3: r + 0.5

Every value is exact in float32 within the limits checked by ``pattern``. A row that decodes is
rebuilt from its decoded (sid, r) and compared exactly, so a converter that scales, shifts,
mixes or reorders values within a row (or changes the input dimension) never yields a row map.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from lowbit.errors import FormatError

MAX_ROWS = 1 << 23      # r + 0.5 exact in float32
MAX_COLUMNS = 1 << 22   # c + 0.25 exact in float32
MAX_SOURCES = 1 << 23


def pattern(sid: int, shape: Sequence[int], name: str = "?") -> np.ndarray:
    """The float32 index pattern of source tensor ``sid`` with HF shape ``shape`` (at least 1-D).
    FormatError naming ``name`` when the tensor is too large for the pattern to stay exact."""
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise FormatError(f"GGUF: tensor {name!r} is a scalar; it has no rows to map")
    rows, cols = prod(shape[:-1]), shape[-1]
    if rows >= MAX_ROWS or cols >= MAX_COLUMNS or sid >= MAX_SOURCES:
        raise FormatError(f"GGUF: tensor {name!r} of shape {list(shape)} is too large to map its rows "
                          f"(at most {MAX_ROWS - 1} rows of {MAX_COLUMNS - 1} columns)")
    out = np.empty((rows, cols), dtype=np.float32)
    r = np.arange(rows, dtype=np.float32)[:, None]
    out[:, 0::4] = r  # strided columns c % 4 == k (as fast as a copy; boolean masks were 4x slower)
    out[:, 1::4] = -(sid + 1)
    out[:, 2::4] = _column_values(cols)
    out[:, 3::4] = r + 0.5
    return out.reshape(shape)


def _column_values(cols: int) -> np.ndarray:
    """The pattern's values at the columns c % 4 == 2: c + 0.25, float32."""
    return (np.arange(2, cols, 4) + 0.25).astype(np.float32)


def decode(array: np.ndarray, shapes: Sequence[tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray] | None:
    """(sid, row) per row of ``array`` (each of shape ``array.shape[:-1]``) when every row of it
    is, value for value, row ``row`` of the pattern of source ``sid`` (whose HF shape is
    ``shapes[sid]``); None otherwise."""
    a = np.asarray(array)
    if a.dtype.kind != "f" or a.ndim == 0 or a.shape[-1] < 2 or a.size == 0:
        return None
    cols = a.shape[-1]
    flat = a.reshape(-1, cols).astype(np.float32, copy=False)
    sid_f, row_f = -flat[:, 1] - 1, flat[:, 0]
    if not (np.all(np.isfinite(sid_f)) and np.all(np.isfinite(row_f))):
        return None
    sid, row = sid_f.astype(np.int64), row_f.astype(np.int64)
    if np.any(sid != sid_f) or np.any(row != row_f) or np.any(sid < 0) or np.any(sid >= len(shapes)) \
            or np.any(row < 0):
        return None
    for s in np.unique(sid):
        shp = shapes[int(s)]
        if shp[-1] != cols or np.any(row[sid == s] >= prod(shp[:-1])):
            return None
    rf = row.astype(np.float32)[:, None]
    for k, want in enumerate((rf, flat[:, 1:2], _column_values(cols)[None, :], rf + 0.5)):
        if not (flat[:, k::4] == want).all():  # value for value, column class by column class
            return None
    lead = a.shape[:-1]
    return sid.reshape(lead), row.reshape(lead)


@dataclass(frozen=True)
class RowMap:
    """A GGUF tensor made of whole rows of HF tensors, values unchanged.

    ``shape`` is the tensor as the converter produced it (numpy order, last axis = input
    dimension; GGUF's ne is this reversed). For every index ``i`` of ``shape[:-1]``, row ``i`` is
    row ``row[i]`` of HF tensor ``sources[source[i]]``, rows counted over every axis of that
    tensor but the last (``source_shapes`` gives each source's HF shape). A source in
    ``transposed`` is read with its last two axes swapped (its shape here is that swapped one):
    the converter writes its columns as rows (gpt-oss's and Llama 4's experts, stored [E, in, out]
    on disk), so its rows are those of the transposed tensor, the per-expert linear's weight."""

    name: str
    shape: tuple[int, ...]
    sources: tuple[str, ...]
    source_shapes: tuple[tuple[int, ...], ...]
    source: np.ndarray
    row: np.ndarray
    transposed: tuple[bool, ...] = ()

    def is_transposed(self, k: int) -> bool:
        return bool(self.transposed) and self.transposed[k]

    @property
    def identity(self) -> bool:
        """One source, same shape, rows in order: the HF tensor is stored as it is."""
        return (len(self.sources) == 1 and self.source_shapes[0] == self.shape
                and np.array_equal(self.row.reshape(-1), np.arange(self.row.size)))

    def gather(self, tensors: Mapping[str, Any] | Callable[[str], Any], rows_given: bool = False):
        """This GGUF tensor assembled from per-source arrays (torch or numpy) whose leading axes
        are those of the HF source (``source_shapes[k][:-1]``) and whose trailing axes are
        anything row-wise: the float weight itself, or its codes and scales per row. The result
        has leading axes ``shape[:-1]`` and the sources' trailing axes. A transposed source's
        float weight comes in its HF layout and is transposed here; with ``rows_given`` every
        array is already per row of the map's sources (codes of a transposed source's rows)."""
        get = tensors.__getitem__ if isinstance(tensors, Mapping) else tensors
        parts = []
        for k, (name, shp) in enumerate(zip(self.sources, self.source_shapes)):
            t = get(name)
            if self.is_transposed(k) and not rows_given:
                t = t.transpose(-1, -2) if isinstance(t, torch.Tensor) else np.swapaxes(t, -1, -2)
            lead = len(shp) - 1
            if tuple(t.shape[:lead]) != tuple(shp[:-1]):
                raise FormatError(f"GGUF: tensor {name!r} has shape {list(t.shape)}, expected leading axes "
                                  f"{list(shp[:-1])} to build {self.name!r}")
            parts.append(t.reshape((prod(shp[:-1]),) + tuple(t.shape[lead:])))
        offsets = np.cumsum([0] + [p.shape[0] for p in parts[:-1]])
        index = (offsets[self.source] + self.row).reshape(-1)
        if isinstance(parts[0], torch.Tensor):
            flat = parts[0] if len(parts) == 1 else torch.cat(parts)
            out = flat[torch.from_numpy(index)]
        else:
            flat = parts[0] if len(parts) == 1 else np.concatenate(parts)
            out = flat[index]
        return out.reshape(tuple(self.shape[:-1]) + tuple(out.shape[1:]))
