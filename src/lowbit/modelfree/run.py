"""``quantize_checkpoint``: model-free quantization of a safetensors folder.

    lowbit.quantize_checkpoint("./model", "./out", scheme="nvfp4-e5m3", format="lowbit", workers=2)

No model class is built and nothing runs forward. Every check that needs no tensor data
(scheme, format, shards, index, shapes against the block size, FP8 scales) runs before anything
is written. Every output shard's header is known before any weight is quantized
(lowbit.modelfree.outshape): the shard file is created at its final size with that header, and
its units of work (the shard, or parts of RunOptions.part_bytes of source) write their tensors straight to
their offsets, in parallel, with nothing joined afterwards. With at least two units,
RunOptions.pool_min_workers workers and .pool_min_bytes of source, worker processes (spawn, one thread each,
started before the plan is made: RunOptions.pool, by default lowbit.modelfree.pool.ProcessPool)
quantize units in parallel and return metadata only; otherwise
everything runs in this process, ``workers`` units at once in threads (no start-up cost), and
with ``device`` on that device. A unit's reading and writing overlap its quantizing on I/O
threads where a core is free for them (lowbit.modelfree.worker.JobIO), and the files are
byte-identical whichever way they were made. The output is
built in ``.<out>.lowbit-tmp`` (lowbit.formats' CheckpointWriter) and renamed into place at
the end. A run killed part-way keeps its shard files (``<shard>.partial``) and the done markers
of its finished units there (a marker is written after a unit's last byte; the run's arguments
and source files are fingerprinted); the same command again redoes only the other units and
writes output byte-identical to an uninterrupted run. A data error (NaN, bad tensor) removes the
temporary folder, so no half-written output is ever left.

Output shards follow the source's, in order: one per source shard that has tensors to write,
named by the format's weights stem (lowbit.files.folder.WeightFiles):
``lowbit-model-0000i-of-0000n.safetensors`` (or ``lowbit-model.safetensors`` for a single-file
source) for the ``lowbit`` format, which stock loaders must not find; ``model-...`` for the others.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue as queue_mod
import shutil
import threading
from pathlib import Path
from typing import Any, Iterable

import torch
from lowbit.errors import FormatError, LowbitError, SchemeError
from lowbit.files.outguard import check_not_source
from lowbit.files.outlock import output_lock
from lowbit.files.writer import write_failure
from lowbit.modelfree.plan import Item, Kind, Plan, make_plan
from lowbit.modelfree.progress import ShardProgress
from lowbit.modelfree.source import Checkpoint
from lowbit.modelfree.outshape import OutputShapes, ShardFile
from lowbit.files.regions import create_shard_file, shard_file_matches
from lowbit.modelfree.device import resolve_device
from lowbit.modelfree.markers import MARKER_DIR, finalize_shard, marker_path, part_name, partial_path, read_marker
from lowbit.modelfree.options import Event, RunOptions
from lowbit.modelfree.pool import ProcessPool
from lowbit.modelfree.worker import JobCancelled, JobIO, ShardJob, run_job
from lowbit.schemes import Scheme, get_scheme
from lowbit.threads import one_thread

RUN_FILE = "run.json"
LAYOUT_VERSION = 4  # bump when the files written for the same inputs change (2: weight file names by format;
# 3: shard headers padded to 8 bytes, written before the data; 4: lowbit format 2, typed weight_codes)
# what to run instead of a scheme that needs calibration
CALIBRATION_ALTERNATIVES = {
    "w8a8-int8": "w8a8-int8-dynamic", "w8a8-fp8": "w8a8-fp8-dynamic", "nvfp4": "nvfp4-e5m3 or nvfp4a16",
}


def check_model_free_scheme(scheme: Scheme) -> None:
    """SchemeError for schemes whose static activation scales need calibration data."""
    if not scheme.needs_calibration:
        return
    a = scheme.input_activations
    what = ("its static input global scale comes" if a is not None and a.global_scale
            else "its static input scales come")
    alt = CALIBRATION_ALTERNATIVES.get(scheme.name, "a weight-only or dynamic-activation scheme")
    raise SchemeError(
        f"scheme {scheme.name!r} needs calibration: {what} from running the model on sample "
        f"text, and model-free quantization runs no model. Use {alt} model-free, or quantize the loaded "
        f"model with calibration data (lowbit.quantize(model, {scheme.name!r}, calibration=texts), or "
        f"`lowbit quantize MODEL --scheme {scheme.name}` without --model-free)")


def _fingerprint(ckpt: Checkpoint, scheme: Scheme, fmt: str, ignore: list[str], include_lm_head: bool,
                 part_bytes: int) -> str:
    from lowbit import __version__

    src = []
    for s in ckpt.shards + ["config.json"] + ([ckpt.index_path.name] if ckpt.sharded else []):
        st = (ckpt.root / s).stat()
        src.append([s, st.st_size, st.st_mtime_ns])
    blob = {"lowbit": __version__, "layout": LAYOUT_VERSION, "part_bytes": part_bytes, "scheme": scheme.to_dict(),
            "format": fmt,
            "ignore": ignore, "include_lm_head": include_lm_head, "source": src}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


def _previous_fingerprint(tmp: Path) -> str | None:
    try:
        return json.loads((tmp / MARKER_DIR / RUN_FILE).read_text()).get("fingerprint")
    except (FileNotFoundError, json.JSONDecodeError, AttributeError):
        return None


def _output_config(ckpt: Checkpoint, plan: Plan, layout: Any) -> dict[str, Any]:
    cfg = json.loads(json.dumps(ckpt.config))
    cfg.pop("quantization_config", None)
    for key, value in plan.config_updates.items():
        cfg[key] = value
        if isinstance(cfg.get("text_config"), dict) and key in cfg["text_config"]:
            cfg["text_config"][key] = value
    cfg["quantization_config"] = layout.quantization_config(plan.scheme, ignore=plan.ignored)
    return cfg


def split_items(items: list[Item], part_bytes: int) -> list[tuple[Item, ...]]:
    """A shard's items cut into runs of about ``part_bytes`` of source (a fixed size, so the parts
    depend on the source alone): large shards are quantized by several workers at once."""
    parts: list[list[Item]] = [[]]
    acc = 0
    for it in items:
        if parts[-1] and acc >= part_bytes:
            parts.append([])
            acc = 0
        parts[-1].append(it)
        acc += it.src.nbytes if it.kind is not Kind.DROP else 0
    return [tuple(p) for p in parts]


def use_pool(workers: int, n_jobs: int, job_bytes: int, device: torch.device | None,
             opts: RunOptions = RunOptions()) -> int:
    """How many worker processes to start: none (run in this process) for a device, one unit of
    work, fewer than opts.pool_min_workers workers, or less than opts.pool_min_bytes of source (each
    worker's start-up, importing torch, would cost more than it saves over threads); never more
    than the units of work."""
    n = min(workers, n_jobs)
    if device is not None or n <= 1 or workers < opts.pool_min_workers or job_bytes < opts.pool_min_bytes:
        return 0
    return n


def _shard_jobs(out_dir: Path, out_name: str, items: list[Item], shapes: OutputShapes, fp: str, part_bytes: int,
                common: dict[str, Any]) -> tuple[list[ShardJob], list[ShardJob]]:
    """The jobs of one output shard (its parts), as (to run, done by an earlier run). Creates the
    shard file, at its final size with its final header, unless a killed run of the same
    arguments left it; then the jobs it marked done keep what they wrote."""
    parts = split_items(items, part_bytes)
    per_item = {id(it): shapes.entries(it) for it in items}
    sf = ShardFile.of([e for it in items for e in per_item[id(it)]])
    path = partial_path(out_dir, out_name)
    if not shard_file_matches(path, sf.header, sf.size):
        for k in range(len(parts)):
            marker_path(out_dir, part_name(out_name, k, len(parts))).unlink(missing_ok=True)
        create_shard_file(path, sf.header, sf.size)
    todo, done, first = [], [], 0
    for k, part in enumerate(parts):
        entries = tuple(e for it in part for e in per_item[id(it)])
        start = sf.offsets[first] if entries else sf.size
        first += len(entries)
        job = ShardJob(items=part, start=start, entries=entries, part=k, n_parts=len(parts), **common)
        (done if read_marker(out_dir, job.name, fp) is not None else todo).append(job)
    return todo, done


def _run_in_process(jobs: list[ShardJob], workers: int, prog: ShardProgress, on_event: Event | None = None) -> None:
    """Jobs in this process: up to ``workers`` runner threads take the jobs in order (largest
    first), each keeping its I/O and buffers from one job to the next (JobIO); the kernels
    release the GIL, and each op is single-threaded (the caller's one_thread: intra-op thread
    pools spin-wait, which on a busy machine burns CPU time for nothing). The first error stops the
    other jobs at their next tensor and is raised."""
    n = min(max(1, workers), len(jobs))
    # I/O threads only where a runner has a core to spare (fewer jobs than workers) or a device
    # does the arithmetic; runners that take every core do their I/O themselves (JobIO)
    io_threads = n < max(1, workers) or any(job.device is not None for job in jobs)
    todo: queue_mod.SimpleQueue[ShardJob] = queue_mod.SimpleQueue()
    for job in jobs:
        todo.put(job)
    cancel = threading.Event()
    errors: list[BaseException] = []

    def runner() -> None:
        with JobIO(threads=io_threads) as io:
            while not cancel.is_set():
                try:
                    job = todo.get_nowait()
                except queue_mod.Empty:
                    return
                try:
                    run_job(job, prog.handle, cancel if n > 1 else None, io, on_event)
                except BaseException as e:  # noqa: BLE001 - handed to the calling thread
                    errors.append(e)
                    cancel.set()
                    return

    if n == 1:
        runner()
    else:
        threads = [threading.Thread(target=runner, name=f"lowbit-job_{k}") for k in range(n)]
        for t in threads:
            t.start()
        try:
            for t in threads:
                t.join()
        except BaseException:
            cancel.set()  # Ctrl-C here: the runners stop at their next tensor
            for t in threads:
                t.join()
            raise
    if errors:
        first = next((e for e in errors if not isinstance(e, JobCancelled)), errors[0])
        raise first


def quantize_checkpoint(src: str | os.PathLike, out: str | os.PathLike, scheme: str | Scheme = "nvfp4-e5m3",
                        format: str = "lowbit", *, workers: int = 2, ignore: Iterable[str] = (),
                        include_lm_head: bool = False, resume: bool = True, overwrite: bool = False,
                        progress: bool | None = None, device: str | torch.device | None = None,
                        run_options: RunOptions | None = None) -> Path:
    """Quantize the safetensors checkpoint folder ``src`` into ``out`` without building the model.

    scheme: a preset needing no calibration (w4a16, w8a16, nvfp4a16, w8a8-int8-dynamic,
        w8a8-fp8-dynamic, nvfp4-e5m3, mxfp4, mxfp8) or such a Scheme.
    format: "lowbit" or "compressed-tensors" (or "fake"): the layouts of ``lowbit.save``.
    workers: CPU cores to use. Worker processes quantize shards (or 128 MB parts of them) in
        parallel when there are at least two units of work, ``run_options.pool_min_workers``
        workers and ``.pool_min_bytes`` of source; else
        they run in this process, ``workers`` at once in threads (<= 1: one after another).
    device: quantize on this torch device ("cuda", "cuda:1"; default: the CPU), in this process,
        one tensor at a time; the output is bit-identical to the CPU's. DeviceError (lowbit.modelfree.device)
        if it is not available.
    ignore: more linear modules to keep in float (exact names or full-match regular expressions).
    include_lm_head: quantize the output embedding too.
    resume: continue a run that was killed, skipping its finished shards (same arguments only).
    overwrite: replace ``out`` if it exists.
    progress: progress bars on stderr (default: when stderr is a terminal).
    run_options: how the work is cut and scheduled (lowbit.modelfree.options.RunOptions; the
        output bytes do not depend on it).
    Returns the output folder. Raises SchemeError/FormatError/QuantizationError naming the option,
    file or tensor; nothing is left half-written.
    """
    from lowbit.formats import Format, get_layout

    scheme = get_scheme(scheme)
    check_model_free_scheme(scheme)
    fmt = Format.parse(format)
    layout = get_layout(fmt)
    layout.check_scheme(scheme)
    src_p, out_p = Path(src).resolve(), Path(out).resolve()
    check_not_source(src_p, out_p)
    ignore = list(ignore)
    dev = resolve_device(device)
    with output_lock(out_p):  # a second run into the same folder is refused here, before any write
        return _locked(src_p, out_p, scheme, fmt, layout, ignore, include_lm_head, resume, overwrite, progress,
                       workers, dev, run_options or RunOptions())


def _locked(src_p: Path, out_p: Path, scheme: Scheme, fmt: Any, layout: Any, ignore: list[str],
            include_lm_head: bool, resume: bool, overwrite: bool, progress: bool | None, workers: int,
            dev: torch.device | None, opts: RunOptions) -> Path:
    ckpt = Checkpoint(src_p)
    # worker processes start now, importing torch while the plan is made and finished shards found
    source_total = sum(i.nbytes for i in ckpt.tensors.values())
    units = sum(max(1, -(-sum(i.nbytes for i in infos) // opts.part_bytes)) for infos in ckpt.shard_tensors.values())
    n_pool = 0 if opts.on_event is not None else use_pool(workers, units, source_total, dev, opts)
    pool = (opts.pool or ProcessPool)(n_pool) if n_pool else None
    ok = False
    try:
        with one_thread():  # the plan's probes, the tables built on first use, the jobs run here
            out_path = _quantize(ckpt, src_p, out_p, scheme, fmt, layout, ignore, include_lm_head, resume,
                                 overwrite, progress, workers, dev, pool, opts)
        ok = True
        return out_path
    except OSError as e:
        if isinstance(e, LowbitError):
            raise
        # disk full, read-only: the finished units stay for a resumed run, and the message says so
        tmp = out_p.parent / f".{out_p.name}.lowbit-tmp"
        hint = (f"; the finished shards stay in {tmp}: run the same command again to resume, or delete that "
                f"folder") if tmp.exists() else ""
        raise write_failure(e, out_p, hint) from None
    finally:
        if pool is not None:
            pool.close(ok)


def _quantize(ckpt: Checkpoint, src_p: Path, out_p: Path, scheme: Scheme, fmt: Any, layout: Any, ignore: list[str],
              include_lm_head: bool, resume: bool, overwrite: bool, progress: bool | None, workers: int,
              dev: torch.device | None, pool: Any, opts: RunOptions) -> Path:
    from lowbit.files.writer import CheckpointWriter

    plan = make_plan(ckpt, scheme, ignore, include_lm_head)
    if not plan.quantized:
        raise FormatError(f"{src_p}: no linear weights to quantize were found (config model_type "
                          f"{ckpt.get('model_type')!r})")

    fp = _fingerprint(ckpt, scheme, fmt.value, ignore, include_lm_head, opts.part_bytes)
    tmp = out_p.parent / f".{out_p.name}.lowbit-tmp"
    same_run = resume and _previous_fingerprint(tmp) == fp
    writer = CheckpointWriter(out_p, overwrite=overwrite, resume=same_run, always_index=ckpt.sharded,
                              weights_stem=layout.weights_stem)
    state = writer.tmp / MARKER_DIR
    state.mkdir(exist_ok=True)
    (state / RUN_FILE).write_text(json.dumps({"fingerprint": fp}))

    # output shard names: source shards that write nothing (a tied duplicate head, FP8 scales) get none
    kept = [s for s in ckpt.shards if any(it.kind is not Kind.DROP for it in plan.shards[s])]
    out_names = {s: writer.files.shard(i + 1, len(kept)) if ckpt.sharded or len(kept) > 1 else writer.files.single
                 for i, s in enumerate(kept)}
    ours = {partial_path(writer.tmp, n).name for n in out_names.values()}
    for p in writer.tmp.glob("*.partial*"):
        if p.name not in ours:
            p.unlink()  # a file some other step of a killed run was writing
    shapes = OutputShapes(scheme, layout, plan.dtype)
    jobs, done_bytes, skipped_bytes, unfinished = [], 0, 0, {}
    for shard in ckpt.shards:
        items = plan.shards[shard]
        if shard not in out_names:
            skipped_bytes += sum(it.src.nbytes for it in items)
            continue
        out_name = out_names[shard]
        if read_marker(writer.tmp, out_name, fp) is not None:
            done_bytes += sum(it.src.nbytes for it in items)
            continue
        jobs_of, done = _shard_jobs(writer.tmp, out_name, items, shapes, fp, opts.part_bytes, dict(
            src_root=str(src_p), shard=shard, out_name=out_name, out_dir=str(writer.tmp), fingerprint=fp,
            scheme=scheme, fmt=fmt.value, model_dtype=plan.dtype, fp8_block=plan.fp8_block,
            device=None if dev is None else str(dev), reopen_bytes=opts.reopen_bytes))
        unfinished[out_name] = len(jobs_of) + len(done)
        jobs += jobs_of
        done_bytes += sum(j.source_bytes for j in done)
    jobs.sort(key=lambda j: -j.source_bytes)  # largest first balances the workers
    total = sum(it.src.nbytes for items in plan.shards.values() for it in items)
    try:
        with ShardProgress(progress, total, done_bytes + skipped_bytes, len(out_names)) as prog:
            if done_bytes:
                prog.log(f"resuming: {done_bytes / 1e9:.2f} of {total / 1e9:.2f} GB of source already done")
            if pool is not None and len(jobs) > 1:
                pool.run(jobs, prog)
            else:
                _run_in_process(jobs, workers, prog, opts.on_event)
        for out_name, n_parts in unfinished.items():
            finalize_shard(writer.tmp, out_name, n_parts, fp)
        for shard, out_name in out_names.items():
            meta = read_marker(writer.tmp, out_name, fp)
            if meta is None:
                raise FormatError(f"shard {out_name} (from {shard}) was not completed")  # pragma: no cover
            writer.write_shard(None, out_name)
        writer.write_json("config.json", _output_config(ckpt, plan, layout))
        writer.copy_aux_files(src_p)
        shutil.rmtree(state)
        return writer.close()
    except LowbitError:
        writer.abort()  # bad data: nothing half-written stays behind
        raise
