"""Every scheme x checkpoint format writes the bytes it wrote when output_digests.json was made
(tests/golden/outputs.py says what is digested and how to regenerate after an intended change)."""

from __future__ import annotations

import json

import pytest

from golden.outputs import DIGESTS, all_digests


@pytest.fixture(scope="module")
def digests():
    return all_digests()


def test_every_scheme_and_format_writes_the_recorded_bytes(digests):
    recorded = json.loads(DIGESTS.read_text())
    assert set(digests) == set(recorded)
    changed = {}
    for key, got in digests.items():
        want = recorded[key]
        if got != want:
            if "files" in got and "files" in want:
                diff = sorted(k for k in set(got["files"]) | set(want["files"])
                              if got["files"].get(k) != want["files"].get(k))
                changed[key] = diff[:5]
            else:
                changed[key] = [got.get("refused", "written"), want.get("refused", "written")]
    assert not changed, f"outputs changed: {changed}"


def test_the_record_covers_every_format_and_both_paths(digests):
    written = [k for k, v in digests.items() if "files" in v]
    for prefix in ("in-memory/", "model-free/"):
        for fmt in ("lowbit", "fake", "compressed-tensors"):
            assert any(k.startswith(prefix) and k.endswith("/" + fmt) for k in written), (prefix, fmt)
    assert len(written) >= 60  # most of 19 presets x 3 formats x 2 paths are written, not refused
