"""GGUF (llama.cpp) files. ``convert``: the metadata, tokenizer and tensor names from llama.cpp's
own converter, and where each quantized weight's rows go (``plan_gguf``); see docs/gguf.md.

``is_gguf_file`` is the one rule of what a GGUF file is, asked by ``lowbit.load``,
``lowbit.models.load_model``, ``lowbit eval`` and ``lowbit inspect`` alike: its first four bytes
are GGUF's magic, whatever its name (a GGUF file without the ``.gguf`` suffix is one); a file
named ``*.gguf`` whose bytes are not GGUF is a FormatError naming it, never a folder or a float
checkpoint. This module imports neither torch nor gguf (the CLI asks it before loading either)."""

from __future__ import annotations

import os
from pathlib import Path

from lowbit.errors import FormatError

GGUF_MAGIC = b"GGUF"
GGUF_SUFFIX = ".gguf"


def is_gguf_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a GGUF file: a regular file whose first four bytes are ``GGUF_MAGIC``.
    False for a folder or a missing path; FormatError (one line naming the file) for a file named
    ``*.gguf`` that does not start with the magic or cannot be read."""
    p = Path(path)
    if not p.is_file():
        return False
    named = p.suffix.lower() == GGUF_SUFFIX
    try:
        with open(p, "rb") as f:
            head = f.read(len(GGUF_MAGIC))
    except OSError as e:
        if not named:
            return False
        raise FormatError(f"{str(p)!r} cannot be read as a GGUF file: {e.strerror or type(e).__name__}") from None
    if head == GGUF_MAGIC:
        return True
    if named:
        raise FormatError(f"{str(p)!r} is named {GGUF_SUFFIX} but is not a GGUF file (its first bytes are not "
                          f"GGUF's magic {GGUF_MAGIC.decode()!r})")
    return False
