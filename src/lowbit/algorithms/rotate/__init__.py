"""Hadamard rotations fused into a float model's weights before quantization (QuaRot / SpinQuant
style R1 and R2; ``apply`` says what is rotated and why online rotations are left out)."""

from lowbit.algorithms.rotate.apply import rotate_model
from lowbit.algorithms.rotate.hadamard import block_hadamard, block_size, hadamard, hadamard_order
from lowbit.algorithms.rotate.layout import ResidualLayout, residual_layout
from lowbit.algorithms.rotate.options import DEFAULT_ROTATION, Rotation, RotationReport

__all__ = ["rotate_model", "block_hadamard", "block_size", "hadamard", "hadamard_order", "ResidualLayout",
           "residual_layout", "DEFAULT_ROTATION", "Rotation", "RotationReport"]
