"""The float model's hidden states at each decoder layer on one calibration set, shared by
several calibrated quantizations of the same float model (``lowbit compare``'s rows).

Block reconstruction on quantized layer inputs aims at the float model's outputs, so every
calibrated 4-bit run carries the float model's hidden states along, one float pass of every
decoder layer over the calibration set (``Phase.TARGETS``). Those states depend on the float
model and the windows only, not on the scheme: a ``FloatStates`` given to
``lowbit.quantize(..., float_states=...)`` keeps the states the first run computes and hands
them, unchanged (the same tensors), to the later runs, which then skip that pass.

A run stores or reads states only when they are the ones it would compute itself, bit for bit:
the same calibration ids and padding mask, the same batch size (the key, checked on every run:
a run with another key neither reads nor overwrites them), no rotation and no SmoothQuant (both
change the float layers before their outputs are taken). The caller promises the same float
model (``compare`` deep-copies one model for every row). Memory: one hidden-state tensor per
decoder layer and calibration batch (SmolLM2-135M, 16 x 512 windows: 0.56 GB in float32).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class FloatStates:
    key: tuple | None = None
    states: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # layer index -> its outputs per batch

    @staticmethod
    def make_key(tokens: torch.Tensor, valid: torch.Tensor | None, batch_size: int) -> tuple:
        return (tokens.detach().cpu().clone(), None if valid is None else valid.detach().cpu().clone(), int(batch_size))

    def matches(self, key: tuple) -> bool:
        """Whether the states held are for ``key`` (``make_key``); an empty store takes any key."""
        if self.key is None:
            return True
        ids, valid, bs = self.key
        ids2, valid2, bs2 = key
        same_valid = (valid is None and valid2 is None) or (
            valid is not None and valid2 is not None and torch.equal(valid, valid2))
        return bs == bs2 and ids.shape == ids2.shape and torch.equal(ids, ids2) and same_valid

    def get(self, layer: int) -> list[torch.Tensor] | None:
        return self.states.get(layer)

    def put(self, key: tuple, layer: int, outputs: list[torch.Tensor]) -> None:
        if self.key is None:
            self.key = key
        self.states[layer] = outputs
