"""Running the ``lowbit`` CLI in-process and checking its one-line errors; a tiny model folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.eval_fixtures import save_tiny_folder
from lowbit.cli import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_folder(tmp_path_factory.mktemp("tiny") / "model")


def run(capsys, *args) -> tuple[int, str, str]:
    """``lowbit ARGS`` through ``lowbit.cli.main``: (exit code, stdout, stderr)."""
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_error(code: int, err: str, *names: str) -> str:
    """Exit 2, one ``error:`` line, the last on stderr (progress bars may precede it), no traceback,
    naming each of ``names``; returns the line."""
    lines = err.strip().splitlines()
    assert code == 2, err[-3000:]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert "Traceback" not in err and len(errors) == 1 and lines[-1] == errors[0], err[-3000:]
    for n in names:
        assert n in errors[0], (n, errors[0])
    return errors[0]


def leftovers(out: Path) -> list[str]:
    """The output and anything lowbit writes next to it (temporary folder, lock file)."""
    return sorted(p.name for p in out.parent.iterdir() if p.name == out.name or p.name.startswith(f".{out.name}."))


def copy_folder(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


# ---------------------------------------------------------------------------- broken source folders
