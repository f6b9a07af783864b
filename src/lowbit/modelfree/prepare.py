"""What a model-free run has left to do, found by one process (rank 0 of a distributed job) in
the temporary output folder and handed to every rank: the output shard files, created at their
final size (or kept from a killed run of the same arguments), and the units of work not yet done."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from lowbit.files.atomic import write_text_atomic
from lowbit.files.regions import create_shard_file, shard_file_matches
from lowbit.modelfree.markers import MARKER_DIR, marker_path, part_name, partial_path, read_marker
from lowbit.modelfree.outshape import OutputShapes, ShardFile
from lowbit.modelfree.plan_types import Item, Kind, Plan
from lowbit.modelfree.source import Checkpoint
from lowbit.modelfree.worker import ShardJob

RUN_FILE = "run.json"


@dataclass(frozen=True)
class Work:
    """The units of work of a run, the same on every rank (picklable: rank 0 broadcasts it).

    jobs: the units still to run, largest first (ties in source order).
    out_names: source shard -> its output shard, for the shards that write tensors.
    unfinished: output shard -> its number of parts, for the shards not yet finalized.
    done_bytes / skipped_bytes / total: source bytes done by an earlier run, writing nothing
    (dropped shards), and in all."""

    jobs: tuple[ShardJob, ...]
    out_names: dict[str, str]
    unfinished: dict[str, int]
    done_bytes: int
    skipped_bytes: int
    total: int


def previous_fingerprint(tmp: Path) -> str | None:
    try:
        return json.loads((tmp / MARKER_DIR / RUN_FILE).read_text()).get("fingerprint")
    except (FileNotFoundError, json.JSONDecodeError, AttributeError):
        return None


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


def shard_jobs(out_dir: Path, out_name: str, items: list[Item], shapes: OutputShapes, fp: str, part_bytes: int,
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


def prepare_work(writer: Any, ckpt: Checkpoint, plan: Plan, job: Any, fp: str) -> Work:
    """Record the run's fingerprint in ``writer.tmp``, remove the files of other runs, create the
    output shard files (keeping those a killed run of the same fingerprint left), and list the
    units of work still to do. Only one process does this, before any unit runs. ``job``: the
    run (``lowbit.modelfree.run.ModelFreeJob``: its source, checkpoint format and layout, device
    and ``RunOptions``); ``plan.scheme`` is the run's one scheme (None for a mixed plan, whose
    items carry theirs). The fingerprint is written atomically: a refused write leaves no half of
    it and names it (lowbit.files.atomic)."""
    scheme, checkpoint_format, layout, src_p, dev = plan.scheme, job.checkpoint_format.value, job.layout, job.src, job.device
    part_bytes, reopen_bytes = job.opts.part_bytes, job.opts.reopen_bytes
    state = writer.tmp / MARKER_DIR
    state.mkdir(exist_ok=True)
    write_text_atomic(state / RUN_FILE, json.dumps({"fingerprint": fp}))

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
        jobs_of, done = shard_jobs(writer.tmp, out_name, items, shapes, fp, part_bytes, dict(
            src_root=str(src_p), shard=shard, out_name=out_name, out_dir=str(writer.tmp), fingerprint=fp,
            scheme=scheme, checkpoint_format=checkpoint_format, model_dtype=plan.dtype, fp8_block=plan.fp8_block,
            device=None if dev is None else str(dev), reopen_bytes=reopen_bytes))
        unfinished[out_name] = len(jobs_of) + len(done)
        jobs += jobs_of
        done_bytes += sum(j.source_bytes for j in done)
    jobs.sort(key=lambda j: -j.source_bytes)  # largest first balances the workers (and the ranks)
    total = sum(it.src.nbytes for items in plan.shards.values() for it in items)
    return Work(tuple(jobs), out_names, unfinished, done_bytes, skipped_bytes, total)
