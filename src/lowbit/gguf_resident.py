"""A GGML calibration with block reconstruction on a model already in memory
(``lowbit.quantize(model, "Q2_K", text, reconstruct_iters=20)``).

The streamed calibration's layer loop (``lowbit.gguf_layers.LayerLoop``: the float hidden states
layer by layer, each layer's statistics, GPTQ, then the reconstruction on the quantized model's
hidden states) run on a model whose layers are loaded: nothing is read from shards or freed. The
windows, statistics and rounding are the streamed run's, so the rows are those ``quantize_gguf``
writes from the model's folder (tests). The reconstructed layers' linears are left computing with
their rounded values (the caller replaces them with their blocks; experts stored fused are put
back from their split linears, so they hold their rounded values too).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from lowbit.numerics.ggml import GgmlType, ImportanceSearch


class Resident:
    """``LayerLoop``'s skeleton for a model in memory: every module is loaded, nothing is freed."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def materialize(self, module: nn.Module, prefix: str) -> None:
        pass

    def release(self, module: nn.Module) -> None:
        pass

    def materialize_outside(self, layers_path: str) -> None:
        pass

    def release_outside(self, layers_path: str) -> None:
        pass


def resident_sources(model: nn.Module, tokens: torch.Tensor, weights: Callable[[str], Any],
                     kinds: Mapping[str, GgmlType], config, search: ImportanceSearch,
                     progress: bool | None = None) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """``gguf_gptq.gptq_sources``' (importance, encoded) for the model in memory, one decoder layer
    after the other with ``config``'s reconstruction (``gguf_reconstruct.reconstruct_options``).
    QuantizationError when the model has no decoder layers to run one by one."""
    from lowbit.calibration.capture import find_decoder_layers
    from lowbit.gguf_gptq import MAX_HESSIAN_BYTES, gptq_options, weight_names
    from lowbit.gguf_reconstruct import reconstruct_options, refuse_reconstruction
    from lowbit.gguf_layers import QUEUE_BYTES, LayerLoop, RoundQueue

    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    found = find_decoder_layers(model, linears)
    if found is None:  # called with reconstruction only: refused by name
        refuse_reconstruction(config, f"{type(model).__name__} has no decoder layers to run one by one")
    names = weight_names(model)
    encoded: dict[str, tuple] = {}
    rounds = RoundQueue(names, kinds, weights, set(), lambda got, _: encoded.update(got), gptq_options(config),
                        search, min(QUEUE_BYTES, MAX_HESSIAN_BYTES))
    LayerLoop(Resident(model), found[0], found[1], names, rounds, MAX_HESSIAN_BYTES, progress,
              reconstruct_options(config)).run(tokens, config.batch_size)
    return rounds.importance, encoded
