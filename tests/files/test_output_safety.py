"""Writing an output never costs data: a refused write (disk full, read-only) is one
error line naming the path with nothing half-written left, and an OS-level lock makes a second run
into the same output refuse at once, while a killed run's lock never blocks a later one."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import lowbit
from lowbit.errors import OutputError
from helpers.cli import assert_one_error, leftovers, run, tiny  # noqa: F401  (tiny: fixture)


def folder_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(path).iterdir())}


def _enospc(path=None):
    """ENOSPC as the system raises it: with the file name for open/write of a path, none for pwrite."""
    if path is None:
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


# ---------------------------------------------------------------------------- full disk
def test_full_disk_calibrated_leaves_nothing(capsys, monkeypatch, tiny, tmp_path):
    import lowbit.files.writer as writer

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)  # part of the shard made it to disk
        raise _enospc(filename)

    monkeypatch.setattr(writer, "save_file", full)
    out = tmp_path / "out"
    for scheme, streamed in (("w8a16", False), ("w8a8-int8", False), ("w8a8-int8", True)):  # RTN, calibrated
        more = [] if streamed else ["--in-memory"]
        code, _, err = run(capsys, "quantize", tiny, "--scheme", scheme, "--output", out, "--calib-samples", 2,
                           "--calib-seq-len", 16, *more)
        line = assert_one_error(code, err, "No space left on device", f".{out.name}.lowbit-tmp", str(out))
        tmp = out.parent / f".{out.name}.lowbit-tmp"
        if streamed:  # like model-free: the finished layers stay for a resumed run, and the message says so
            assert "resume" in line and "delete" in line and not out.exists()
            shutil.rmtree(tmp)
        assert leftovers(out) == []  # no partial .out.lowbit-tmp, no lock file


def test_full_disk_model_free_says_how_to_resume(capsys, monkeypatch, tiny, tmp_path):
    out = tmp_path / "out"
    real = os.pwrite

    def full(fd, data, offset):
        raise _enospc()

    monkeypatch.setattr(os, "pwrite", full)
    monkeypatch.setattr(os, "copy_file_range", lambda *a: (_ for _ in ()).throw(_enospc()), raising=False)
    code, _, err = run(capsys, "quantize", tiny, "--scheme", "w8a16", "--model-free", "--output", out)
    line = assert_one_error(code, err, "No space left on device", str(out))
    tmp = out.parent / f".{out.name}.lowbit-tmp"
    assert not out.exists()
    if tmp.exists():  # the resume folder may stay only if the message says what to do with it
        assert str(tmp) in line and "resume" in line and "delete" in line
    monkeypatch.setattr(os, "pwrite", real)
    monkeypatch.undo()
    code, _, err = run(capsys, "quantize", tiny, "--scheme", "w8a16", "--model-free", "--output", out)
    assert code == 0, err
    ref = lowbit.quantize_checkpoint(tiny, tmp_path / "ref", scheme="w8a16", workers=0, progress=False)
    assert folder_bytes(out) == folder_bytes(ref)
    assert leftovers(out) == ["out"]


# ---------------------------------------------------------------------------- read-only output
@pytest.fixture
def read_only(monkeypatch, tmp_path):
    """A folder whose file system refuses every write (EROFS), as a read-only mount does: root
    ignores permission bits, so the refusal is simulated at os.open/os.mkdir."""
    ro = tmp_path / "ro"
    ro.mkdir()
    real_open, real_mkdir = os.open, os.mkdir

    def inside(p) -> bool:
        return Path(os.path.abspath(p)).is_relative_to(ro)

    def fake_open(p, flags, *a, **k):
        if inside(p) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(p))
        return real_open(p, flags, *a, **k)

    def fake_mkdir(p, *a, **k):
        if inside(p):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(p))
        return real_mkdir(p, *a, **k)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)
    return ro


@pytest.mark.parametrize("extra", [[], ["--model-free"]])
def test_read_only_output_folder_is_one_line(capsys, read_only, tiny, extra):
    out = read_only / "out"
    code, _, err = run(capsys, "quantize", tiny, "--scheme", "w8a16", "--output", out, *extra)
    assert_one_error(code, err, str(read_only), "Read-only file system")
    assert list(read_only.iterdir()) == []


# ---------------------------------------------------------------------------- the output lock
MIDWAY = """
import sys, time
import lowbit
from lowbit.modelfree import RunOptions
def hook(event, shard, name):
    print("midway", flush=True)
    time.sleep(120)  # killed by the test while here, holding the lock, half written
