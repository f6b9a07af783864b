"""A disk that fills up during a streamed calibrated run (``lowbit quantize --calib``, streamed by
default): whichever write is refused, the run ends with one ``error:`` line naming the file and
the temporary folder it keeps (exit 2, no traceback), and the same command, once there is room,
resumes and writes the bytes of an uninterrupted run. Under torchrun every rank says one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.cli import assert_one_error, leftovers, run, tiny  # noqa: F401  (tiny: fixture)
from helpers.full_disk import FullDisk
from helpers.modelfree import digests
from lowbit.cli import main

ARGS = ["--scheme", "w8a8-int8", "--calib-samples", 2, "--calib-seq-len", 16]
# every write site of the streamed path, as the file it writes (the tiny model has 2 decoder layers)
SITES = [
    "run.json",                                    # the run's fingerprint (resume state)
    "lowbit-model-00001-of-00003.safetensors",     # a decoder layer's shard
    "inputs-rank0.safetensors",                    # the captured inputs of the next layer
    "progress.json",                               # the layers done
    "lowbit-model-00003-of-00003.safetensors",     # the last shard (embeddings, norm)
    "config.json",
    "generation_config.json",                      # written from the model, then copied from the source
    "tokenizer.json",                              # a copy of the source's auxiliary files
    "tokenizer (save_pretrained)",                 # the tokenizer's own files
    "lowbit-model.safetensors.index.json",
]
SAME_SITE = {"lowbit-model-00002-of-00003.safetensors", "tokenizer_config.json"}  # another layer, another copy


def _quantize(tiny, out: Path) -> None:
    """``lowbit quantize`` in this process without capsys (a module fixture cannot take it): it succeeds."""
    try:
        main(["quantize", str(tiny), *map(str, ARGS), "--output", str(out)])
    except SystemExit as e:
        assert not e.code, e.code


@pytest.fixture(scope="module")
def whole(tiny, tmp_path_factory):
    """An uninterrupted run's output, and the files its writes made, in order."""
    mp = pytest.MonkeyPatch()
    try:
        disk = FullDisk(mp)
        out = tmp_path_factory.mktemp("whole") / "out"
        _quantize(tiny, out)
    finally:
        mp.undo()
    return out, disk.sites


def test_every_write_site_is_tested(whole):
    _, sites = whole
    assert set(sites) == set(SITES) | SAME_SITE, sorted(set(sites) ^ (set(SITES) | SAME_SITE))


@pytest.mark.parametrize("site", SITES)
def test_a_full_disk_is_one_line_and_the_same_command_resumes(capsys, monkeypatch, tiny, tmp_path, whole, site):
    out = tmp_path / "out"
    tmp = out.parent / f".{out.name}.lowbit-tmp"
    disk = FullDisk(monkeypatch, fail_at=1, only=site)
    code, _, err = run(capsys, "quantize", tiny, *ARGS, "--output", out)
    assert disk.refused, f"{site} was never written"
    line = assert_one_error(code, err, "No space left on device", str(out), str(tmp), "resume")
    named = Path(disk.refused[0]).parent if site.startswith("tokenizer (") else disk.refused[0]
    assert f"cannot write {str(named).removesuffix('.partial')} " in line, line
    assert not out.exists() and tmp.is_dir() and not list(tmp.rglob("*.partial"))
    assert leftovers(out) == [tmp.name]  # the resume folder, no lock file
    disk.fail_at = None  # there is room again: the same command resumes
    code, _, err = run(capsys, "quantize", tiny, *ARGS, "--output", out)
    assert code == 0, err
    assert digests(out) == digests(whole[0])
    assert leftovers(out) == ["out"]


# ---------------------------------------------------------------------------- torchrun
JOB = Path(__file__).parents[1] / "helpers" / "full_disk_job.py"


def _job(args: list, logs: Path, ranks: int) -> dict[int, tuple[int, str]]:
    """``full_disk_job.py ARGS`` as one process (``ranks=1``) or ``ranks`` ranks of torchrun, one
    thread each (as torchrun gives each rank): each rank's (exit code, stderr)."""
    src = str(Path(__file__).parents[2] / "src")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    env["PYTHONPATH"] = os.pathsep.join([src, str(JOB.parents[1])] + ([env["PYTHONPATH"]] if "PYTHONPATH" in env
                                                                      else []))
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    cmd = [sys.executable, str(JOB), str(logs), *map(str, args)]
    if ranks > 1:
        cmd = [torchrun, "--standalone", "--nproc-per-node", str(ranks), "--no-python", *cmd]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    got = {}
    for r in range(ranks):
        rc = logs / f"rank{r}.rc"
        assert rc.is_file(), p.stderr[-3000:]
        got[r] = (int(rc.read_text()), (logs / f"rank{r}.err").read_text())
    return got


@pytest.mark.subprocess
def test_under_torchrun_every_rank_says_one_line_and_the_job_resumes(tiny, tmp_path):
    out, ref = tmp_path / "out", tmp_path / "ref"
    tmp = out.parent / f".{out.name}.lowbit-tmp"
    got = _job([-1, "-", "quantize", tiny, *ARGS, "--output", ref], tmp_path / "logs", ranks=1)
    assert got[0][0] == 0, got
    cli = ["quantize", tiny, *ARGS, "--output", out]
    # rank 1's own write (its inputs of the next layer), then rank 0's last one (the index)
    for failing, site in ((1, "inputs-rank1.safetensors"), (0, "lowbit-model.safetensors.index.json")):
        got = _job([failing, site, *cli], tmp_path / "logs", ranks=2)
        for r, (rc, err) in got.items():
            line = assert_one_error(rc, err, "No space left on device", site, str(tmp), "resume")
            assert (f"rank {failing} of 2 failed" in line) == (r != failing), line
        assert not out.exists() and tmp.is_dir()
    got = _job([-1, "-", *cli], tmp_path / "logs", ranks=2)
    assert all(rc == 0 for rc, _ in got.values()), got
    assert digests(out) == digests(ref)
