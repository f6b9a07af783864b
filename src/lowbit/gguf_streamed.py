"""A calibrated GGUF file's importance matrix and GPTQ, one decoder layer in memory at a time.

``lowbit.quantize_gguf(folder, out, "Q4_K_M", calibration=...)`` runs here: the model is built
without weights (``lowbit.streamed.skeleton.Skeleton``), the first decoder layer's calls are
captured with the embeddings loaded (``lowbit.calibration.layer_calls.capture_calls``), and then,
layer by layer, the layer is read from the shards, run on the float hidden states of every
calibration batch while its linears' statistics are gathered (``InputStatistics``: llama-imatrix's
mean squared input per column and GPTQ's Hessians), its weights rounded (``gguf_gptq.round_weights``)
and written to a spill folder, and the layer freed; its float outputs are the next layer's inputs.
The linears outside the layers (the output head; any before the layers) are measured last by the
model's own forward with every layer replaced by a stand-in that passes the hidden states on, the
last one handing over the float outputs the last real layer computed (``_Replay``): the head sees
the model's own final norm of them, and the logits are never computed.

Every linear sees what it sees in the in-memory pass (``gguf_gptq.gptq_sources``: the float model,
batch by batch, the same windows), so the importance vectors, Hessians and rows are the same and the
file is the same, byte for byte (tests against ``lowbit.quantize`` + ``lowbit.save`` in memory).
Memory holds the embeddings (during the capture and the last pass), one decoder layer, the
calibration hidden states, the importance vectors and the Hessians waiting for GPTQ: they queue
up to ``QUEUE_BYTES`` (1 GiB) and are then rounded on one pool (``RoundQueue``: rounding each layer
alone left the workers idle at the end of every layer, +35% of GPTQ's time on SmolLM2-135M); a
layer whose Hessians exceed ``gguf_gptq.MAX_HESSIAN_BYTES`` (4 GiB, the in-memory pass's bound) is
measured in slices, one more run of the layer each; the queue is rounded at a layer's end, so that
the rows of every layer so far are then on disk. The encoded rows wait there (``lowbit.gguf_spill.Spill``,
about the output file's size) until the writer takes them, and a checkpoint after such a layer lets
the same command resume a killed run (``lowbit.gguf_spill.Checkpoint``). With block
reconstruction (``lowbit.gguf_reconstruct``) each layer is rounded before the next and also runs on
the quantized model's hidden states, which the loop carries beside the float ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch
import torch.nn as nn

from lowbit.gguf_layers import QUEUE_BYTES, LayerLoop, RoundQueue
from lowbit.gguf_spill import Spill
from lowbit.numerics.ggml import GgmlType, ImportanceSearch


def _keep(plan, names, parts, importance: dict, spill: Spill, got: dict, linears: list[str]) -> None:
    """A group's rows into ``spill``, experts stored fused stacked first (``gguf_fused.stack``)."""
    from lowbit.gguf_fused import stack

    mine = {w: p for w, p in parts.items() if any(w in names[n] for n in linears)}
    if mine:
        stack(plan, mine, importance, got)
    for w, v in got.items():
        spill[w] = v


def streamed_sources(src: Path, plan, tokens: torch.Tensor, config, kinds: Mapping[str, GgmlType],
                     search: ImportanceSearch, spill: Spill, progress: bool | None = None,
                     max_hessian_bytes: int | None = None, reports: dict | None = None,
                     checkpoint=None) -> dict[str, torch.Tensor] | None:
    """HF weight name -> llama-imatrix's vector for every linear (stacked [E, in] for experts stored
    fused), the rows GPTQ rounded for the weights of ``kinds`` put in ``spill`` (HF weight name ->
    (type, rows), as ``gguf_gptq.gptq_sources`` gives them; experts stored fused stacked per
    tensor, ``lowbit.gguf_fused``), from the calibration windows ``tokens`` run through the model of
    the folder ``src`` one decoder layer at a time (module docstring). ``config``: the
    CalibrationConfig (batch size, GPTQ's options). None when the model has no decoder layers to
    stream (the caller runs it in memory). ``max_hessian_bytes``: the most Hessian bytes one run of a layer
    gathers (None: ``gguf_gptq.MAX_HESSIAN_BYTES``, as in memory; the queue is the smaller of it
    and ``QUEUE_BYTES``). ``reports``: filled with each reconstructed decoder layer's
    summary (config's ``reconstruct_iters``, ``lowbit.gguf_reconstruct``). ``checkpoint``
    (``lowbit.gguf_spill.Checkpoint`` of ``spill``): where the run resumes and records its progress."""
    from lowbit.calibration.capture import find_decoder_layers
    from lowbit.files.folder import SafetensorsFolder
    from lowbit.gguf_fused import fused_parts, with_parts
    from lowbit.gguf_reconstruct import reconstruct_options
    from lowbit.gguf_gptq import (MAX_HESSIAN_BYTES, checkpoint_keys, gptq_options, model_sources, source_weights,
                                  weight_names)
    from lowbit.moe.naming import stored_key
    from lowbit.streamed.skeleton import Skeleton
    from lowbit.streamed.stream import trim_heap

    skel = Skeleton.open(src)
    try:
        model = skel.model
        keys = set(skel.ckpt.tensors)
        found = find_decoder_layers(model, [n for n, m in model.named_modules() if isinstance(m, nn.Linear)])
        if found is None:
            return None
        skel.materialize_outside(found[0])  # the capture's; ties the output embedding, which the names see
        disk = checkpoint_keys(model, keys, skel.renames)
        names = weight_names(model, disk)
        parts = fused_parts(model, [w for ws in names.values() for w in ws],
                            lambda k: stored_key(skel.model_type, k, keys, skel.renames))
        bound = MAX_HESSIAN_BYTES if max_hessian_bytes is None else max_hessian_bytes
        rounds = RoundQueue(names, with_parts(kinds, parts),
                         source_weights(model, SafetensorsFolder(src), plan, parts, disk), model_sources(plan, parts),
                         lambda got, linears: _keep(plan, names, parts, importance, spill, got, linears),
                         gptq_options(config), search, min(QUEUE_BYTES, bound))
        importance = rounds.importance
        loop = LayerLoop(skel, found[0], found[1], names, rounds, bound, progress, reconstruct_options(config),
                         checkpoint, trim=trim_heap)
        loop.run(tokens, config.batch_size)
        if reports is not None:
            reports.update(loop.reports)
        return importance
    finally:
        skel.close()
