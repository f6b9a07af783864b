"""What a layer-by-layer calibration run does around each decoder layer.

``LayerwiseCalibrator.run(..., hooks=...)`` calls, in order: ``start`` once (before the first
layer's inputs are captured: the layers still to run, and the saved inputs of the first of them
when a killed run is resumed), ``captured`` once they are captured, then for each decoder layer
``enter`` (before it is calibrated: make its weights present), and ``leave`` (after it is quantized and, unless it is the last, its
outputs computed: write it, free it). ``InMemory`` (the default) does nothing: the whole model
is in memory. ``lowbit.streamed`` reads each layer from the checkpoint and writes it out.

``whole_model``: whether the whole model can run once the layers are quantized (in memory); where
it cannot (streamed), the linears outside the decoder layers are calibrated before the first layer
runs (``lowbit.calibration.outside``).

``device``: where each layer computes (None: where the model is). With ``offload`` the
calibration activations stay in CPU memory and each batch is moved to ``device`` when it runs.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from lowbit.calls import move_call  # noqa: F401 (re-exported)


class InMemory:
    device: torch.device | None = None
    offload: bool = False
    whole_model: bool = True

    def start(self, path: str, layers: nn.ModuleList) -> tuple[int, list[torch.Tensor] | None]:
        """(index of the first layer to run, the hidden states entering it or None: captured)."""
        return 0, None

    def captured(self) -> None:
        """The first layer's inputs are captured: what ran before it is not needed until the end."""

    def enter(self, i: int, layer: nn.Module) -> None:
        pass

    def leave(self, i: int, layer: nn.Module, next_hidden: list[torch.Tensor] | None) -> None:
        """``next_hidden``: what enters layer i + 1 (None after the last): one tensor per batch,
        then, with block reconstruction on quantized inputs, the float model's per batch; ``start``
        gives the same list back to a resumed run."""
