"""Local text files, one paragraph a line: the built-in slices and reading any such file.

The package ships two public-domain slices of Jane Austen, kept apart: calibration text
(``lowbit/data/calibration.txt``, from *Emma*) and evaluation text
(``lowbit/data/evaluation.txt``, from *Persuasion*).
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from lowbit.errors import LowbitError


def builtin_calibration_text_path() -> Path:
    return Path(str(resources.files("lowbit") / "data" / "calibration.txt"))


def builtin_evaluation_text_path() -> Path:
    return Path(str(resources.files("lowbit") / "data" / "evaluation.txt"))


def read_paragraphs(path: str | os.PathLike, *, kind: str, error: type[LowbitError]) -> list[str]:
    """Non-empty stripped lines of ``path``; ``error(...)`` names the file and its ``kind``
    ("calibration", "evaluation") when it is missing, not UTF-8 or empty."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{kind} text file {str(p)!r} not found: it does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{kind} text file {str(p)!r} is not UTF-8 text: {e}") from None
    paras = [line.strip() for line in text.splitlines() if line.strip()]
    if not paras:
        raise error(f"{kind} text file {str(p)!r} has no text")
    return paras
