"""bench/README.md is the one index of the measured results: every results file is in it, and every
file it links exists (so a moved or renamed file is caught here, not by a reader)."""

from __future__ import annotations

import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
INDEX = BENCH / "README.md"


def _links() -> set[str]:
    return set(re.findall(r"\]\(([^)#]+)\)", INDEX.read_text()))


def test_every_results_file_is_indexed():
    results = {str(p.relative_to(BENCH)) for p in BENCH.rglob("RESULTS*.md")}
    assert results, "no results files found under bench/"
    assert results - _links() == set()


def test_every_indexed_file_exists():
    assert {link for link in _links() if not (BENCH / link).is_file()} == set()


def test_no_script_or_results_file_at_the_top_level():
    top = {p.name for p in BENCH.iterdir() if p.is_file()}
    assert top == {"README.md"}, top
