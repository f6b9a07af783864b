"""Few calibration windows under torchrun (2 CPU processes, gloo), through the CLI: with fewer
batches than ranks (4 or 3 windows make one batch of 4) the ranks write the bytes one process
writes, the rank holding no batch adding nothing to the statistics; fewer windows than ranks is
one ``error:`` line on every rank (exit 2, no traceback from any rank). The messages' spelling
is checked without torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import lowbit
from helpers.modelfree import digests
from helpers.models import tiny_llama
from helpers.streamed import write_folder
from lowbit.calibration import CalibrationConfig
from lowbit.calibration.reduce import check_distributable, check_windows
from lowbit.dist import DistError, Group

SRC_ROOT = Path(lowbit.__file__).resolve().parents[1]  # the lowbit under test, for the subprocesses
CLI = [sys.executable, "-c", "from lowbit.cli import main; main()"]
TEXT = "\n".join(f"Paragraph {i}: Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy "
                 f"disposition, seemed to unite some of the best blessings of existence." for i in range(4))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Llama folder (2 layers, byte tokenizer) and a calibration text of 4 paragraphs."""
    root = tmp_path_factory.mktemp("few")
    src = write_folder(tiny_llama(num_hidden_layers=2, hidden_size=128, intermediate_size=256), root / "src",
                       shard_bytes="200KB")
    text = root / "calib.txt"
    text.write_text(TEXT + "\n")
    return src, text


def _env() -> dict:
    """The lowbit under test, one thread per process (as torchrun gives each rank), no inherited rank."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(SRC_ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    env.pop("WORLD_SIZE", None)
    return env


def _quantize(folder, out: Path, scheme: str, samples: int, ranks: int, logs: Path | None = None,
              monitor: int = 1):
    """``lowbit quantize`` on ``folder``'s text with ``samples`` windows of 32 tokens, alone or as
    2 torchrun ranks (``logs``: each rank's stdout and stderr in its own file there; ``monitor``:
    seconds between torchrun's checks, after which a failed rank's peers are terminated)."""
    src, text = folder
    args = ["quantize", str(src), "--scheme", scheme, "--calib", str(text), "--calib-samples", str(samples),
            "--calib-seq-len", "32", "-o", str(out)]
    cmd = CLI + args
    if ranks > 1:
        redirect = ["--log-dir", str(logs), "--redirects", "3"] if logs is not None else []
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "--monitor-interval", str(monitor), *redirect, "--no-python", *cmd]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)


@pytest.mark.subprocess
@pytest.mark.parametrize("samples, scheme", [(4, "w8a8-int8"), (3, "nvfp4")])
def test_fewer_batches_than_ranks_write_what_one_process_writes(folder, tmp_path, samples, scheme):
    # w8a8-int8: static scales and SmoothQuant from maxima; nvfp4: GPTQ's Hessians passed along
    # the ranks and 20 reconstruction steps on the batch owner's gradients
    one = _quantize(folder, tmp_path / "one", scheme, samples, 1)
    assert one.returncode == 0, one.stderr[-3000:]
    two = _quantize(folder, tmp_path / "two", scheme, samples, 2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "on 2 ranks" in " ".join(two.stdout.split())
    ref = digests(tmp_path / "one")
    assert digests(tmp_path / "two") == ref and len([n for n in ref if n.endswith(".safetensors")]) == 3


@pytest.mark.subprocess
def test_fewer_windows_than_ranks_is_one_error_line_on_every_rank(folder, tmp_path):
    # both ranks refuse on their own: torchrun's check waits long enough that the slower one (on a
    # loaded machine, more than a second behind) is not terminated before it exits with its error
    r = _quantize(folder, tmp_path / "out", "w8a8-int8", 1, 2, logs=tmp_path / "logs", monitor=10)
    assert r.returncode != 0
    assert r.stderr.count("exitcode  : 2") == 2, r.stderr[-3000:]  # torchrun's summary: both ranks exited 2
    logs = sorted((tmp_path / "logs").rglob("stderr.log"))
    assert len(logs) == 2, logs
    for log in logs:
        text = log.read_text()
        errors = [line for line in text.splitlines() if line.startswith("error:")]
        assert errors == ["error: --calib-samples 1 is fewer than the 2 ranks of this job: give at least "
                          "--calib-samples 2 (one calibration window per rank), or start fewer ranks"], text
        assert "Traceback" not in text and "gloo" not in text.lower(), text
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))  # refused before any work


@dataclass(frozen=True)
class _Peer(Group):
    """Rank 0 of a 2-rank job, no process group: the other rank holds ``other`` windows."""

    other: int = 0

    def gather_objects(self, obj):
        return [obj, self.other]

    def barrier(self):
        pass  # the other rank is imagined: it reaches the same refusal


def test_the_refusals_name_the_option_as_python_and_the_cli_spell_it():
    two = _Peer(rank=0, world=2, distributed=True)
    with pytest.raises(DistError) as e:
        check_distributable(two, CalibrationConfig(num_samples=1), None)
    assert str(e.value).startswith("num_samples=1 is fewer than the 2 ranks of this job: give at least num_samples=2")
    assert e.value.cli_message().startswith("--calib-samples 1 is fewer than the 2 ranks")
    check_distributable(two, CalibrationConfig(num_samples=2), None)
    check_distributable(Group.single(), CalibrationConfig(num_samples=1), None)

    with pytest.raises(DistError) as e:  # the text made one window although 4 were asked for
        check_windows(_Peer(rank=0, world=2, distributed=True, other=0), 1, 32)
    assert e.value.cli_message() == ("the calibration data makes 1 window, fewer than the 2 ranks of this job: give a "
                                     "text long enough for 2 windows (or lower --calib-seq-len 32), or start fewer "
                                     "ranks")
    assert "(or lower seq_len=32)" in str(e.value)
    check_windows(_Peer(rank=0, world=2, distributed=True, other=1), 1, 32)  # one window per rank
    check_windows(_Peer(rank=0, world=2, distributed=True, other=0), 2, 32)  # a rank with no batch is fine
