"""A disk that fills up during a model-free run (``lowbit quantize --model-free``): whichever write
is refused, the run ends with one ``error:`` line naming the file and the temporary folder it keeps
(exit 2, no traceback), and the same command, once there is room, resumes and writes the bytes of
an uninterrupted run (as tests/streamed/test_streamed_full_disk.py for the streamed path)."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.cli import assert_one_error, leftovers, run, tiny  # noqa: F401  (tiny: fixture)
from helpers.full_disk import FullDisk
from helpers.modelfree import digests
from lowbit.cli import main

ARGS = ["--scheme", "w8a16", "--model-free"]
# every write site of the model-free path (the tiny model is one shard), and the file its refusal
# names, in the temporary folder: the shard is filled in place under its .partial name, which stays
# for the resumed run; every other file is written atomically and named as it will be
SITES = {
    "run.json": ".modelfree/run.json",                              # the run's fingerprint
    "lowbit-model.safetensors": "lowbit-model.safetensors.partial",   # a tensor's region of the shard
    "lowbit-model.safetensors.part-1-of-1.done.json": ".modelfree/lowbit-model.safetensors.part-1-of-1.done.json",
    "lowbit-model.safetensors.done.json": ".modelfree/lowbit-model.safetensors.done.json",
    "config.json": "config.json",
    "generation_config.json": "generation_config.json",
    "tokenizer.json": "tokenizer.json",                             # the source's auxiliary files
    "tokenizer_config.json": "tokenizer_config.json",
}


@pytest.fixture(scope="module")
def whole(tiny, tmp_path_factory):
    """An uninterrupted run's output, and the files its writes made, in order."""
    mp = pytest.MonkeyPatch()
    try:
        disk = FullDisk(mp)
        out = tmp_path_factory.mktemp("whole") / "out"
        try:
            main(["quantize", str(tiny), *ARGS, "--output", str(out)])
        except SystemExit as e:
            assert not e.code, e.code
    finally:
        mp.undo()
    return out, disk.sites


def test_every_write_site_is_tested(whole):
    assert set(whole[1]) == set(SITES), sorted(set(whole[1]) ^ set(SITES))


@pytest.mark.parametrize("site", SITES)
def test_a_full_disk_is_one_line_and_the_same_command_resumes(capsys, monkeypatch, tiny, tmp_path, whole, site):
    out = tmp_path / "out"
    tmp = out.parent / f".{out.name}.lowbit-tmp"
    disk = FullDisk(monkeypatch, fail_at=1, only=site)
    code, _, err = run(capsys, "quantize", tiny, *ARGS, "--output", out)
    assert disk.refused, f"{site} was never written"
    line = assert_one_error(code, err)
    assert line == (f"error: cannot write {tmp / SITES[site]} (output folder {out}): No space left on device; "
                    f"the finished shards stay in {tmp}: run the same command again to resume, or delete that folder")
    assert not out.exists() and leftovers(out) == [tmp.name]  # the resume folder, no lock file
    assert not [p.name for p in Path(tmp).rglob("*.partial") if p.name != "lowbit-model.safetensors.partial"]
    disk.fail_at = None  # there is room again: the same command resumes
    code, _, err = run(capsys, "quantize", tiny, *ARGS, "--output", out)
    assert code == 0, err
    assert digests(out) == digests(whole[0])
    assert leftovers(out) == ["out"]
