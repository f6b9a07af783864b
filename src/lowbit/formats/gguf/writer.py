"""Write one GGUF file: llama.cpp's converter's metadata and tensor layout (``GGUFPlan``), each
quantized weight encoded by lowbit's GGML numerics with the type its mix chose.

    plan = plan_gguf(folder)                                   # lowbit.formats.gguf.convert
    types = choose_types(Mix.Q4_K_M, plan_shapes(plan), facts_of(plan))
    write_gguf(plan, "out.gguf", weights, types, file_type=Mix.Q4_K_M, importance=imatrix)

A weight is encoded after its rows are gathered as the converter placed them (``RowMap``): GGML
types quantize row by row, so the bytes equal those of encoding the HF rows and moving them.
Importance vectors follow their source rows (per expert for stacked experts). The file is
written under a temporary name beside the output and renamed when complete.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

from lowbit.errors import FormatError
from lowbit.formats.gguf.mixes import F16, ModelFacts, Mix
from lowbit.formats.gguf.rowmap import RowMap
from lowbit.kernels.ggml import encode  # the direct search in C where the kernel setting allows
from lowbit.numerics.ggml import GEOMETRY, GgmlType, ImportanceSearch


def plan_shapes(plan) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy-order shape) of every tensor of a ``GGUFPlan``, in its order."""
    out = []
    for t in plan.tensors:
        shape = t.shape if isinstance(t, RowMap) else tuple(np.asarray(t.array).shape)
        out.append((t.name, tuple(int(d) for d in shape)))
    return out


def facts_of(plan, has_importance: bool = False) -> ModelFacts:
    """The model facts llama-quantize's rules read, from the plan's GGUF metadata."""
    def get(key: str, default=0):
        v = plan.metadata.get(f"{plan.arch}.{key}")
        if v is None:
            return default
        value = v.value
        if isinstance(value, (list, tuple)):  # per-layer head counts: the first layer's, as llama.cpp's n_gqa()
            value = value[0] if value else default
        return int(value)

    n_layer = get("block_count")
    if n_layer <= 0:
        raise FormatError(f"GGUF: the converter wrote no {plan.arch}.block_count")
    n_head = get("attention.head_count", 1)
    return ModelFacts(n_layer=n_layer, n_head=n_head, n_head_kv=get("attention.head_count_kv", n_head),
                      n_expert=get("expert_count"), falcon=plan.arch == "falcon", has_importance=has_importance)


@dataclass
class WriteReport:
    """What was written: the file, its size, the type of every tensor (GGUF name -> type name),
    the tensors assembled from rows encoded before writing (``encoded``: GPTQ's), the seconds
    the whole run took, and, with block reconstruction, per decoder layer its error before and
    after and how many codes changed (``reconstructed``: layer -> {mse_start, mse_end, changed,
    weights}; mse_start None where the check on step 0's windows sufficed)."""

    path: Path
    size_bytes: int
    types: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    from_encoded: list[str] = field(default_factory=list)
    reconstructed: dict[str, dict] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.types.values():
            out[t] = out.get(t, 0) + 1
        return out


def _rows_importance(rowmap, importance: Mapping[str, torch.Tensor]) -> list[tuple[np.ndarray, torch.Tensor]] | None:
    """For a RowMap whose every source has an importance vector: (row indices into the flat rows,
    importance [in]) per distinct vector; None when one source has none."""
    flat_src = rowmap.source.reshape(-1)
    flat_row = rowmap.row.reshape(-1)
    groups: list[tuple[np.ndarray, torch.Tensor]] = []
    for k, (name, shape) in enumerate(zip(rowmap.sources, rowmap.source_shapes)):
        imp = importance.get(name)
        if imp is None:
            return None
        imp = torch.as_tensor(imp, dtype=torch.float32)
        mine = np.nonzero(flat_src == k)[0]
        if imp.dim() == 1:
            groups.append((mine, imp))
            continue
        per = int(np.prod(shape[1:-1])) if len(shape) > 2 else 1  # rows per expert of a stacked [E, out, in]
        expert = flat_row[mine] // per
        for e in np.unique(expert):
            groups.append((mine[expert == e], imp[int(e)]))
    return groups


