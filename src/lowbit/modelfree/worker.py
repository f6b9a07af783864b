"""Quantize one source shard (or one part of it) into its output; runs in a worker process (or
in-process).

A job carries everything it needs (tensor locations, the scheme, the format, the byte range of
the output shard it fills) and returns metadata only. Tensors are read one at a time, large
weights are quantized in row bands (lowbit.modelfree.bands), and written straight to their
planned offsets in the output shard, which exists under a temporary name until every job of it
is done; a job's done marker is written after its last byte, so a killed run never counts half
a job (lowbit.modelfree.markers).
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from lowbit.errors import LowbitError
from lowbit.fusion import shared_amax
from lowbit.kernels.select import Selection, adopt
from lowbit.moe.slices import expert_part
from lowbit.modelfree.bands import BAND_ELEMS, DEVICE_BAND_ELEMS, quantize_rows
from lowbit.modelfree.fp8 import dequantize_fp8_block
from lowbit.modelfree.mxfp4_source import dequantize_expert
from lowbit.modelfree.markers import part_name, partial_path, write_marker
from lowbit.modelfree.plan_types import Item, Kind, Source
from lowbit.modelfree.outshape import Entry
from lowbit.files.regions import RegionWriter
from lowbit.files.tensors import TensorReader
from lowbit.quant import global_scale_from_amax
from lowbit.schemes import Scheme

CODE_BUFFERS = 2  # codes buffers a job uses in turn (one is being written while another is filled)
HELD_WRITES = CODE_BUFFERS  # queued writes of tensors in memory (bounds a job's memory; raw copies do not count)

Report = Callable[[tuple[str, str, int]], None]
_REPORT: Report | None = None


@dataclass(frozen=True)
class ShardJob:
    """One shard, or one part of a shard (a contiguous run of its items; parts are cut at fixed
    source sizes, so the same source always gives the same parts, whatever ``workers`` is)."""

    src_root: str
    shard: str            # the source shard (file name in src_root)
    out_name: str         # the output shard it becomes (the format's weight file name)
    out_dir: str
    fingerprint: str
    items: tuple[Item, ...]
    scheme: Scheme | None  # the run's one scheme (an item's own, Item.scheme, comes first)
    checkpoint_format: str
    model_dtype: torch.dtype
    fp8_block: tuple[int, int] | None
    start: int            # file offset of the job's first tensor in the output shard
    entries: tuple[Entry, ...]  # the tensors it writes there, in order
    part: int = 0
    n_parts: int = 1
    device: str | None = None  # quantize there (tensors moved one at a time); None: the CPU
    reopen_bytes: int | None = None  # RunOptions.reopen_bytes (None: lowbit.files.tensors.REOPEN_BYTES)

    @property
    def source_bytes(self) -> int:
        return sum(it.src.nbytes for it in self.items)

    @property
    def name(self) -> str:
        """The job's name (its progress bar and done marker)."""
        return part_name(self.out_name, self.part, self.n_parts)


def init_worker(queue: Any = None, threads: int = 1, kernels: Selection | None = None) -> None:
    """Process initializer: one compute thread per worker, progress events to ``queue``, the
    parent's kernel setting (``kernels``: lowbit.kernels.select.current() there)."""
    global _REPORT
    torch.set_num_threads(threads)
    if kernels is not None:
        adopt(kernels)
    _REPORT = None if queue is None else queue.put


def warm_up() -> None:
    """A no-op task: submitting one per worker starts every process (and its imports) at once."""
    from lowbit.formats import get_layout  # what run_job imports first (torch and lowbit.quant already are)

    get_layout("lowbit")


class JobCancelled(Exception):
    """A job stopped because another job of the same run failed (never the error reported)."""


class _Inline:
    """An executor that runs each task at once, in the calling thread (its future is done)."""

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        f: Future = Future()
        try:
            f.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - delivered through the future, as a thread's would be
            f.set_exception(e)
        return f

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        return None


