"""Evaluation text: the package's built-in slice, or any local file (one paragraph a line).

The built-in ``lowbit/data/evaluation.txt`` is the opening chapters of Jane Austen's
*Persuasion* (1818, public domain), one paragraph a line. Calibration uses a different book
(``lowbit/data/calibration.txt``, from *Emma*), so the two never overlap.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from lowbit.errors import LowbitError


class EvalDataError(LowbitError, ValueError):
    """Evaluation text is missing, empty or unusable."""


def default_eval_text_path() -> Path:
    return Path(str(resources.files("lowbit") / "data" / "evaluation.txt"))


def default_calibration_text_path() -> Path:
    return Path(str(resources.files("lowbit") / "data" / "calibration.txt"))


def read_paragraphs(path: str | os.PathLike | None = None) -> list[str]:
    """Non-empty stripped lines of ``path`` (default: the built-in evaluation text)."""
    p = default_eval_text_path() if path is None else Path(path)
    if not p.is_file():
        raise EvalDataError(f"evaluation text not found: {p}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise EvalDataError(f"{p} is not UTF-8 text ({e})") from e
    paras = [line.strip() for line in text.splitlines() if line.strip()]
    if not paras:
        raise EvalDataError(f"{p} has no text")
    return paras


def read_text(path: str | os.PathLike | None = None) -> str:
    """The text of ``path`` as one string, paragraphs joined by newlines."""
    return "\n".join(read_paragraphs(path))
