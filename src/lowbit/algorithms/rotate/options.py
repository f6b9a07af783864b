"""The ``rotation`` option (``CalibrationConfig.rotation``, CLI ``--rotation``) and what a
rotation pass did (``RotationReport``)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Rotation(str, Enum):
    """Which orthonormal rotation is fused into the float model's weights before quantization."""

    NONE = "none"          # no rotation (the default: lowbit.algorithms.rotate.apply, measured in bench/peers/RESULTS.md)
    HADAMARD = "hadamard"  # R1: a Hadamard matrix on the residual stream; R2: one per attention head on v/o

    def __str__(self) -> str:
        return self.value


DEFAULT_ROTATION = Rotation.NONE


@dataclass(frozen=True)
class RotationReport:
    """What ``rotate_model`` changed.

    rotation: the option's value. hidden: the residual width rotated by R1; r1_block: the order of
    R1's Hadamard blocks (== hidden: one full Hadamard matrix; smaller: block-diagonal).
    head_dim / r2_block: the same for R2 (each attention head's v rows and o columns).
    layers: decoder layers rotated. untied: the output embedding was tied to the input embedding
    and now has its own weight (``config.tie_word_embeddings`` set to False). r2_pairs: the
    attention v -> o pairs R2 rotated (a layer without one, e.g. linear attention, gets R1 only;
    head_dim is the first pair's head width, 0 when there is none)."""

    rotation: str
    hidden: int
    r1_block: int
    head_dim: int
    r2_block: int
    layers: int
    untied: bool
    r2_pairs: int

    def describe(self) -> str:
        """One line for ``lowbit quantize``'s output."""
        r1 = f"{self.hidden}" if self.r1_block == self.hidden else f"{self.hidden} (blocks of {self.r1_block})"
        r2 = f"{self.head_dim}" if self.r2_block == self.head_dim else f"{self.head_dim} (blocks of {self.r2_block})"
        if self.r2_pairs == 0:
            r2 = "none (no attention v -> o pair)"
        elif self.r2_pairs != self.layers:
            r2 += f" on {self.r2_pairs} attention layer{'s' if self.r2_pairs > 1 else ''}"
        tie = "; lm_head untied from the embeddings" if self.untied else ""
        return f"rotated ({self.rotation}): residual stream R1 {r1}, per-head R2 {r2}, {self.layers} layers{tie}"
