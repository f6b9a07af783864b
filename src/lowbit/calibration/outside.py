"""Linears outside the decoder layers when the whole model cannot run after them (streamed runs).

In memory, the linears outside the decoder layers are calibrated last, by forwards of the whole,
already quantized model (``LayerwiseCalibrator._whole_model``). A streamed run holds one decoder
layer at a time, so it cannot run that forward. The rule there (``before_layers``), applied right
after the first layer's inputs are captured, while everything outside the layers is loaded:

- a linear whose scheme needs no activations (no static input scale, no GPTQ Hessian) is quantized
  from its weight alone, as in memory;
- any other is observed on the inputs it gets before the first decoder layer runs (the model's
  forward up to that layer, once per calibration batch: what Gemma 4's ``per_layer_model_projection``
  reads is the token embeddings), then quantized. Those inputs do not depend on any decoder layer,
  so they are the ones the in-memory run observes, and the result is the same tensors. A linear
  the model calls only after the decoder layers (an output head) gets no such input: refused,
  naming it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from lowbit.calibration.capture import Stop, observing
from lowbit.calibration.cost import Phase
from lowbit.calibration.reduce import distinct, reduce_stats
from lowbit.errors import QuantizationError
from lowbit.fusion import fused_groups


@torch.no_grad()
def before_layers(calib, names: list[str], tokens: torch.Tensor, first_layer: nn.Module,
                  masks: list[torch.Tensor] | None, device: torch.device | None = None) -> None:
    """Calibrate and quantize ``names`` (linears outside the decoder layers of ``calib.model``, a
    ``LayerwiseCalibrator``) on their inputs before ``first_layer`` runs (module docstring);
    ``masks``: per calibration batch, the positions that count (None: all)."""
    import time

    t0 = time.perf_counter()
    model = calib.model
    groups = fused_groups(names)
    rel = {n: n for n in names}
    need = [g for g in groups if any(calib._scheme(n).needs_calibration or calib._gptq(calib._scheme(n)) for n in g)]
    stats = {g[0]: calib._new_stats(g[0]) for g in need}
    if need:
        mods = {g[0]: model.get_submodule(g[0]) for g in need}
        sinks, bs, current = calib.cfg.sink_positions, calib.cfg.batch_size, [None]  # current: the batch's mask

        def observe(n: str, x: torch.Tensor) -> None:
            stats[n].observe(x, sinks, 0, current[0])

        def stop(_mod, _args, _kwargs):
            raise Stop

        device = device or next(model.parameters()).device
        h = first_layer.register_forward_pre_hook(stop, with_kwargs=True)
        try:
            with observing(mods, observe):
                for b, i in enumerate(range(0, tokens.shape[0], bs)):
                    current[0] = None if masks is None else masks[b]
                    try:
                        model(input_ids=tokens[i:i + bs].to(device), use_cache=False)
                    except Stop:
                        pass
        finally:
            h.remove()
        reduce_stats(calib.group, distinct(stats), device)  # several ranks: as one process observes
        unseen = [g[0] for g in need if stats[g[0]].all_pos.channel_max is None]  # the same on every rank
        if unseen:
            raise QuantizationError(
                f"linear {unseen[0]!r} is outside the decoder layers and gets no input before the first of "
                f"them: a streamed run calibrates only those (quantize in memory, or add it to ignore)")
    calib._quantize_groups(model, groups, rel, stats)
    calib.report.cost.add(Phase.WHOLE_MODEL, time.perf_counter() - t0)
