"""Evaluation text: the package's built-in slice, or any local file (one paragraph a line).

The built-in ``lowbit/data/evaluation.txt`` is the opening chapters of Jane Austen's
*Persuasion* (1818, public domain), one paragraph a line. Calibration uses a different book
(``lowbit/data/calibration.txt``, from *Emma*), so the two never overlap.
"""

from __future__ import annotations

import os
from pathlib import Path

from lowbit.errors import LowbitError
from lowbit.textfiles import builtin_calibration_text_path, builtin_evaluation_text_path
from lowbit.textfiles import read_paragraphs as _read_paragraphs


class EvalDataError(LowbitError, ValueError):
    """Evaluation text is missing, empty or unusable."""


def default_eval_text_path() -> Path:
    return builtin_evaluation_text_path()


def default_calibration_text_path() -> Path:
    return builtin_calibration_text_path()


def read_paragraphs(path: str | os.PathLike | None = None) -> list[str]:
    """Non-empty stripped lines of ``path`` (default: the built-in evaluation text)."""
    return _read_paragraphs(default_eval_text_path() if path is None else path, kind="evaluation",
                            error=EvalDataError)


def read_text(path: str | os.PathLike | None = None) -> str:
    """The text of ``path`` as one string, paragraphs joined by newlines."""
    return "\n".join(read_paragraphs(path))
