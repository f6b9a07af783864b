"""The README's two fresh-machine commands are what CI runs, and the README stays short (issue 37)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()
COMMANDS = [ln for ln in README.splitlines() if ln.startswith("python3 -m venv")]


def test_readme_is_at_most_200_lines():
    assert len(README.splitlines()) <= 200


def test_the_test_command_is_ci_verbatim():
    assert len(COMMANDS) == 2
    assert COMMANDS[1] in CI


def test_the_main_job_installs_as_ci_and_runs_compare():
    install, _, rest = COMMANDS[0].partition(" && .venv/bin/pip install -q --no-deps ")
    package, _, job = rest.partition(" && ")
    assert install in CI and f"pip install -q --no-deps {package}" in CI
    assert job == ".venv/bin/lowbit compare" and ".venv/bin/lowbit compare --schemes" in CI
    assert "mkdocs build --strict" in CI