def encode_rows(values: torch.Tensor, kind: GgmlType, name: str, groups=None,
                search: ImportanceSearch = ImportanceSearch.LLAMA_CPP) -> np.ndarray:
    """float32 ``values`` [..., in] as GGML ``kind`` bytes [..., row bytes]; ``groups``: (row
    indices, importance [in]) pairs covering every row (``_rows_importance``), each group's
    scales chosen by ``search``; else unweighted."""
    lead = values.shape[:-1]
    flat = values.reshape(-1, values.shape[-1])
    if groups is None:
        out = encode(flat, kind, name=name)
    else:
        first = encode(flat[:1], kind, name=name)
        out = torch.empty((flat.shape[0], first.shape[-1]), dtype=torch.uint8)
        for rows, imp in groups:
            idx = torch.from_numpy(rows)
            out[idx] = encode(flat[idx], kind, name=name, importance=imp, search=search)
    return out.reshape(*lead, out.shape[-1]).numpy()


def write_gguf(plan, out: str | os.PathLike, weights: Mapping[str, Any] | Callable[[str], Any],
               types: Mapping[str, GgmlType | str | None], *, file_type: Mix | None = None,
               importance: Mapping[str, torch.Tensor] | None = None,
               encoded: Mapping[str, tuple[GgmlType, torch.Tensor]] | None = None,
               progress: Callable[[str], None] | None = None,
               search: ImportanceSearch = ImportanceSearch.LLAMA_CPP) -> WriteReport:
    """Write ``plan`` to the file ``out``. ``weights``: HF name -> float tensor of every source
    of a RowMap; ``types``: GGUF name -> GgmlType, ``F16`` or None (kept as the converter
    wrote it) for every tensor; ``importance``: HF weight name -> float32 [in] (or [E, in] for
    stacked experts), llama-imatrix's statistic; ``encoded``: HF weight name -> (GGML type, its
    rows already encoded, uint8 [..., row bytes]): a tensor whose every source is there in its
    type is assembled from those rows (e.g. GPTQ's codes on the type's grid), not encoded again;
    ``search``: how ``importance`` chooses the scales (``lowbit.numerics.ggml.ImportanceSearch``).
    Every tensor's info is declared from the plan's shapes first, then the data is written tensor
    by tensor as it is encoded (``_in_order``): memory holds a few tensors, not the file. Nothing
    is left at ``out`` on an error."""
    import gguf

    out = Path(out)
    if out.is_dir():
        raise FormatError(f"GGUF output {str(out)!r} is a folder: give a file name (e.g. model-Q4_K_M.gguf)")
    tmp = out.with_name(f".{out.name}.lowbit-tmp")
    get = weights.__getitem__ if isinstance(weights, Mapping) else weights
    writer = gguf.GGUFWriter(path=None, arch=plan.arch)
    report = WriteReport(out, 0)
    ordered = None
    try:
        plan.add_metadata(writer)
        if file_type is not None:
            writer.add_file_type(int(getattr(gguf.LlamaFileType, f"MOSTLY_{Mix.parse(file_type).value}")))
        if "general.quantization_version" not in plan.metadata:
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        tmp.parent.mkdir(parents=True, exist_ok=True)
        for t, (name, shape) in zip(plan.tensors, plan_shapes(plan)):  # every tensor's info first: no data yet
            _add_info(writer, t, shape, types.get(name))
        writer.write_header_to_file(path=tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        ordered = _in_order(plan, types, get, importance, encoded, search)
        for t, kind, data in ordered:
            if progress is not None:
                progress(t.name)
            if isinstance(kind, GgmlType):
                report.types[t.name] = kind.name
                if _all_encoded(t, kind, encoded):
                    report.from_encoded.append(t.name)
            elif kind == F16:
                data = _values(t, get).to(torch.float16).numpy()
                report.types[t.name] = "F16"
            elif isinstance(t, RowMap):
                data = _values(t, get).to(torch.float32).numpy()
                report.types[t.name] = "F32"
            else:
                data = np.asarray(t.array)
                report.types[t.name] = gguf.GGMLQuantizationType(t.type).name
            writer.write_tensor_data(data)
            del data
        ordered.close()
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        if ordered is not None:
            ordered.close()  # the encoding pool stops before the error leaves
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    report.size_bytes = out.stat().st_size
    return report


def _add_info(writer, t, shape: tuple[int, ...], kind) -> None:
    """Declare tensor ``t`` (GGUF shape ``shape``, numpy order) as it will be written: its GGML
    type's bytes, F16, F32 (a RowMap), or the converter's own array and type."""
    import gguf

    if isinstance(kind, GgmlType):
        n, nb = GEOMETRY[kind]
        byte_shape = (*shape[:-1], shape[-1] // n * nb)
        writer.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                               raw_dtype=gguf.GGMLQuantizationType[kind.name])
    elif kind == F16 or isinstance(t, RowMap):
        dtype = np.dtype(np.float16 if kind == F16 else np.float32)
        writer.add_tensor_info(t.name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    else:
        arr = np.asarray(t.array)
        writer.add_tensor_info(t.name, arr.shape, arr.dtype, arr.nbytes, raw_dtype=t.type)


def _in_order(plan, types, get, importance, encoded, search, ahead: int | None = None):
    """(plan tensor, its type, its bytes for a GGML type else None) in the plan's order. The GGML
    tensors are encoded (rows given in ``encoded`` gathered, the others encoded) on a pool of one
    intra-op thread per worker (the encoders are many small operations: several tensors at once use
    the cores), at most ``ahead`` (default twice the workers) in flight or done ahead of the one
    written: memory holds a few tensors, not the file."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    from lowbit.threads import one_thread

    def job(t, kind):
        if _all_encoded(t, kind, encoded):
            return t.gather(lambda n: encoded[n][1], rows_given=True).numpy()
        groups = _rows_importance(t, importance) if importance and isinstance(t, RowMap) else None
        return encode_rows(_values(t, get).to(torch.float32), kind, t.name, groups, search)

    workers = max(1, torch.get_num_threads())
    tensors = [(t, types.get(t.name)) for t in plan.tensors]
    queue = iter([(t, kind) for t, kind in tensors if isinstance(kind, GgmlType)])
    pending: deque = deque()
    with one_thread(), ThreadPoolExecutor(max_workers=workers) as pool:

        def submit() -> None:
            nxt = next(queue, None)
            if nxt is not None:
                pending.append(pool.submit(job, *nxt))

        try:
            for _ in range(ahead or 2 * workers):
                submit()
            for t, kind in tensors:
                if isinstance(kind, GgmlType):
                    done = pending.popleft()  # the GGML tensors' futures in the plan's order
                    submit()
                    yield t, kind, done.result()  # the first error is raised
                else:
                    yield t, kind, None
        finally:
            for fut in pending:
                fut.cancel()


def _values(t, get) -> torch.Tensor:
    """A plan tensor's values: a RowMap's rows gathered from the HF weights (float32, checked
    finite), or the converter's own array."""
    if isinstance(t, RowMap):
        return torch.as_tensor(np.ascontiguousarray(t.gather(lambda n: float_weight(get(n), n))))
    return torch.from_numpy(np.ascontiguousarray(t.array))


def _all_encoded(t, kind: GgmlType, encoded) -> bool:
    """Whether every source of the RowMap ``t`` comes encoded in ``kind``."""
    return (bool(encoded) and isinstance(t, RowMap)
            and all(n in encoded and encoded[n][0] is kind for n in t.sources))


def float_weight(t: Any, name: str) -> torch.Tensor:
    """A source weight as float32 (a FormatError naming it when it holds NaN or infinities)."""
    x = torch.as_tensor(t).detach().to(torch.float32)
    if not bool(torch.isfinite(x).all()):
        raise FormatError(f"tensor {name!r} holds NaN or infinite values")
    return x
