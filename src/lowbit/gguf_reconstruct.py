"""Block reconstruction of a calibrated GGUF file's decoder layers (``reconstruct_iters`` > 0).

After a decoder layer's linears are rounded (the importance-weighted search's scales and mins,
GPTQ's codes), their codes are tuned on the layer's output (``lowbit.algorithms.reconstruct``
with ``lowbit.algorithms.reconstruct_grid.GridOffsets``: SignRound-style offsets on each type's
own grid, the scales and mins kept, so the file's layout and size do not change): the layer runs
on the *quantized* model's hidden states (every earlier layer with its rounded weights) and aims
at the *float* model's output of that layer, each token weighed by 1 / its mean square, as
lowbit's own schemes are reconstructed; the tuned codes are kept only where they beat GPTQ's on
the check ``reconstruct_layer`` makes. The layer's other GGML weights (MXFP4 / NVFP4, which have
no affine grid) compute with their rounded values and are not tuned; weights the file keeps in
F16 / F32 compute in float.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from lowbit.numerics.ggml import GgmlType


def reconstruct_options(config):
    """The reconstruction a GGUF file's calibration ``config`` asks for (None: off;
    ``reconstruct_iters`` None: ``gguf_options.DEFAULT_GGUF_RECONSTRUCT_ITERS``)."""
    from lowbit.algorithms.reconstruct import ReconstructOptions
    from lowbit.gguf_options import DEFAULT_GGUF_RECONSTRUCT_ITERS

    iters = DEFAULT_GGUF_RECONSTRUCT_ITERS if config.reconstruct_iters is None else config.reconstruct_iters
    if iters <= 0:
        return None
    return ReconstructOptions(iters=iters, lr=config.reconstruct_lr, batch_size=config.reconstruct_batch_size)


def refuse_reconstruction(config, where: str) -> None:
    """QuantizationError when ``config`` asks for block reconstruction where it cannot run
    (``where``: e.g. a folder without decoder layers to run one by one)."""
    from lowbit.errors import QuantizationError

    if reconstruct_options(config) is not None:
        raise QuantizationError(f"'reconstruct_iters' ({config.reconstruct_iters}): GGML types are reconstructed one "
                                f"decoder layer at a time, and {where}; set reconstruct_iters=0")


def _decoded(kind: GgmlType, data: torch.Tensor, shape) -> torch.Tensor:
    from lowbit.numerics.ggml import decode

    return decode(data, kind).reshape(shape).to(torch.float32)


def tune_layer(layer: nn.Module, prefix: str, rows: dict[str, tuple[GgmlType, torch.Tensor]],
               names: Mapping[str, list[str]], weights: Callable[[str], Any], inputs: list, targets: list,
               options, layout=None) -> tuple[dict[str, tuple[GgmlType, torch.Tensor]], list, Any]:
    """(``rows`` with the codes of the layer's affine GGML weights tuned, the layer's outputs on
    ``inputs`` with the rows' values, the ReconstructReport). ``layer``: the decoder layer whose
    linears (full names ``prefix`` + relative name in ``names``, linear -> its HF weight names) were
    rounded into ``rows`` (HF weight name -> (type, uint8 rows)); ``weights``: HF weight name -> the
    float tensor the rows were encoded from; ``inputs``: the layer's calls on the quantized model's
    hidden states; ``targets``: the float layer's outputs, one per call. The layer's linears are
    left computing with the rows' values (the caller releases the layer)."""
    from lowbit.algorithms.reconstruct import reconstruct_layer
    from lowbit.algorithms.reconstruct_grid import GridOffsets
    from lowbit.calibration.capture import output_hidden
    from lowbit.calls import move_call
    from lowbit.formats.gguf.writer import float_weight
    from lowbit.numerics.ggml_codes import AFFINE, codes_of, grid_of, with_codes
    from lowbit.targets import set_submodule

    tuned: dict[str, tuple[str, GgmlType]] = {}   # relative linear name -> (HF weight name, type)
    floats: dict[str, torch.Tensor] = {}
    for n, ws in names.items():
        if not n.startswith(prefix) or len(ws) != 1 or ws[0] not in rows:
            continue
        rel, w = n[len(prefix):], ws[0]
        kind, data = rows[w]
        mod = layer.get_submodule(rel)
        if not isinstance(mod, nn.Linear) or tuple(mod.weight.shape) != (data.shape[0], mod.weight.shape[1]):
            continue
        if kind in AFFINE:
            tuned[rel] = (w, kind)
            floats[rel] = float_weight(weights(w), w)
        else:  # no affine grid: its rounded values, fixed
            with torch.no_grad():
                mod.weight.copy_(_decoded(kind, data, mod.weight.shape).to(mod.weight.dtype))

    made: dict[str, GridOffsets] = {}  # relative linear name -> its offsets, read back after the steps

    def offsets(rel: str, module: nn.Module, w: torch.Tensor) -> GridOffsets:
        w_name, kind = tuned[rel]
        data = rows[w_name][1]
        made[rel] = GridOffsets(w, grid_of(data, kind), codes_of(data, kind))
        return made[rel]

    rep = reconstruct_layer(layer, targets, floats, inputs, options, set_submodule, layout=layout, offsets=offsets)
    out = dict(rows)
    for rel, off in made.items():
        w, kind = tuned[rel]
        data = with_codes(rows[w][1], kind, off.codes())
        out[w] = (kind, data)
        mod = layer.get_submodule(rel)
        with torch.no_grad():
            mod.weight.copy_(off.value().to(mod.weight.dtype))
    outs = rep.outputs
    if outs is None:  # nothing ran (no affine weight, or no steps): the layer with its rounded values
        with torch.no_grad():
            outs = []
            for call in inputs:
                args, kwargs = move_call(call, None)
                outs.append(output_hidden(layer(*args, **kwargs)))
    return out, outs, rep
