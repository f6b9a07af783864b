"""``quantize_model_free``: model-free quantization of a safetensors folder.

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

Under ``torchrun`` (or inside an initialised process group; lowbit.dist.Group) the ranks split the
units of work and write the same files one process would, byte for byte. Every rank checks the
arguments and makes the plan; they must agree on the arguments and the fingerprint (DistError
otherwise). Rank 0 alone takes the output lock, creates the temporary folder and the shard files
and lists the units of work (lowbit.modelfree.prepare), which it hands to every rank; each rank
runs its share (Group.balance over the units, largest first; ``workers`` applies within a rank),
writing into that folder, which must therefore be on a file system every rank sees (one machine,
or a shared file system across nodes). When all are done rank 0 finishes the shards, writes the
index and config.json and renames the folder; the others return once it has. An error on any rank
raises on every rank once each has ended its share (lowbit.modelfree.ranks); a killed rank makes
torchrun end the job, and the same command again resumes from the finished units.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

from lowbit.dist import Group
from lowbit.errors import FormatError, LowbitError, SchemeError
from lowbit.moe.naming import ignore_names
from lowbit.files.outguard import check_not_source
from lowbit.files.outlock import output_lock
from lowbit.files.refused import resumable_failure
from lowbit.modelfree.mixed import plan_recipe
from lowbit.modelfree.plan_types import Plan
from lowbit.modelfree.progress import ShardProgress
from lowbit.modelfree.source import Checkpoint
from lowbit.modelfree.device import resolve_device
from lowbit.modelfree.inprocess import run_in_process
from lowbit.modelfree.markers import MARKER_DIR, finalize_shard, read_marker
from lowbit.modelfree.options import RunOptions
from lowbit.modelfree.pool import ProcessPool
from lowbit.modelfree.prepare import Work, prepare_work, previous_fingerprint
from lowbit.modelfree.ranks import is_data_error, together
from lowbit.modelfree.worker import ShardJob
from lowbit.recipes import Recipe
from lowbit.recipes.groups import config_groups
from lowbit.recipes.plan import recipe_key, recipe_of
from lowbit.schemes import Scheme
from lowbit.threads import one_thread

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


def _fingerprint(ckpt: Checkpoint, scheme_key: Any, checkpoint_format: str, ignore: list[str], include_lm_head: bool,
                 part_bytes: int) -> str:
    from lowbit import __version__

    src = []
    for s in ckpt.shards + ["config.json"] + ([ckpt.index_path.name] if ckpt.sharded else []):
        st = (ckpt.root / s).stat()
        src.append([s, st.st_size, st.st_mtime_ns])
    blob = {"lowbit": __version__, "layout": LAYOUT_VERSION, "part_bytes": part_bytes, "scheme": scheme_key,
            "format": checkpoint_format,
            "ignore": ignore, "include_lm_head": include_lm_head, "source": src}
    return hashlib.sha256(json.dumps(blob, sort_keys=True).encode()).hexdigest()


def _output_config(ckpt: Checkpoint, plan: Plan, layout: Any) -> dict[str, Any]:
    cfg = json.loads(json.dumps(ckpt.config))
    cfg.pop("quantization_config", None)
    for key, value in plan.config_updates.items():
        cfg[key] = value
        if isinstance(cfg.get("text_config"), dict) and key in cfg["text_config"]:
            cfg["text_config"][key] = value
    cfg["quantization_config"] = layout.quantization_config_groups(config_groups(plan.schemes), ignore=ignore_names(ckpt.get("model_type"), plan.ignored, from_checkpoint=True))
    return cfg


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


def _run_arguments(src_p: Path, out_p: Path, recipe: Recipe, checkpoint_format: Any, ignore: list[str], include_lm_head: bool,
                   resume: bool, overwrite: bool, dev: torch.device | None, opts: RunOptions) -> dict[str, Any]:
    """What every rank of a job must have been given alike (``workers``, ``progress`` may differ);
    the recipe as ``recipe_key`` (one scheme: its ``to_dict()``)."""
    return {"source": str(src_p), "output": str(out_p), "scheme": recipe_key(recipe), "format": checkpoint_format.value,
            "ignore": ignore, "include_lm_head": include_lm_head, "resume": resume, "overwrite": overwrite,
            "device": None if dev is None else dev.type, "part_bytes": opts.part_bytes}


def quantize_model_free(src: str | os.PathLike, out: str | os.PathLike,
                        scheme: "str | Scheme | Recipe | dict" = "nvfp4-e5m3",
                        format: str = "lowbit", *, workers: int = 2, ignore: Iterable[str] = (),
                        include_lm_head: bool = False, resume: bool = True, overwrite: bool = False,
                        progress: bool | None = None, device: str | torch.device | None = None,
                        run_options: RunOptions | None = None, group: Group | None = None) -> Path:
    """Quantize the safetensors checkpoint folder ``src`` into ``out`` without building the model.

    scheme: a preset needing no calibration (w4a16, w8a16, nvfp4a16, w8a8-int8-dynamic,
        w8a8-fp8-dynamic, nvfp4-e5m3, mxfp4, mxfp8) or such a Scheme, or a recipe of them
        (anything ``lowbit.recipes.Recipe.of`` takes): resolved on the linears the plan
        quantizes by the rules of ``lowbit.quantize`` (lowbit.modelfree.mixed), each tensor
        quantized with its scheme, and the config given a group per scheme. Every scheme the
        recipe names must need no calibration (check_model_free_scheme).
    format: "lowbit" or "compressed-tensors" (or "fake"): the layouts of ``lowbit.save``.
    workers: CPU cores to use. Worker processes quantize shards (or 128 MB parts of them) in
        parallel when there are at least two units of work, ``run_options.pool_min_workers``
        workers and ``.pool_min_bytes`` of source; else
        they run in this process, ``workers`` at once in threads (<= 1: one after another).
    device: quantize on this torch device ("cuda", "cuda:1"; default: the CPU), in this process,
        one tensor at a time; the output is bit-identical to the CPU's. DeviceError (lowbit.modelfree.device)
        if it is not available. Under torchrun "cuda" is each rank's own GPU (LOCAL_RANK).
    ignore: more linear modules to keep in float (exact names or full-match regular expressions).
    include_lm_head: quantize the output embedding too.
    resume: continue a run that was killed, skipping its finished shards (same arguments only).
    overwrite: replace ``out`` if it exists.
    progress: progress bars on stderr (default: when stderr is a terminal); rank 0's only.
    run_options: how the work is cut and scheduled (lowbit.modelfree.options.RunOptions; the
        output bytes do not depend on it).
    group: the ranks to split the work over (default ``Group.join``: the initialised default
        process group, or a new one under torchrun, else this process alone). Every rank calls
        this function with the same arguments; each returns the output folder once it is complete.
    Returns the output folder. Raises SchemeError/FormatError/QuantizationError naming the option,
    file or tensor (DistError when ranks disagree or another rank failed); nothing is left half-written.
    """
    from lowbit.formats import Format, get_layout

    dev = resolve_device(device)
    if group is None:
        group = Group.join(dev)
        dev = resolve_device(device)  # "cuda" is now this rank's GPU (Group.join set LOCAL_RANK's)
    with together(group, "checking the arguments"):
        recipe = recipe_of(scheme)  # SchemeError / RecipeError
        for s in recipe.schemes:
            check_model_free_scheme(s)
        checkpoint_format = Format.parse(format)
        layout = get_layout(checkpoint_format)
        for s in recipe.schemes:
            layout.check_scheme(s)
        src_p, out_p = Path(src).resolve(), Path(out).resolve()
        check_not_source(src_p, out_p)
        ignore = list(ignore)
        opts = run_options or RunOptions()
    group.agree_fields("the argument", _run_arguments(src_p, out_p, recipe, checkpoint_format, ignore, include_lm_head, resume,
                                                      overwrite, dev, opts))
    with ExitStack() as stack:
        with together(group, "locking the output folder"):
            if group.is_main:  # a second run into the same folder is refused here, before any write
                stack.enter_context(output_lock(out_p))
        return _locked(ModelFreeJob(src_p, out_p, recipe, checkpoint_format, layout, ignore, include_lm_head, resume, overwrite,
                                    progress, workers, dev, opts, group))


@dataclass(frozen=True)
class ModelFreeJob:
    """A model-free run, its arguments checked and agreed by every rank."""

    src: Path
    out: Path
    recipe: Recipe
    checkpoint_format: Any                     # the checkpoint format (lowbit.formats.Format)
    layout: Any                  # its layout
    ignore: list[str]
    include_lm_head: bool
    resume: bool
    overwrite: bool
    progress: bool | None
    workers: int
    device: torch.device | None
    opts: RunOptions
    group: Group


def _locked(job: ModelFreeJob) -> Path:
    src_p, out_p, opts, group, workers, dev = job.src, job.out, job.opts, job.group, job.workers, job.device
    with together(group, "reading the source"):
        ckpt = Checkpoint(src_p)
    # worker processes start now, importing torch while the plan is made and finished shards found
    source_total = sum(i.nbytes for i in ckpt.tensors.values()) // group.world
    units = sum(max(1, -(-sum(i.nbytes for i in infos) // opts.part_bytes)) for infos in ckpt.shard_tensors.values())
    units = -(-units // group.world)  # this rank's share
    n_pool = 0 if opts.on_event is not None else use_pool(workers, units, source_total, dev, opts)
    pool = (opts.pool or ProcessPool)(n_pool) if n_pool else None
    ok = False
    try:
        with one_thread():  # the plan's probes, the tables built on first use, the jobs run here
            out_path = _quantize(job, ckpt, pool)
        ok = True
        return out_path
    except OSError as e:
        if isinstance(e, LowbitError):
            raise
        # disk full, read-only: the finished units stay for a resumed run, and the message says so
        raise resumable_failure(e, out_p, "shards") from None
    finally:
        if pool is not None:
            pool.close(ok)


def _quantize(job: ModelFreeJob, ckpt: Checkpoint, pool: Any) -> Path:
    from lowbit.files.staging import temporary_folder
    from lowbit.files.writer import CheckpointWriter

    src_p, out_p, recipe, checkpoint_format, layout, opts, group = job.src, job.out, job.recipe, job.checkpoint_format, job.layout, job.opts, job.group
    ignore, include_lm_head = job.ignore, job.include_lm_head
    with together(group, "making the plan"):
        plan = plan_recipe(ckpt, recipe, ignore, include_lm_head)  # a scheme per tensor (lowbit.modelfree.mixed)
        if not plan.quantized:
            raise FormatError(f"{src_p}: no linear weights to quantize were found (config model_type "
                              f"{ckpt.get('model_type')!r})")
        fp = _fingerprint(ckpt, recipe_key(recipe), checkpoint_format.value, ignore, include_lm_head, opts.part_bytes)
    group.agree("the run's fingerprint (the source files' sizes and times, the lowbit version)", fp)

    writer, work = None, None
    try:  # from the temporary folder's creation on, a data error (a layout's shape check too) removes it
        with together(group, "preparing the output folder"):
            if group.is_main:
                same_run = job.resume and previous_fingerprint(temporary_folder(out_p)) == fp
                writer = CheckpointWriter(out_p, overwrite=job.overwrite, resume=same_run, always_index=ckpt.sharded,
                                          weights_stem=layout.weights_stem)
                work = prepare_work(writer, ckpt, plan, job, fp)
        work = group.broadcast_object(work)
        mine = [work.jobs[i] for i in group.balance([j.source_bytes for j in work.jobs])]
        with together(group, "quantizing its share of the shards"):
            _run_jobs(mine, work, job.progress if group.is_main else False, job.workers, pool, opts, group)
        with together(group, "finishing the output folder"):
            if writer is not None:
                _finish(writer, work, ckpt, plan, layout, src_p, fp)
        return out_p
    except LowbitError as e:
        if writer is not None and is_data_error(e):
            writer.abort()  # bad data: nothing half-written stays behind
        raise


def _run_jobs(jobs: list[ShardJob], work: Work, progress: bool | None, workers: int, pool: Any, opts: RunOptions,
              group: Group) -> None:
    """This rank's units of work, in worker processes or in this process, with progress bars."""
    if group.distributed:
        prog = ShardProgress(progress, sum(j.source_bytes for j in jobs), 0, label=(
            f"[bold]rank {group.rank}/{group.world}: {len(jobs)} of {len(work.jobs)} units"))
    else:
        prog = ShardProgress(progress, work.total, work.done_bytes + work.skipped_bytes, len(work.out_names))
    with prog:
        if work.done_bytes:
            prog.log(f"resuming: {work.done_bytes / 1e9:.2f} of {work.total / 1e9:.2f} GB of source already done")
        if pool is not None and len(jobs) > 1:
            pool.run(jobs, prog)
        else:
            run_in_process(jobs, workers, prog, opts.on_event)


def _finish(writer: Any, work: Work, ckpt: Checkpoint, plan: Plan, layout: Any, src_p: Path, fp: str) -> Path:
    """Once every unit is done (on every rank): the shards renamed into place, the index, config.json
    and the tokenizer files written, and the folder renamed to the output."""
    for out_name, n_parts in work.unfinished.items():
        finalize_shard(writer.tmp, out_name, n_parts, fp)
    for shard, out_name in work.out_names.items():
        meta = read_marker(writer.tmp, out_name, fp)
        if meta is None:
            raise FormatError(f"shard {out_name} (from {shard}) was not completed")  # pragma: no cover
        writer.write_shard(None, out_name)
    writer.write_json("config.json", _output_config(ckpt, plan, layout))
    writer.copy_aux_files(src_p)
    shutil.rmtree(writer.tmp / MARKER_DIR)
    return writer.close()
