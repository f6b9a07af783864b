"""GGML types calibrated in memory: ``lowbit.quantize(model, "Q4_K_M", calibration=..., tokenizer=...)``.

The importance matrix and GPTQ of ``lowbit.quantize_gguf`` (``lowbit.gguf_gptq.gptq_sources``: each
linear's mean squared input per column from the float model on the calibration windows, the
importance-weighted scale search, then GPTQ's codes under those scales), run on a model already in
memory. What it gives the linears and the tensors the file writes later is what ``quantize_gguf``
gives them from the model's folder with the same windows and options, so
``lowbit.save(model, "x.gguf", format="gguf")`` writes the same bytes (tests).

The options are the ones a GGUF file's calibration reads, and only those: the calibration windows
(``CalibrationConfig``'s data part: num_samples, seq_len, pack, chat_template, column, split,
batch_size), ``weight_rounding`` (GPTQ by default, ``gguf_options.gguf_rounding``; "rtn" keeps the
search's codes), ``gptq_damping``, ``gptq_block_size``, and ``importance_search``
(``gguf_options.DEFAULT_IMPORTANCE_SEARCH``). Any other calibration option set away from its default
(SmoothQuant's, the observers', rotation, act order) is refused by name. With block reconstruction
(``reconstruct_iters``, ``reconstruct_lr``, ``reconstruct_batch_size``; ``lowbit.gguf_reconstruct``)
the model runs one decoder layer after the other (``lowbit.gguf_resident``), as ``quantize_gguf``
streams it, and the file is again that function's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn as nn

from lowbit.numerics.ggml import GgmlType, ImportanceSearch


@dataclass(frozen=True)
class GgmlCalibration:
    """A GGML target's calibration, resolved: the windows' token ids [n, seq_len], the
    CalibrationConfig (rounding, GPTQ's options, batch size) and the importance search."""

    ids: torch.Tensor
    config: Any
    search: ImportanceSearch


@dataclass
class GgmlCalibrated:
    """What calibration left for the file's other tensors (kept on the model for ``lowbit.save``):
    ``importance`` HF weight name -> llama-imatrix's vector (every linear's weight, tied names
    included), ``encoded`` HF weight name -> (type, rows) rounded by GPTQ for tensors that are not
    held as blocks in memory (a token embedding tied to the output), ``search``."""

    importance: dict[str, torch.Tensor]
    encoded: dict[str, tuple[GgmlType, torch.Tensor]]
    search: ImportanceSearch


def ggml_calibration(target, calibration, tokenizer, config, preset: str | None, options: dict) -> GgmlCalibration:
    """``lowbit.quantize``'s calibration arguments for the GGML ``target``, resolved and checked
    (``lowbit.gguf_options.gguf_calibration_config``; QuantizationError naming an option a GGUF
    file's calibration does not read), the windows tokenized."""
    from lowbit.calibration import calibration_set
    from lowbit.gguf_options import gguf_calibration_config

    cfg, search = gguf_calibration_config(target.value, config, preset, options)
    data = calibration_set(calibration, tokenizer, **cfg.data_options())
    return GgmlCalibration(ids=data.ids, config=cfg, search=search)


def calibrate(model: nn.Module, plan, types: Mapping[str, Any], linears: Mapping[str, Any], cal: GgmlCalibration
              ) -> tuple[dict[str, tuple[GgmlType, torch.Tensor]], GgmlCalibrated]:
    """(HF weight name -> (type, uint8 rows) for every linear weight of a GGML type, as
    ``quantize_gguf`` encodes it, for ``quantize_ggml`` to hold; what the file's other tensors get
    when written, ``GgmlCalibrated``). ``plan``, ``types``: the format's plan of the model's
    tensors and their types; ``linears``: linear name -> its weight's type
    (``gguf_memory.linear_types``). Runs the float model: call it before any linear is replaced."""
    from lowbit.formats.gguf.writer import float_weight
    from lowbit.gguf_fused import experts_split, stack, with_parts
    from lowbit.gguf_gptq import gptq_options, gptq_sources, rounded_types
    from lowbit.gguf_reconstruct import reconstruct_options
    from lowbit.gguf_resident import resident_sources
    from lowbit.kernels.ggml import encode  # the direct search in C where the kernel setting allows

    cfg = cal.config
    kinds = rounded_types(plan, types, cfg)
    was = model.training
    model.eval()
    try:
        with experts_split(model) as parts:  # fused experts as linears: a vector and a Hessian per expert
            params = dict(model.named_parameters(remove_duplicate=False))
            if reconstruct_options(cfg) is None:
                importance, encoded = gptq_sources(model, cal.ids, params.__getitem__, with_parts(kinds, parts),
                                                   options=gptq_options(cfg), batch_size=cfg.batch_size,
                                                   search=cal.search)
            else:  # layer by layer, as the streamed calibration (lowbit.gguf_resident)
                importance, encoded = resident_sources(model, cal.ids, params.__getitem__, with_parts(kinds, parts),
                                                       cfg, cal.search)
            stack(plan, parts, importance, encoded)  # back onto the fused tensors, in the file's row order
    finally:
        model.train(was)
    held: dict[str, tuple[GgmlType, torch.Tensor]] = {}
    for name, kind in linears.items():
        if not isinstance(kind, GgmlType):
            continue
        w = f"{name}.weight"
        got = encoded.pop(w, None)
        if got is None:  # not GPTQ-rounded: the search's codes, as the writer would encode them
            W = float_weight(model.get_submodule(name).weight, w)
            got = (kind, encode(W, kind, w, importance=importance.get(w), search=cal.search))
        held[w] = got
    # what GPTQ rounded besides the linears held: e.g. a token embedding tied to the output
    return held, GgmlCalibrated(importance=importance, encoded=encoded, search=cal.search)