lowbit.quantize_checkpoint(sys.argv[1], sys.argv[2], scheme="nvfp4a16", workers=0, progress=False,
                           run_options=RunOptions(on_event=hook))
"""


@pytest.mark.subprocess
def test_second_run_into_the_same_output_is_refused_and_a_killed_lock_never_blocks(capsys, tiny, tmp_path):
    out = tmp_path / "out"
    child = subprocess.Popen([sys.executable, "-c", MIDWAY, str(tiny), str(out)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "midway", child.stderr.read()[-3000:]
        tmp = out.parent / f".{out.name}.lowbit-tmp"
        before = sorted(p.name for p in tmp.rglob("*"))
        lock = out.parent / f".{out.name}.lowbit-lock"
        for extra in (["--model-free", "--scheme", "w8a16"], ["--model-free", "--scheme", "nvfp4a16"],
                      ["--scheme", "w8a16"], ["--scheme", "w8a16", "--overwrite"]):
            code, _, err = run(capsys, "quantize", tiny, "--output", out, *extra)
            assert_one_error(code, err, str(out), str(lock), "another lowbit run")
        with pytest.raises(OutputError, match="another lowbit run"):
            lowbit.save(lowbit.quantize(lowbit.models.load_model(tiny)[0], "w8a16"), out)
        assert not out.exists() and sorted(p.name for p in tmp.rglob("*")) == before  # the child's files intact
        assert child.poll() is None
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL
    # the killed run's lock file may stay on disk; the kernel released its lock: a new run proceeds
    capsys.readouterr()
    code, _, err = run(capsys, "quantize", tiny, "--model-free", "--scheme", "w8a16", "--output", out)
    assert code == 0, err
    ref = lowbit.quantize_checkpoint(tiny, tmp_path / "ref", scheme="w8a16", workers=0, progress=False)
    assert folder_bytes(out) == folder_bytes(ref)
    assert leftovers(out) == ["out"]
    code, _, err = run(capsys, "quantize", tiny, "--scheme", "w8a16", "--output", tmp_path / "cal")
    assert code == 0, err
    assert leftovers(tmp_path / "cal") == ["cal"]


def test_lock_is_reentrant_in_its_thread_only(tmp_path):
    import threading

    from lowbit.files.outlock import output_lock

    out = tmp_path / "out"
    errors: list[BaseException] = []
    with output_lock(out) as lock:
        with output_lock(out):  # lowbit quantize holds it across lowbit.save, which takes it again
            assert lock.exists()
        t = threading.Thread(target=lambda: errors.append(pytest.raises(OutputError, output_lock(out).__enter__)))
        t.start()
        t.join()
        assert lock.exists()
    assert len(errors) == 1 and not lock.exists()
    with output_lock(out):  # released: taken again
        pass


def test_existing_output_is_refused_before_any_work_and_new_parents_are_not_left(capsys, monkeypatch, tiny,
                                                                                  tmp_path):
    import lowbit.models

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("mine")

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded although the output is refused")

    monkeypatch.setattr(lowbit.models, "load_model", no_loading)
    for extra in ([], ["--model-free"]):
        code, _, err = run(capsys, "quantize", tiny, "--scheme", "w8a16", "--output", out, *extra)
        assert_one_error(code, err, str(out), "--overwrite")
        assert (out / "keep").read_text() == "mine"
    monkeypatch.undo()
    deep = tmp_path / "new" / "deeper" / "out"
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{")
    code, _, err = run(capsys, "quantize", bad, "--scheme", "w8a16", "--output", deep)
    assert_one_error(code, err, "config.json")
    assert not (tmp_path / "new").exists()  # the folders made for the lock are removed with it
