"""What every registered checkpoint format is (``lowbit.formats.FORMATS``): its ``Format``
member, its container, and the rule of which schemes it holds.

- ``Container.FOLDER``: a Hugging Face folder written one linear at a time; the format is a
  ``Layout`` (``lowbit.formats.base``: per-linear tensors, ``quantization_config``, reading back),
  written by ``lowbit.save``, the streamed path and model-free alike.
- ``Container.FILE``: one file whose tensor names, row order and metadata are decided for the whole
  model (GGUF: ``lowbit.formats.gguf.format.GgufFormat``, llama.cpp's converter), written whole by
  ``lowbit.save(..., format=...)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import Enum
from typing import Any


class Container(str, Enum):
    """What a checkpoint format writes: a folder of per-linear tensors, or one whole file."""

    FOLDER = "folder"
    FILE = "file"


class CheckpointFormat(ABC):
    """A registered checkpoint format: ``format`` (its ``lowbit.formats.base.Format`` member),
    ``container`` and ``check_scheme``; each container's class adds the rest of its contract."""

    format: Any  # lowbit.formats.base.Format
    container: Container

    @abstractmethod
    def check_scheme(self, scheme: Any) -> None:
        """Raise FormatError (naming the scheme and the format) if this format cannot hold it."""
