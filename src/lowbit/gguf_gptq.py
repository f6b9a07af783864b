"""GPTQ within GGML's grids for a GGUF file: the calibrated rounding of ``quantize_gguf``.

For every weight that goes whole into tensors of one affine GGML type (``lowbit.numerics.ggml_codes``:
Q8_0, Q4_0 ... Q5_1, Q2_K ... Q6_K) or of an FP4 one (MXFP4, NVFP4: codes into a value table,
``lowbit.algorithms.gptq_table``), the type's importance-weighted scale search (llama.cpp's,
``quantize_<type>`` with the importance matrix) chooses the stored scales and mins, exactly as
without GPTQ; then GPTQ (``lowbit.algorithms.gptq_grid``) picks the codes under those scales,
column by column, spreading each column's error over the later ones through the layer's input
Hessian. The file keeps llama.cpp's layout, scales and types: only codes differ.

Hessians come from the float model on the calibration windows (every linear sees float inputs,
not the outputs of quantized layers before it). MoE experts are split into linears first
(``lowbit.linearize``): each expert's importance vector and Hessian come from the tokens routed to
it, as llama-imatrix counts per expert, and an expert no token reached gets llama-imatrix's vector
of ones and keeps the search's codes. They are gathered for a slice of the linears per
forward pass, at most ``max_hessian_bytes`` of float64 sums at a time (one pass for a small
model, several for a large one), and freed once the slice's weights are encoded.

Experts the checkpoint stores fused (gpt-oss, Llama 4, GraniteMoE) are rounded here under their
split linears' names and stacked back onto the fused tensor by ``lowbit.gguf_fused``. Not rounded
by GPTQ (encoded by the writer with their importance vectors, listed in the report): weights whose
rows go to tensors of two types, and tensors the mix leaves in float. Parameters are matched to the checkpoint's tensors by the names the family's
checkpoints use (``lowbit.moe.naming.checkpoint_names``, ``lowbit.renames.checkpoint_renames``).
"""

from __future__ import annotations

from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.nn as nn

from lowbit.algorithms.gptq import GPTQOptions
from lowbit.algorithms.gptq_grid import gptq_on_grid
from lowbit.calibration.importance import input_statistics
from lowbit.formats.gguf.rowmap import RowMap
from lowbit.kernels.ggml import encode  # the direct search in C where the kernel setting allows
from lowbit.numerics.ggml import GgmlType, ImportanceSearch
from lowbit.numerics.ggml_codes import AFFINE, grid_of, with_codes
from lowbit.threads import one_thread


#: the float64 Hessian sums a calibrated GGUF run holds at once (``gptq_sources``' slices, the
#: streamed run's queue, ``lowbit.gguf_streamed``)
MAX_HESSIAN_BYTES = 4 << 30

#: the GGML types GPTQ rounds: the affine ones (``gptq_on_grid``) and the FP4 ones (``gptq_on_table``)
GPTQ_TYPES = AFFINE + (GgmlType.MXFP4, GgmlType.NVFP4)


def source_types(plan, types: Mapping[str, Any]) -> dict[str, GgmlType]:
    """HF weight name -> the GGML type (of ``GPTQ_TYPES``) of the GGUF tensors its rows go to
    (weights whose rows go to tensors of two types, or of another type, are left out)."""
    seen: dict[str, set] = {}
    for t in plan.tensors:
        kind = types.get(t.name)
        if isinstance(t, RowMap) and isinstance(kind, GgmlType):
            for s in t.sources:
                seen.setdefault(s, set()).add(kind)
    return {s: next(iter(k)) for s, k in seen.items() if len(k) == 1 and next(iter(k)) in GPTQ_TYPES}


def gptq_options(config) -> GPTQOptions:
    """GPTQ's options of a calibrated GGUF file, from its CalibrationConfig: damping and block size
    (act order and the scale search are not a GGML grid's: refused by ``gguf_options``)."""
    return GPTQOptions(damping=config.gptq_damping, block_size=config.gptq_block_size)


def rounded_types(plan, types: Mapping[str, Any], config) -> dict[str, GgmlType]:
    """``source_types`` when a calibrated file's rounding (``gguf_options.gguf_rounding(config)``)
    is GPTQ, else none: the weights GPTQ rounds."""
    from lowbit.algorithms.gptq import WeightRounding
    from lowbit.gguf_options import gguf_rounding

    return source_types(plan, types) if gguf_rounding(config) is WeightRounding.GPTQ else {}


