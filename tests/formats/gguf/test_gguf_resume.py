"""A killed calibrated GGUF run resumes (``lowbit.gguf_spill``): the same command starts at the
layer after its last checkpoint and writes the uninterrupted run's file, byte for byte; a run
that finishes, or fails before any checkpoint, leaves nothing beside the output."""

from __future__ import annotations

import hashlib
import warnings

import pytest
import torch

from helpers.gguf_folders import save_gguf_folder, skip_without_converter
from helpers.models import tiny_llama

skip_without_converter()

from lowbit.calibration import CalibrationConfig  # noqa: E402
from lowbit.gguf_quantize import quantize_gguf  # noqa: E402
from lowbit.gguf_layers import LayerLoop  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    model = tiny_llama(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    return save_gguf_folder(model, tmp_path_factory.mktemp("llama"))


def _ids() -> torch.Tensor:
    return torch.randint(3, 300, (4, 32), generator=torch.Generator().manual_seed(5))


def _run(folder, out, iters: int):
    cfg = CalibrationConfig(num_samples=4, seq_len=32, batch_size=2, reconstruct_iters=iters)
    return quantize_gguf(folder, out, "q2_k", calibration=_ids(), config=cfg, progress=False, overwrite=True)


def _sha(p) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _killed_at(monkeypatch, layer: int) -> list[str]:
    """Make ``LayerLoop._measure`` fail at decoder layer ``layer``; the layers it measured."""
    real, seen = LayerLoop._measure, []

    def measure(self, root, linears, inputs):
        name = linears[0].rsplit(".", 2)[0] if linears else ""
        if name.endswith(f"layers.{layer}"):
            raise KeyboardInterrupt
        seen.append(name)
        return real(self, root, linears, inputs)

    monkeypatch.setattr(LayerLoop, "_measure", measure)
    return seen


def _killed_run(folder, out, iters: int, monkeypatch):
    """Run the command and kill it at decoder layer 2 (after two checkpointed layers): it stops
    warning that the same command resumes; the folder it keeps."""
    with monkeypatch.context() as m:
        _killed_at(m, 2)
        with pytest.raises(KeyboardInterrupt), pytest.warns(UserWarning, match="resumes"):
            _run(folder, out, iters)
    (kept,) = out.parent.glob(f".{out.name}.rows-*")
    return kept


@pytest.mark.parametrize("iters", [0, 5])
def test_a_killed_run_resumes_to_the_same_file(folder, tmp_path, monkeypatch, iters):
    """With reconstruction every layer ends with GPTQ's queue empty; without it, when the queue is
    rounded at a layer's end (here every layer: a queue of one byte)."""
    import lowbit.gguf_streamed

    if iters == 0:
        monkeypatch.setattr(lowbit.gguf_streamed, "QUEUE_BYTES", 1)
    ref = _run(folder, tmp_path / "ref.gguf", iters).path
    out = tmp_path / "m.gguf"
    kept = _killed_run(folder, out, iters, monkeypatch)
    assert not out.exists()
    assert len(list(tmp_path.glob(".m.gguf.rows-*"))) == 1 and (kept / "state.json").is_file()
    with monkeypatch.context() as m:
        seen = _killed_at(m, 99)  # never fails: records what the resumed run measures
        report = _run(folder, out, iters)
    assert not any(s.endswith(("layers.0", "layers.1")) for s in seen), seen  # started at layer 2
    assert _sha(report.path) == _sha(ref)
    assert len(report.reconstructed) == (4 if iters else 0)  # the resumed layers' summaries kept
    assert list(tmp_path.glob(".m.gguf.rows-*")) == []


def test_another_run_does_not_take_a_killed_runs_layers(folder, tmp_path, monkeypatch):
    out = tmp_path / "m.gguf"
    _killed_run(folder, out, 5, monkeypatch)
    with monkeypatch.context() as m:
        seen = _killed_at(m, 99)
        _run(folder, out, 3)  # other options: other bytes, its own folder, from the first layer
    assert any(s.endswith("layers.0") for s in seen)
    assert len(list(tmp_path.glob(".m.gguf.rows-*"))) == 1  # the killed run's stays until its command reruns


def test_a_failure_before_any_checkpoint_leaves_nothing(folder, tmp_path, monkeypatch):
    with monkeypatch.context() as m:
        _killed_at(m, 0)
        with pytest.raises(KeyboardInterrupt):
            _run(folder, tmp_path / "m.gguf", 5)
    assert list(tmp_path.iterdir()) == []


def test_an_unreadable_checkpoint_is_one_error_naming_the_folder(folder, tmp_path, monkeypatch):
    from lowbit.errors import QuantizationError

    out = tmp_path / "m.gguf"
    kept = _killed_run(folder, out, 5, monkeypatch)
    (kept / "state.safetensors").write_bytes(b"not a safetensors file")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*resumes")  # no "the same command resumes" beside the error
        with pytest.raises(QuantizationError, match=r"cannot be read.*delete .*\.m\.gguf\.rows-") as e:
            _run(folder, out, 5)
    assert "\n" not in str(e.value)
    assert not out.exists() and kept.is_dir()  # nothing written; the folder left for the user to delete


def test_a_second_run_of_the_same_command_while_the_first_is_alive_is_one_error(folder, tmp_path, monkeypatch):
    """The resume folder is locked by its run (``gguf_spill.LOCK``: an exclusive flock, the pid in
    it): the same command started while another process holds it is refused in one line and takes
    nothing; once that process is gone (killed: the system drops its lock) the next run resumes."""
    import subprocess
    import sys

    from lowbit.errors import QuantizationError
    from lowbit.gguf_spill import LOCK

    ref = _run(folder, tmp_path / "ref.gguf", 3).path
    out = tmp_path / "m.gguf"
    kept = _killed_run(folder, out, 3, monkeypatch)
    hold = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX); os.ftruncate(fd, 0); os.write(fd, str(os.getpid()).encode()); "
            "print('held', flush=True); time.sleep(60)")
    alive = subprocess.Popen([sys.executable, "-c", hold, str(kept / LOCK)], stdout=subprocess.PIPE, text=True)
    try:
        assert alive.stdout.readline().strip() == "held"
        before = sorted(p.name for p in kept.iterdir())
        with pytest.raises(QuantizationError, match=rf"another run with the same options \(pid {alive.pid}\)") as e:
            _run(folder, out, 3)
        assert "\n" not in str(e.value) and LOCK in str(e.value)
        assert sorted(p.name for p in kept.iterdir()) == before and not out.exists()
    finally:
        alive.kill()
        alive.wait()
    # the holder is gone (as after a kill -9): the system dropped its lock, the run resumes
    with monkeypatch.context() as m:
        seen = _killed_at(m, 99)
        report = _run(folder, out, 3)
    assert not any(s.endswith(("layers.0", "layers.1")) for s in seen), seen
    assert _sha(report.path) == _sha(ref) and list(tmp_path.glob(".m.gguf.rows-*")) == []
