"""How model-free quantization runs: in this process or in worker processes (same bytes either
way), the reader/writer pipeline, and the ``device`` option (checked; on CUDA bit-identical)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lowbit
import lowbit.modelfree.run as run
from lowbit.modelfree import RunOptions
from lowbit.modelfree.pool import ProcessPool
import lowbit.modelfree.worker as worker
from helpers.models import tiny_llama
from lowbit.errors import QuantizationError
from lowbit.modelfree.device import DeviceError, resolve_device

HAS_CUDA = torch.cuda.is_available()


def folder_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(path).iterdir())}


def mf(src: Path, out: Path, scheme: str, **kw) -> Path:
    kw.setdefault("progress", False)
    return lowbit.quantize_checkpoint(src, out, scheme=scheme, **kw)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("src") / "tiny"
    tiny_llama().save_pretrained(d, max_shard_size="100KB")
    assert len(list(d.glob("*.safetensors"))) >= 3
    return d


def counting_pool(started: list[int]):
    """A pool factory (RunOptions.pool) that records the worker count of each pool it starts."""
    def make(n: int) -> ProcessPool:
        started.append(n)
        return ProcessPool(n)

    return make


def test_use_pool_rules():
    assert RunOptions().pool_min_workers == 4 and RunOptions().pool_min_bytes == 4 << 30
    opts = RunOptions(pool_min_bytes=1000)
    assert run.use_pool(workers=4, n_jobs=10, job_bytes=5000, device=None) == 0  # the default: 4 GiB
    assert run.use_pool(workers=4, n_jobs=10, job_bytes=5000, device=None, opts=opts) == 4
    assert run.use_pool(workers=3, n_jobs=10, job_bytes=5000, device=None, opts=opts) == 0  # few workers: threads
    assert run.use_pool(workers=2, n_jobs=10, job_bytes=10**12, device=None, opts=opts) == 0
    assert run.use_pool(workers=16, n_jobs=3, job_bytes=5000, device=None, opts=opts) == 3  # never more than the jobs
    assert run.use_pool(workers=4, n_jobs=1, job_bytes=5000, device=None, opts=opts) == 0   # one job: in-process
    assert run.use_pool(workers=1, n_jobs=10, job_bytes=5000, device=None, opts=opts) == 0
    assert run.use_pool(workers=0, n_jobs=10, job_bytes=5000, device=None, opts=opts) == 0
    assert run.use_pool(workers=4, n_jobs=10, job_bytes=999, device=None, opts=opts) == 0   # small: start-up would dominate
    assert run.use_pool(workers=4, n_jobs=10, job_bytes=5000, device=torch.device("cuda", 0), opts=opts) == 0


@pytest.mark.subprocess
def test_worker_processes_and_in_process_write_the_same_bytes(sharded, tmp_path):
    scheme = "nvfp4-e5m3"
    started: list[int] = []
    counted = counting_pool(started)
    inproc = mf(sharded, tmp_path / "inproc", scheme, workers=2,  # small: two threads in this process
                run_options=RunOptions(pool=counted))
    assert started == []
    pool = RunOptions(pool_min_bytes=0, pool_min_workers=2, pool=counted)
    pooled = mf(sharded, tmp_path / "pooled", scheme, workers=2, run_options=pool)
    assert started == [2]
    parts = mf(sharded, tmp_path / "parts", scheme, workers=3,  # many parts, joined afterwards
               run_options=RunOptions(part_bytes=20_000, pool_min_bytes=0, pool_min_workers=2, pool=counted))
    assert started == [2, 3]
    single = mf(sharded, tmp_path / "single", scheme, workers=0)
    assert folder_bytes(inproc) == folder_bytes(pooled) == folder_bytes(parts)
    # part_bytes is part of the run's fingerprint only; the files are the same
    assert folder_bytes(single) == folder_bytes(inproc)


def test_in_process_threads_are_restored(sharded, tmp_path):
    before = torch.get_num_threads()
    seen = []

    mf(sharded, tmp_path / "out", "w4a16", workers=1,
       run_options=RunOptions(on_event=lambda e, n, t: seen.append(torch.get_num_threads())))
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == before


def test_a_bad_tensor_in_one_thread_stops_the_run(tmp_path):
    m = tiny_llama()
    with torch.no_grad():
        m.model.layers[1].mlp.down_proj.weight[3, 5] = float("nan")
    src = tmp_path / "src"
    m.save_pretrained(src, max_shard_size="100KB")
    out = tmp_path / "out"
    with pytest.raises(QuantizationError, match=r"model\.layers\.1\.mlp\.down_proj\.weight.*NaN"):
        mf(src, out, "nvfp4-e5m3", workers=3)  # small: three threads in this process
    assert not out.exists() and not any(tmp_path.glob(".out*"))


@pytest.mark.parametrize("where", ["read", "write"])
@pytest.mark.parametrize("workers", [1, 2, 64])
def test_an_error_in_the_pipeline_leaves_nothing_complete(sharded, tmp_path, monkeypatch, where, workers):
    """An I/O error mid-run (reading a tensor, or writing one after some tensors were written),
    one runner or two with their I/O inline, or runners with I/O threads (64 workers: more
    than the jobs): no output folder, no shard under a final name, no job marked
    done; the next run with the same arguments rewrites what was half written, to the same bytes."""
    import lowbit.files.regions as stwriter

    calls = []
    add = stwriter.RegionWriter.add

    def boom(self, *a):
        calls.append(1)
        if where == "read" or len(calls) > 5:
            raise OSError("disk gone")
        return add(self, *a)

    with monkeypatch.context() as m:
        m.setattr(worker._ShardRun, "load", boom) if where == "read" else m.setattr(stwriter.RegionWriter, "add", boom)
        with pytest.raises(OSError, match="disk gone"):
            mf(sharded, tmp_path / "out", "w4a16", workers=workers)
    tmp = tmp_path / ".out.lowbit-tmp"
    assert not (tmp_path / "out").exists()
    assert not list(tmp.glob("*.safetensors")) and not list(tmp.glob(".modelfree/*.done.json"))
    assert list(tmp.glob("*.safetensors.partial"))  # kept for the next run, never under a final name
    again = mf(sharded, tmp_path / "out", "w4a16")
    assert folder_bytes(again) == folder_bytes(mf(sharded, tmp_path / "fresh", "w4a16"))
    assert not tmp.exists()


def test_device_option_is_checked(sharded, tmp_path):
    assert resolve_device(None) is None and resolve_device("cpu") is None
    with pytest.raises(DeviceError, match="not a torch device"):
        resolve_device("gpu0")
    with pytest.raises(DeviceError, match="'cpu' or 'cuda"):
        resolve_device("meta")
    if not HAS_CUDA:
        with pytest.raises(DeviceError, match="CUDA is not available"):
            mf(sharded, tmp_path / "out", "w4a16", device="cuda")
        assert not (tmp_path / "out").exists()
    else:
        with pytest.raises(DeviceError, match="CUDA device"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")
    cpu = mf(sharded, tmp_path / "cpu", "w4a16", device="cpu")
    assert folder_bytes(cpu) == folder_bytes(mf(sharded, tmp_path / "default", "w4a16"))


def test_cli_device_needs_model_free(tmp_path):
    from typer.testing import CliRunner

    from lowbit.cli import app

    r = CliRunner().invoke(app, ["quantize", str(tmp_path), "--scheme", "w4a16", "--device", "cuda", "--in-memory"])
    assert r.exit_code != 0
    assert "--device applies to model-free and streamed" in (r.output + str(r.exception))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme", ["nvfp4-e5m3", "nvfp4a16", "w4a16", "w8a8-fp8-dynamic", "mxfp4", "mxfp8",
                                    "w8a16"])
def test_cuda_output_is_bit_identical_to_the_cpu(sharded, tmp_path, scheme):
    cpu = mf(sharded, tmp_path / "cpu", scheme)
    gpu = mf(sharded, tmp_path / "gpu", scheme, device="cuda")
    assert folder_bytes(gpu) == folder_bytes(cpu)


@pytest.mark.parametrize("scheme", ["nvfp4-e5m3", "nvfp4a16", "w4a16", "w8a8-fp8-dynamic", "mxfp4"])
def test_row_bands_equal_the_whole_tensor(scheme):
    from lowbit.modelfree.bands import quantize_rows
    from lowbit.quant import global_scale_from_amax, quantize

    from lowbit.schemes import get_scheme

    spec = get_scheme(scheme).weights
    w = (torch.randn(37, 256, generator=torch.Generator().manual_seed(4)) * 0.05).to(torch.bfloat16)
    w[5] = 0.0
    gs = global_scale_from_amax(w.float().abs().amax(), spec) if spec.global_scale else None
    whole = quantize(w, spec, global_scale=gs, name="w")
    for band in (256, 1000, 256 * 36):  # one row, ragged bands, one band short of the tensor
        assert quantize_rows(w, spec, gs, "w", band).equal(whole)


@pytest.mark.parametrize("workers,io_threads", [(0, False), (1, False), (64, True)])
def test_slow_writes_do_not_see_reused_code_buffers(sharded, tmp_path, monkeypatch, workers, io_threads):
    """Codes buffers are reused by every other quantized tensor of a job: with writes slowed
    down (with I/O threads, each one still running while the next tensor is quantized) the files
    are unchanged. Runners that take every worker core do their I/O inline; with cores to spare
    (more workers than jobs) they get I/O threads."""
    import time

    import lowbit.files.regions as stwriter

    scheme = "w8a8-int8-dynamic"
    ref = mf(sharded, tmp_path / "ref", scheme, workers=0)
    add = stwriter.RegionWriter.add
    init = worker.JobIO.__init__
    seen = []

    def slow_add(self, name, t):
        time.sleep(0.01)
        add(self, name, t)

    def spy(self, threads=True):
        seen.append(threads)
        init(self, threads)

    monkeypatch.setattr(stwriter.RegionWriter, "add", slow_add)
    monkeypatch.setattr(worker.JobIO, "__init__", spy)
    assert folder_bytes(mf(sharded, tmp_path / "slow", scheme, workers=workers)) == folder_bytes(ref)
    assert seen and set(seen) == {io_threads}
