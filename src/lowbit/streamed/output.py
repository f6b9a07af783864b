"""The output folder of a streamed run, written one decoder layer at a time, and its resume state.

Layout: decoder layer i is shard ``i + 1`` of ``L + 1`` (``<stem>-0000i-of-000n.safetensors``);
the last shard holds everything outside the decoder layers (embeddings, final norm, output
head). The index, config.json (with ``quantization_config``), generation config, tokenizer and
the source's auxiliary files are written at the end, and the temporary folder
(``.<name>.lowbit-tmp``, lowbit.files.writer) is renamed to the output. Tensor names, dtypes and
values are those ``lowbit.save`` writes for the same quantized model (the same functions of
``lowbit.checkpoint.save`` make them).

Resume: after layer i's shard, the hidden states entering layer i + 1 (this rank's calibration
batches, float32, exact) and ``progress.json`` (layers done, what the summary and config need)
are written atomically to ``.lowbit-stream/`` in the temporary folder. A run with the same
fingerprint (source, scheme or recipe, format, calibration tokens and options, ranks) continues from
there, and writes the same bytes as an uninterrupted run; any other run starts afresh.

Refused writes (disk full, read-only, no permission): every file goes through lowbit.files'
atomic writes, which name it (lowbit.files.refused), and each step that writes is one every rank
takes together (``_step``: lowbit.modelfree.ranks.together), so a write refused on any rank
raises on every rank, none waiting for it: one OutputError line on the rank that failed (the
file, the temporary folder that stays and that the same command resumes from), a RankFailed
line quoting it on the others.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn as nn
from safetensors.torch import load_file

from lowbit.checkpoint.save import (
    as_saved, config_dict, layer_scales, float_linears, model_dtype, quantized_modules, quantized_tensors, warn_rounded,
    write_side_files,
)
from lowbit.dist import Group
from lowbit.errors import LowbitError
from lowbit.files.refused import resumable_failure
from lowbit.files.staging import temporary_folder
from lowbit.files.writer import CheckpointWriter, write_json_atomic, write_safetensors_atomic
from lowbit.formats import Format, get_layout
from lowbit.modelfree.ranks import together
from lowbit.moe import checkpoint_names, router_names
from lowbit.moe.naming import ignore_names
from lowbit.recipes.groups import config_groups
from lowbit.report.quantized import quantized_summary
from lowbit.schemes import Scheme

STATE_DIR = ".lowbit-stream"


class StreamOutput:
    """Rank 0 owns the writer (and the output's lock); every rank writes the shards of the layers
    it owns into the same temporary folder (one filesystem for all ranks)."""

    def __init__(self, out: Path, checkpoint_format: Format, fingerprint: str, n_layers: int, group: Group,
                 overwrite: bool = False) -> None:
        self.out, self.checkpoint_format, self.layout = Path(out), checkpoint_format, get_layout(checkpoint_format)
        self.fp, self.n_layers, self.group = fingerprint, n_layers, group
        self.files = self.layout.weights_stem
        self.tmp = temporary_folder(self.out)
        self.writer: CheckpointWriter | None = None
        same = self._previous_fingerprint() == fingerprint
        try:  # on return the temporary folder exists (and is clean unless resumed) for every rank
            with self._step("preparing the output folder"):
                if group.is_main:
                    self.writer = CheckpointWriter(self.out, overwrite=overwrite, resume=same, always_index=True,
                                                   weights_stem=self.files)
                    self.state.mkdir(exist_ok=True)
                    write_json_atomic(self.state / "run.json", {"fingerprint": fingerprint})
                    self.names = self.writer.files
        except BaseException:
            self.abort()
            raise
        if self.writer is None:
            from lowbit.files.folder import weight_files

            self.names = weight_files(self.files)
        self.progress: dict[str, Any] = {"done": 0, "static": {}, "lossy": [], "summaries": []}
        if same:
            self.progress = json.loads((self.state / "progress.json").read_text()) \
                if (self.state / "progress.json").is_file() else self.progress

    @property
    def state(self) -> Path:
        return self.tmp / STATE_DIR

    def _previous_fingerprint(self) -> str | None:
        try:
            return json.loads((self.tmp / STATE_DIR / "run.json").read_text()).get("fingerprint")
        except (OSError, ValueError, AttributeError):
            return None

    @contextmanager
    def _step(self, what: str) -> Iterator[None]:
        """A step of the run that every rank takes together (``together``); a write it cannot make
        is raised as ``resumable_failure`` (the file, and the temporary folder kept for a resumed
        run), on the other ranks as a RankFailed quoting that line."""
        with together(self.group, what):
            try:
                yield
            except OSError as e:
                if isinstance(e, LowbitError):
                    raise
                raise resumable_failure(e, self.out, "layers") from e

    def shard_name(self, i: int) -> str:
        return self.names.shard(i + 1, self.n_layers + 1)

    # ------------------------------------------------------------------ resume
    def resume_point(self) -> tuple[int, list[torch.Tensor] | None]:
        """(first layer still to run, the saved hidden states entering it, this rank's batches)."""
        done = int(self.progress["done"])
        if done == 0:
            return 0, None
        saved = load_file(str(self.state / f"inputs-rank{self.group.rank}.safetensors"))
        return done, [saved[str(b)] for b in range(len(saved))]

    # ------------------------------------------------------------------ per layer
    def write_layer(self, i: int, model: nn.Module, layer: nn.Module, prefix: str,
                    next_hidden: list[torch.Tensor] | None) -> None:
        """Write layer ``i`` (named ``prefix``, quantized) as its shard, then the state a resumed run
        starts from. Every rank calls this; the layer's owner writes the shard."""
        dtype = model_dtype(model)
        mt = getattr(model.config, "model_type", None)
        layers = {f"{prefix}.{n}": m for n, m in quantized_modules(layer).items()}
        self.layout.check_layers(layer_scales(layers))
        tensors, static, lossy = quantized_tensors(layers, self.layout, dtype)
        inner = set(layers)
        for k, v in layer.state_dict().items():
            full = f"{prefix}.{k}"
            if full.rpartition(".")[0] not in inner:
                tensors[full] = as_saved(v, dtype)
        disk = checkpoint_names(mt, list(tensors))
        summary = quantized_summary(layer)
        with self._step(f"writing decoder layer {i}"):  # every rank's shard and inputs are on disk ...
            if self.group.owns(i):
                write_safetensors_atomic(self.tmp / self.shard_name(i), {disk[k]: v for k, v in tensors.items()})
            if next_hidden is not None:
                write_safetensors_atomic(self.state / f"inputs-rank{self.group.rank}.safetensors",
                                         {str(b): h.detach().cpu().contiguous() for b, h in enumerate(next_hidden)})
        p = self.progress
        p["done"] = i + 1
        p["static"].update(static)
        p["lossy"] += lossy
        p["summaries"].append(summary)
        with self._step(f"writing the progress after decoder layer {i}"):  # ... before the progress says so
            if self.group.is_main:
                write_json_atomic(self.state / "progress.json", p)

    # ------------------------------------------------------------------ end
    def finish(self, model: nn.Module, layers_path: str, ignore_linears: list[str], tokenizer, source: Path,
               schemes: dict[str, Scheme]) -> dict:
        """Write the last shard (everything outside the decoder layers), the index and the other
        files, rename the folder; returns the run's summary (``quantized_summary``'s fields).
        ``schemes``: every quantized linear's scheme (model names), written as the config groups
        ``lowbit.save`` writes (``lowbit.recipes.groups``)."""
        dtype = model_dtype(model)
        mt = getattr(model.config, "model_type", None)
        warn_rounded("scales", self.progress["lossy"], dtype, self.layout)
        # linears outside the decoder layers quantized before them (calibration.outside), as write_layer writes
        quantized = {n: m for n, m in quantized_modules(model).items() if not n.startswith(layers_path + ".")}
        self.layout.check_layers(layer_scales(quantized))
        tensors, static, lossy = quantized_tensors(quantized, self.layout, dtype)
        self.progress["static"].update(static)
        outside = 0
        for k, v in model.state_dict().items():
            if k.startswith(layers_path + ".") or k.rpartition(".")[0] in quantized:
                continue
            if _is_tied_head(model, k):
                continue
            tensors[k] = as_saved(v, dtype)
        seen: set[int] = set()
        for n, p in model.named_parameters():
            if not n.startswith(layers_path + ".") and id(p) not in seen:
                seen.add(id(p))
                outside += p.numel()
        warn_rounded("scales", self.progress["lossy"] + lossy, dtype, self.layout)
        disk = checkpoint_names(mt, list(tensors) + ignore_linears + list(schemes))
        groups = config_groups({disk[n]: s for n, s in schemes.items()})
        summaries = self.progress["summaries"]
        if quantized:  # their parameters are counted in ``outside`` already
            summaries = summaries + [dict(quantized_summary(nn.ModuleList(quantized.values())), float_parameters=0)]
        with self._step("writing the last shard, the index and config.json"):  # rank 0 renames the folder
            if self.group.is_main:
                self._finish_main(model, dtype, mt, tensors, disk, ignore_linears, tokenizer, source, groups)
        return _merged(summaries, outside)

    def _finish_main(self, model: nn.Module, dtype, mt, tensors: dict[str, torch.Tensor], disk: dict[str, str],
                     ignore_linears: list[str], tokenizer, source: Path, groups) -> None:
        """Rank 0's end: the last shard, the index and the other files, the rename. The resume state
        is deleted only once all of them are written, so a refused write here resumes at this step."""
        w = self.writer
        write_safetensors_atomic(self.tmp / self.shard_name(self.n_layers), {disk[k]: v for k, v in tensors.items()})
        for i in range(self.n_layers + 1):
            w.write_shard(None, self.shard_name(i))
        static = {checkpoint_names(mt, [n])[n]: v for n, v in self.progress["static"].items()}
        qcfg = self.layout.quantization_config_groups(groups, ignore_names(mt, ignore_linears), static_scales=static)
        write_side_files(w, model, config_dict(model, dtype, qcfg, False), source, tokenizer)
        w.close(remove=(STATE_DIR,))

    def abort(self, refused: bool = False) -> None:
        """After an error: the temporary folder stays (a rerun resumes), the lock is released; a
        refusal (``refused``: the input cannot be quantized) before any layer was written removes
        it instead, as nothing in it could be resumed."""
        if self.writer is None:
            return
        if refused and int(getattr(self, "progress", {}).get("done", 0)) == 0:
            self.writer.abort()
        else:
            self.writer.keep_for_resume()


def _merged(summaries: list[dict], outside: int) -> dict:
    from lowbit.report.quantized import merge_summaries

    return merge_summaries(summaries, outside, [])


def _is_tied_head(model: nn.Module, key: str) -> bool:
    if not getattr(model.config, "tie_word_embeddings", False):
        return False
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and emb is not None and head.weight is emb.weight and key.endswith("weight") and \
        model.get_submodule(key.rpartition(".")[0]) is head


def ignore_list(model: nn.Module, targets: list[str]) -> list[str]:
    """The linears that stay float (not targets) and the routers, in model order: what
    ``lowbit.save`` lists as ``ignore`` for the same model after quantization."""
    t = set(targets)
    return [n for n in float_linears(model) if n not in t] + router_names(model)
