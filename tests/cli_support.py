"""Running the lowbit CLI in-process from tests (no tests here)."""

from __future__ import annotations

from lowbit.cli import main


def run(capsys, *args) -> tuple[int, str, str]:
    """``lowbit ARGS`` through ``lowbit.cli.main``: (exit code, stdout, stderr)."""
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err
