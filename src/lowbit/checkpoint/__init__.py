"""Save, load and inspect quantized checkpoints: ``lowbit.save``, ``lowbit.load``, ``lowbit inspect``."""

from lowbit.checkpoint.load import load
from lowbit.checkpoint.save import collect_tensors, save

__all__ = ["save", "load", "collect_tensors"]
