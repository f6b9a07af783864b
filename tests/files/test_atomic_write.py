"""The one atomic write of a file (lowbit.files.writer.atomic_path): the target is either as it was
or whole, and no temporary file is left; the compare report's files go through it."""

from __future__ import annotations

import pytest

from lowbit.files.writer import atomic_path, write_text_atomic


def test_a_completed_block_replaces_the_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "a.json"
    target.write_text("old")
    with atomic_path(target) as tmp:
        assert tmp.parent == tmp_path and tmp != target
        tmp.write_text("new")
        assert target.read_text() == "old"  # not before the block completes
    assert target.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]
    write_text_atomic(target, "text \u00e9")
    assert target.read_text(encoding="utf-8") == "text \u00e9"


def test_a_failed_block_leaves_the_file_as_it_was(tmp_path):
    target = tmp_path / "a.json"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("boom")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_the_report_files_are_written_through_it(tmp_path):
    from lowbit.report.writer import write_report

    report = {"model": {"path": "m"}, "float": {"perplexity": 10.0, "tokens_scored": 5},
              "schemes": [{"scheme": "w8a16", "status": "ok", "perplexity": 10.5, "ppl_change_pct": 5.0}]}
    paths = write_report(report, tmp_path / "out")
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["report.json", "report.png"]