class JobIO:
    """A job runner's I/O (reader, writer, copier) and its codes buffers, kept from one job to the
    next (threads are started and buffer pages touched once per runner, not once per job).
    ``threads``: each kind of I/O runs on a thread of its own, beside the quantizing (for a
    runner with a core to spare: one job on several cores, or a device doing the arithmetic);
    else it runs in the runner's thread, in order: when the runners already take every core,
    extra threads only compete for them (measured in bench/modelfree/RESULTS-modelfree.md, section 7).
    ``close`` waits for the threads."""

    def __init__(self, threads: bool = True) -> None:
        if threads:
            self.read = ThreadPoolExecutor(1, thread_name_prefix="lowbit-read")
            self.write = ThreadPoolExecutor(1, thread_name_prefix="lowbit-write")
            # tensors kept as they are are copied file to file by a thread of their own, so a large
            # embedding copy does not hold the quantizing up (bench/modelfree/RESULTS-modelfree.md, section 7)
            self.copy = ThreadPoolExecutor(1, thread_name_prefix="lowbit-copy")
        else:
            self.read = self.write = self.copy = _Inline()
        self.buffers: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8)] * CODE_BUFFERS

    def close(self) -> None:
        for ex in (self.read, self.write, self.copy):
            ex.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "JobIO":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _ShardRun:
    """Quantizes one job. With I/O threads (JobIO) it is a pipeline: a writer thread writes the
    previous tensor and a copy thread copies the tensors kept as they are while this thread
    quantizes (the kernels and file I/O release the GIL), and FP8 sources are read and
    dequantized ahead on a reader thread; without, the same steps run here in order. Every
    tensor goes to its planned offset, so the output bytes are the same either way."""

    def __init__(self, job: ShardJob, report: Report | None, cancel: threading.Event | None = None,
                 io: JobIO | None = None, on_event: Callable[[str, str, str], None] | None = None) -> None:
        from lowbit.formats import get_layout

        self.on_event = on_event  # lowbit.modelfree.options.RunOptions.on_event
        self.job = job
        self.cancel = cancel
        self.report = report or (lambda e: None)
        self.reader = TensorReader(Path(job.src_root), job.reopen_bytes)
        self.layout = get_layout(job.checkpoint_format)
        self.amax_cache: dict[str, torch.Tensor] = {}
        self.device = None if job.device is None else torch.device(job.device)
        self.band = BAND_ELEMS if self.device is None else DEVICE_BAND_ELEMS
        self.own_io = io is None
        # a job on its own (a worker process: one core) does its I/O inline; on a device, the CPU
        # thread is free to write while the device computes
        self.io = JobIO(threads=self.device is not None) if io is None else io
        self.io_read, self.io_write, self.io_copy = self.io.read, self.io.write, self.io.copy
        # the codes buffers (self.io.buffers), used in turn by successive quantized tensors: one is
        # written while the next tensor is quantized into the other (after the write of what it
        # held last), so their pages are allocated once, not once per tensor
        self.buffers = self.io.buffers
        self.buffer_writes: list[Future | None] = [None] * len(self.buffers)
        self.turn = 0
        self.pending: list[Future] = []  # every read and write this job queued

    def load(self, src: Source) -> torch.Tensor:
        """The source tensor in float (an FP8 one read ahead runs this on the reader, io.read)."""
        if src.mx_scales is not None:  # gpt-oss MXFP4 experts: only this expert's blocks are read
            e = src.part.expert
            t = dequantize_expert(self.reader.get(src.info)[e], self.reader.get(src.mx_scales)[e],
                                  self.job.model_dtype)
            return expert_part(t[None], 0, src.part.proj, src.part.layout)
        t = self.reader.get(src.info)
        if src.scale_inv is not None:
            t = dequantize_fp8_block(t, self.reader.get(src.scale_inv), self.job.fp8_block, self.job.model_dtype)
        if src.part is not None:  # one expert's projection of a fused tensor (a copy of its pages only)
            t = expert_part(t, src.part.expert, src.part.proj, src.part.layout)
        return t

    def load_now(self, src: Source) -> torch.Tensor:
        f = self.io_read.submit(self.load, src)
        self.pending.append(f)
        return f.result()

    def amax(self, src: Source, loaded: torch.Tensor | None = None) -> torch.Tensor:
        key = src.key
        if key not in self.amax_cache:
            t = loaded if loaded is not None else self.to_device(self.load_now(src))
            self.amax_cache[key] = shared_amax([t])
        return self.amax_cache[key]

    def scratch(self, n: int) -> torch.Tensor:
        """This tensor's codes buffer (see __init__), at least n bytes."""
        last = self.buffer_writes[self.turn]
        if last is not None:
            last.result()  # what it held is on disk
        if self.buffers[self.turn].numel() < n:
            self.buffers[self.turn] = torch.empty(n, dtype=torch.uint8)
        return self.buffers[self.turn]

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.device is None else t.to(self.device)

    def quantized_tensors(self, item: Item, w: torch.Tensor) -> dict[str, torch.Tensor]:
        scheme = item.scheme if item.scheme is not None else self.job.scheme
        w = self.to_device(w)
        gs = None
        if scheme.weights.global_scale:
            group = item.group or (item.src,)
            a = torch.stack([self.amax(s, w if s == item.src else None) for s in group]).amax().reshape(1)
            gs = global_scale_from_amax(a, scheme.weights)
        qt = quantize_rows(w, scheme.weights, gs, item.src.key, self.band,
                           pack=self.layout.nibble_packed(scheme, w.shape[-1]),
                           scratch=self.scratch if self.device is None else None)
        out = self.layout.linear_tensors(item.name, qt, scheme, dtype=w.dtype)
        if self.device is not None:
            out = {k: v.cpu() for k, v in out.items()}
        return out

    def run(self) -> dict[str, Any]:
        job = self.job
        self.report(("start", job.name, job.source_bytes))
        written = [it for it in job.items if it.kind is not Kind.DROP]
        writer = None
        if written:
            writer = RegionWriter(partial_path(job.out_dir, job.out_name), job.start, job.entries)
        loads = [it for it in job.items if it.kind is Kind.QUANTIZE or
                 (it.kind is Kind.COPY and (it.src.scale_inv or it.src.part))]
        ahead: dict[int, Future] = {}  # id(item) -> its FP8 tensor being read and dequantized
        writes: deque[Future] = deque()  # writes not yet checked, oldest first
        held: deque[Future] = deque()  # writes of tensors held in memory (HELD_WRITES at most)

        def prefetch(k: int) -> None:
            """Start reading tensor k if it is an FP8 source: it is read and dequantized on the
            reader (io.read). A plain one is a view of the shard's memory map, taken when used:
            there is nothing to overlap but page faults, which a hand-off between threads costs
            more than it saves (bench/modelfree/RESULTS-modelfree.md, section 6)."""
            if k < len(loads) and loads[k].src.scale_inv is not None and id(loads[k]) not in ahead:
                ahead[id(loads[k])] = self.io_read.submit(self.load, loads[k].src)
                self.pending.append(ahead[id(loads[k])])

        def write(fn: Callable[..., None], *args: Any, holds: bool = True) -> Future:
            """Queue a write on the writer (io.write: a thread, or inline; each tensor goes to its
            own offset); ``holds``: it keeps tensors alive until done, so at most HELD_WRITES such
            are queued. Raw copies hold nothing and go to the copier (io.copy): with I/O threads,
            quantizing and writing go on while a large embedding is copied."""
            while writes and writes[0].done():
                writes.popleft().result()  # a failed write stops the job here
            f = (self.io_write if holds else self.io_copy).submit(fn, *args)
            writes.append(f)
            self.pending.append(f)
            if holds:
                held.append(f)
                while len(held) > HELD_WRITES:
                    held.popleft().result()
            return f

        n_quantized = 0
        n_loaded = 0
        try:
            prefetch(0)
            for it in job.items:
                if self.cancel is not None and self.cancel.is_set():
                    raise JobCancelled(f"{job.name}: stopped because another unit of work failed")
                if it.kind is Kind.COPY and it.src.scale_inv is None and it.src.part is None:  # bytes copied as stored
                    i = it.src.info
                    write(writer.add_raw, it.name, i.dtype, i.shape, Path(job.src_root) / i.shard,
                          i.data_start + i.begin, i.nbytes, holds=False)
                elif it.kind is not Kind.DROP:
                    reading = ahead.pop(id(it), None)
                    w = self.load(it.src) if reading is None else reading.result()
                    n_loaded += 1
                    prefetch(n_loaded)  # an FP8 next tensor is read while this one is quantized
                    if it.kind is Kind.COPY:  # FP8 kept in float (dequantized), or an expert's part
                        write(writer.add, it.name, w)
                    else:
                        tensors = self.quantized_tensors(it, w)
                        self.buffer_writes[self.turn] = write(_add_all, writer, tensors)
                        self.turn = (self.turn + 1) % len(self.buffers)
                        n_quantized += 1
                    del w
                self.report(("advance", job.name, it.src.nbytes))
                if self.on_event is not None:
                    self.on_event("tensor", job.name, it.name)
            for f in writes:
                f.result()
            if writer is not None:
                writer.finish()
        except BaseException as e:
            self._stop_io()
            if writer is not None:
                writer.close()
            if isinstance(e, LowbitError) and job.shard not in str(e):
                raise type(e)(f"{Path(job.src_root) / job.shard}: {e}") from None
            raise
        finally:
            self._stop_io()
            self.reader.close()
        result = {"shard": job.name, "fingerprint": job.fingerprint, "quantized": n_quantized,
                  "source_bytes": job.source_bytes}
        write_marker(job.out_dir, job.name, result)
        self.report(("done", job.name, 0))
        if self.on_event is not None:
            self.on_event("shard", job.name, "")
        return result

    def _stop_io(self) -> None:
        """Drop this job's queued I/O and wait for what already runs, so no thread touches the
        files after (the threads themselves stop here only if the job owns them)."""
        for f in self.pending:
            f.cancel()
        wait(self.pending)
        self.pending.clear()
        if self.own_io:
            self.io.close()


def _add_all(writer: RegionWriter, tensors: dict[str, torch.Tensor]) -> None:
    for k, v in tensors.items():
        writer.add(k, v)


def run_job(job: ShardJob, report: Report | None = None, cancel: threading.Event | None = None,
            io: JobIO | None = None, on_event: Callable[[str, str, str], None] | None = None) -> dict[str, Any]:
    """Quantize one shard; returns its metadata (never tensors). ``cancel``: set by another
    thread to stop this job (JobCancelled) before its next tensor. ``io``: I/O threads and
    buffers to use (a runner of several jobs keeps one), else the job starts its own.
    ``on_event``: RunOptions.on_event."""
    return _ShardRun(job, report or _REPORT, cancel, io, on_event).run()
