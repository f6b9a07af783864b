"""The one refused-write handling (lowbit.files.refused): whatever writer the system refuses
(Python, safetensors' Rust writer, tokenizers', a copy), the error comes back as an OSError with
its errno, naming the file written, and then as one OutputError line."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from lowbit.errors import FormatError, OutputError
from lowbit.files.atomic import atomic_path, write_text_atomic
from lowbit.files.refused import refused, resumable_failure, write_failure, writing

# each writer refused for real: the file size limit (RLIMIT_FSIZE, SIGXFSZ ignored) makes the
# system answer a write past it with EFBIG, as a full disk answers ENOSPC
REFUSING = r"""
import json, resource, shutil, signal, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from helpers.eval_fixtures import byte_tokenizer
from lowbit.files.refused import writing
d = Path(sys.argv[1])
(d / "src.txt").write_text("x" * 10000)
tok = byte_tokenizer()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
def text(p):
    with open(p, "w") as f:
        f.write("x" * 10000)  # refused at flush: the error names no file
writers = {"safetensors": lambda p: save_file({"a": torch.zeros(4000)}, str(p)), "python": text,
           "tokenizers": lambda p: tok.backend_tokenizer.save(str(p)),
           "copy": lambda p: shutil.copyfile(d / "src.txt", p)}
got = {}
for name, write in writers.items():
    try:
        with writing(d / name):
            write(d / name)
        got[name] = "no error"
    except OSError as e:
        got[name] = [type(e).__name__, e.errno, e.filename]
print(json.dumps(got))
"""


@pytest.mark.subprocess
def test_each_writer_refused_is_an_oserror_naming_the_file(tmp_path):
    import json
    import subprocess
    import sys

    tests = Path(__file__).parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tests.parent / "src"), str(tests)]))
    p = subprocess.run([sys.executable, "-c", REFUSING, str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    for name in ("safetensors", "python", "tokenizers", "copy"):
        assert got[name] == ["OSError", errno.EFBIG, str(tmp_path / name)], (name, got)


def test_what_is_no_refused_write_is_left_as_it_is(tmp_path):
    for exc in (ValueError("bad"), FormatError("no"), KeyboardInterrupt(), Exception("no os error here"),
                OSError("no errno")):
        assert refused(exc, tmp_path / "x") in (None, exc)
        with pytest.raises(type(exc)) as got:
            with writing(tmp_path / "x"):
                raise exc
        assert got.value is exc
    named = OSError(errno.EACCES, os.strerror(errno.EACCES), str(tmp_path / "other"))
    assert refused(named, tmp_path / "x") is named  # it names its file already
    e = refused(PermissionError(errno.EACCES, "Permission denied"), tmp_path / "x")
    assert isinstance(e, PermissionError) and e.filename == str(tmp_path / "x")


def test_an_atomic_write_refused_names_the_file_and_leaves_nothing(tmp_path, monkeypatch):
    target = tmp_path / "report.json"
    target.write_text("old")
    real = Path.write_text

    def full(path, data, *a, **k):
        real(path, data[:3], *a, **k)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError) as e:
        write_text_atomic(target, "new text")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(target)  # not its .partial name
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
    with pytest.raises(OSError) as e:  # an open of the .partial name refused: the file is named
        with atomic_path(target) as tmp:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp))
    assert e.value.filename == str(target)


def test_the_one_line(tmp_path):
    out = tmp_path / "out"
    e = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / ".out.lowbit-tmp" / "config.json"))
    line = str(write_failure(e, out))
    assert line == f"cannot write {e.filename} (output folder {out}): No space left on device"
    assert isinstance(write_failure(e, out), OutputError)
    assert str(resumable_failure(e, out, "layers")) == line  # no temporary folder: nothing to resume
    (tmp_path / ".out.lowbit-tmp").mkdir()
    assert str(resumable_failure(e, out, "layers")) == (
        f"{line}; the finished layers stay in {tmp_path / '.out.lowbit-tmp'}: run the same command again to "
        f"resume, or delete that folder")
