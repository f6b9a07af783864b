"""Save and load quantized checkpoints: ``lowbit.save`` and ``lowbit.load``."""

from lowbit.checkpoint.fake_module import FakeQuantLinear
from lowbit.checkpoint.load import load
from lowbit.checkpoint.save import collect_tensors, save

__all__ = ["save", "load", "FakeQuantLinear", "collect_tensors"]