def weight_names(model: nn.Module, disk: Mapping[str, str] | None = None) -> dict[str, list[str]]:
    """linear name -> the parameter names of its weight (a tied weight has several), each as
    ``disk`` names it (parameter name -> checkpoint tensor name; default: unchanged)."""
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n if disk is None else disk.get(n, n))
    return {n: names.get(id(m.weight), [f"{n}.weight"]) for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def checkpoint_keys(model: nn.Module, keys: Iterable[str], renames: Mapping[str, str]) -> dict[str, str]:
    """parameter name -> the checkpoint tensor (of ``keys``) it was loaded from, for the
    parameters whose name differs (``lowbit.moe.naming.stored_key``: split experts under the
    family's checkpoint names, Mixtral's ``block_sparse_moe.experts.{e}.w1``; keys transformers
    renames on load, Nemotron-H's ``backbone.``, from ``renames``: ``checkpoint_renames`` of the
    model before its experts were split)."""
    from lowbit.moe.naming import stored_key

    keys = set(keys)
    model_type = getattr(model.config, "model_type", None)
    out = {}
    for n, _ in model.named_parameters(remove_duplicate=False):
        disk = stored_key(model_type, n, keys, renames)
        if disk is not None and disk != n:
            out[n] = disk
    return out


def transposed_sources(plan) -> set[str]:
    """The HF weights the plan reads transposed (``RowMap.transposed``: GPT-2's Conv1D [in, out],
    experts stored [E, in, out]): their rows are those of the linear's weight, the transpose."""
    return {s for t in plan.tensors if isinstance(t, RowMap) for k, s in enumerate(t.sources) if t.is_transposed(k)}


def model_sources(plan, parts: Iterable[str]) -> set[str]:
    """The HF weights ``source_weights`` reads from the model, not the checkpoint: the split experts
    of ``parts`` and the sources the plan reads transposed."""
    return set(parts) | transposed_sources(plan)


def source_weights(model: nn.Module, folder: Mapping[str, Any], plan, parts: Iterable[str],
                   disk: Mapping[str, str]) -> Callable[[str], Any]:
    """HF weight name -> the float weight GPTQ rounds, in the linear's [out, in] orientation: the
    checkpoint's tensor as the writer reads it (``folder``), or the model's parameter (as loaded:
    the same values) for a split expert of ``parts`` and a source the plan reads transposed.
    ``disk``: parameter name -> HF weight name where they differ (``checkpoint_keys``)."""
    from_model = model_sources(plan, parts)
    param_of = {d: p for p, d in disk.items()}

    def weight(name: str):
        return model.get_parameter(param_of.get(name, name)) if name in from_model else folder[name]
    return weight


def slices(model: nn.Module, linears: list[str], max_bytes: int) -> list[list[str]]:
    """``linears`` in model order, cut into slices whose float64 Hessians fit in ``max_bytes``
    (a linear larger than that is a slice of its own)."""
    out: list[list[str]] = [[]]
    used = 0
    for n in linears:
        size = 8 * model.get_submodule(n).in_features ** 2
        if out[-1] and used + size > max_bytes:
            out.append([])
            used = 0
        out[-1].append(n)
        used += size
    return [s for s in out if s]


def _round(weights: Callable[[str], Any], kind: GgmlType, importance: torch.Tensor, hessian: torch.Tensor | None,
           options: GPTQOptions, name: str, search: ImportanceSearch, pool: Executor | None = None
           ) -> torch.Tensor | None:
    """Weight ``name``'s rows encoded in ``kind``: the importance-weighted search's scales, GPTQ's
    codes (the search's own without a Hessian: a linear no token reached; None for a weight that
    is not a matrix: experts stored fused keep the writer's encoding). A matrix taller than
    ``ROWS`` is rounded in bands of rows (independent under one Hessian); with ``pool`` the bands
    after the first are offered to it, and each one no worker has started by the time this call
    reaches it runs here (so a caller on one of the pool's workers never waits on a queued band)."""
    from lowbit.formats.gguf.writer import float_weight

    W = float_weight(weights(name), name)
    if W.dim() != 2:
        return None
    bands = [W[s:s + ROWS] for s in range(0, W.shape[0], ROWS)]
    args = (kind, importance, hessian, options, name, search)
    offered = [None if pool is None else pool.submit(_round_rows, b, *args) for b in bands[1:]]
    out = [_round_rows(bands[0], *args)]
    for b, f in zip(bands[1:], offered):  # a band no worker started (cancelled here) runs here
        out.append(f.result() if f is not None and not f.cancel() else _round_rows(b, *args))
    return out[0] if len(out) == 1 else torch.cat(out)


#: the rows ``_round`` rounds at once: GPTQ's working copies of a tall matrix (Gemma 3's tied
#: 262144-row embedding: 5.6x its size, +3.6 GB) are bounded by a band's, with the same codes
#: (tests); on a pool two workers hold a band each
ROWS = 1 << 15


def _round_rows(W: torch.Tensor, kind: GgmlType, importance: torch.Tensor, hessian: torch.Tensor | None,
                options: GPTQOptions, name: str, search: ImportanceSearch) -> torch.Tensor:
    """``_round`` of the float rows ``W``."""
    data = encode(W, kind, name, importance=importance, search=search)
    if hessian is None:
        return data
    if kind in (GgmlType.MXFP4, GgmlType.NVFP4):  # codes index a value table, not an affine grid
        from lowbit.algorithms.gptq_table import gptq_on_table
        from lowbit.numerics.ggml_fp4 import DOUBLED_E2M1, FP4_GROUP, fp4_scales, with_fp4_codes

        codes = gptq_on_table(W, hessian, fp4_scales(data, kind), FP4_GROUP[kind], torch.tensor(DOUBLED_E2M1,
                              dtype=torch.float32), options, name)
        return with_fp4_codes(data, kind, codes)
    codes = gptq_on_grid(W, hessian, grid_of(data, kind), options, name)
    return with_codes(data, kind, codes)


def round_weights(jobs: list[tuple[str, str]], weights: Callable[[str], Any], kinds: Mapping[str, GgmlType],
                  importance: Mapping[str, torch.Tensor], hessians: Mapping[str, Any], *, options: GPTQOptions,
                  search: ImportanceSearch, progress: Callable[[str], None] | None = None) -> dict[str, tuple]:
    """HF weight name -> (GGML type, uint8 rows) for each job (HF weight name, the linear whose
    statistics it takes: ``importance`` and ``hessians``, ``input_statistics``' results by linear
    name; a linear without a Hessian keeps the search's codes), on a pool of one-thread workers (as
    many as torch's threads), in job order (the first error is raised). Weights that are not a
    matrix (experts stored fused) are left out."""
    out: dict[str, tuple] = {}
    workers = max(1, torch.get_num_threads())
    with one_thread(), ThreadPoolExecutor(max_workers=workers) as pool:
        # HessianSum.upper(): the sum as kept, GPTQ reads only its upper triangle (no mirrored copy)
        futures = [(w, pool.submit(_round, weights, kinds[w], importance[n],
                                   hessians[n].upper() if n in hessians else None, options, w, search, pool))
                   for w, n in jobs]
        for w, f in futures:
            if progress is not None:
                progress(w)
            got = f.result()
            if got is not None:
                out[w] = (kinds[w], got)
    return out


def gptq_sources(model: nn.Module, tokens: torch.Tensor, weights: Callable[[str], Any],
                 kinds: Mapping[str, GgmlType], *, options: GPTQOptions, batch_size: int,
                 max_hessian_bytes: int = MAX_HESSIAN_BYTES, disk: Mapping[str, str] | None = None,
                 progress: Callable[[str], None] | None = None, search: ImportanceSearch
                 ) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """(importance: HF weight name -> llama-imatrix's vector, for every linear; encoded: HF weight
    name -> (GGML type, uint8 rows) for the weights of ``kinds`` GPTQ rounded). ``weights``: HF
    name -> float tensor (the checkpoint's values the writer would encode); ``disk``: parameter
    name -> HF weight name where they differ (``checkpoint_keys``); ``search``: how the importance
    chooses the scales GPTQ rounds under. A linear no token reached (an MoE expert) gets a vector
    of ones and is left to the writer's encoding."""
    names = weight_names(model, disk)
    importance: dict[str, torch.Tensor] = {}
    encoded: dict[str, tuple] = {}
    linears = list(names)
    for part in slices(model, linears, max_hessian_bytes):
        want = [n for n in part if any(w in kinds for w in names[n])]
        imp, hess = input_statistics(model, tokens, batch_size=batch_size, names=part, hessians=bool(want),
                                     unseen=1.0)
        for n in part:
            for w in names[n]:
                importance[w] = imp[n]
        encoded.update(round_weights([(w, n) for n in want for w in names[n] if w in kinds], weights, kinds, imp,
                                     hess, options=options, search=search, progress=progress))
        del hess
    return importance, encoded
