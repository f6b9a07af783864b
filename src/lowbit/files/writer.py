"""Atomic writing of a complete Hugging Face folder (shared by lowbit.save and model-free).

    from lowbit.formats import get_layout

    from lowbit.files.writer import CheckpointWriter
    with CheckpointWriter(out_dir, overwrite=False, max_shard_bytes=2 * 2**30,
                          weights_stem=get_layout(checkpoint_format).weights_stem) as w:   # "model" by default
        w.add_tensors({"model.embed_tokens.weight": t, ...})      # buffered; shards cut by size
        w.write_shard({"a.weight": ...}, w.files.shard(1, 2))     # or explicit shards (<stem>-*.safetensors)
        w.write_json("config.json", config_dict)
        w.copy_aux_files(src_dir)     # tokenizer*, special_tokens_map, generation_config, chat template...
    # on a clean exit: buffered shards are named <stem>-0000i-of-0000n.safetensors (or
    # <stem>.safetensors when there is one and no explicit shard), <stem>.safetensors.index.json is
    # written with the real total_size (sum of tensor bytes) whenever there is more than one shard
    # (or always_index=True), and the temporary folder is renamed to out_dir.
    # On an exception the temporary folder is removed; out_dir is untouched.

``weights_stem`` names the weight files (lowbit.files.folder.WeightFiles): ``model`` gives the
standard names stock loaders read; ``lowbit-model`` (the ``lowbit`` format's layout) gives names
they do not look for, so transformers refuses the folder loudly instead of misreading it. A folder
is never closed with weight files of the other naming in it.

The temporary folder is ``<parent>/.<name>.lowbit-tmp``; ``resume=True`` keeps shards already in it
(``w.has_shard(filename)`` tells which; their tensor names are read back from their headers for
the index), so a killed run can be continued. Every file is written to a ``.partial`` name first
and renamed when complete, so a shard in the temporary folder is always whole.

The writer holds the output's lock (lowbit.files.outlock) from construction to close/abort, so a
second writer of the same folder is refused at once (OutputError) instead of mixing files. A write
the system refuses (disk full, read-only) inside the ``with`` block, or while closing, removes the
temporary folder (unless resuming) and is raised as an OutputError naming the path
(lowbit.files.refused: every file written here names itself when refused).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

import torch
from safetensors.torch import save_file

from lowbit.errors import FormatError, LowbitError, OptionRef, OutputError
from lowbit.files.folder import STANDARD_STEM, WEIGHT_STEMS, WeightFiles, read_header, weight_files
from lowbit.files.atomic import atomic_path, write_text_atomic  # noqa: F401 (re-exported)
from lowbit.files.outlock import output_lock
from lowbit.files.refused import write_failure, writing
from lowbit.files.staging import temporary_folder

AUX_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
             "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "tokenizer.model", "spiece.model",
             "chat_template.jinja", "chat_template.json", "preprocessor_config.json", "processor_config.json")
AUX_SUFFIXES = (".tiktoken",)


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def write_json_atomic(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_safetensors_atomic(path: Path, tensors: Mapping[str, torch.Tensor],
                             metadata: Mapping[str, str] | None = None) -> int:
    """Write one shard (contiguous copies of shared tensors) via a .partial name; returns its tensor bytes."""
    seen: dict[tuple[int, int], str] = {}
    clean: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise FormatError(f"tensor {name!r}: expected a torch.Tensor, got {type(t).__name__}")
        t = t.detach().cpu()
        key = (t.untyped_storage().data_ptr(), t.storage_offset()) if t.numel() else (id(t), 0)
        if key in seen or not t.is_contiguous():
            t = t.contiguous().clone()
        seen[key] = name
        clean[name] = t
    with atomic_path(path) as tmp:
        save_file(clean, str(tmp), metadata=dict(metadata or {"format": "pt"}))
    return sum(tensor_nbytes(t) for t in clean.values())


def copy_aux_files(src: str | Path | None, dst: str | Path) -> list[str]:
    """Copy tokenizer, generation and processor files (never weights or config.json)."""
    if src is None:
        return []
    src, dst = Path(src), Path(dst)
    copied = []
    if not src.is_dir():
        return copied
    for p in sorted(src.iterdir()):
        if p.is_file() and (p.name in AUX_NAMES or p.name.endswith(AUX_SUFFIXES)):
            with atomic_path(dst / p.name) as tmp:
                shutil.copyfile(p, tmp)
            copied.append(p.name)
    return copied


def check_output_free(out: str | os.PathLike, overwrite: bool) -> None:
    """``out`` may be written: it does not exist, is an empty folder, or ``overwrite`` is set."""
    out = Path(out)
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        raise FormatError(f"output folder {str(out)!r} already exists and is not empty "
                          "(pass {overwrite} to replace it)", overwrite=OptionRef("overwrite"))


class CheckpointWriter:
    def __init__(self, out_dir: str | Path, *, overwrite: bool = False, max_shard_bytes: int = 2 * 2**30,
                 resume: bool = False, always_index: bool = False, weights_stem: str = STANDARD_STEM) -> None:
        self.files = weight_files(weights_stem)
        self.out = Path(out_dir)
        self._lock = output_lock(self.out)
        self._lock.__enter__()  # released by close() or abort()
        try:
            self._start(overwrite, max_shard_bytes, always_index, resume)
        except BaseException as e:
            self._release()
            if isinstance(e, OSError) and not isinstance(e, LowbitError):
                raise write_failure(e, self.out) from None
            raise

    def _release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.__exit__(None, None, None)

    def _start(self, overwrite: bool, max_shard_bytes: int, always_index: bool, resume: bool) -> None:
        check_output_free(self.out, overwrite)
        self.overwrite = overwrite
        self.max_shard_bytes = int(max_shard_bytes)
        self.always_index = always_index
        self.resume = resume
        self.tmp = temporary_folder(self.out)
        if self.tmp.exists() and not resume:
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self._buffer: dict[str, torch.Tensor] = {}
        self._buffer_bytes = 0
        self._auto: list[tuple[str, list[str]]] = []  # (temporary file name, tensor names)
        self._explicit: dict[str, list[str]] = {}
        self._sizes: dict[str, int] = {}
        self._names: set[str] = set()
        self._closed = False

    # ------------------------------------------------------------------ tensors
    def _claim(self, names) -> None:
        for n in names:
            if n in self._names:
                raise FormatError(f"tensor {n!r} written twice to {str(self.out)!r}")
            self._names.add(n)

    def add_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Buffer tensors; a shard is written whenever the buffer would exceed max_shard_bytes."""
        for name, t in tensors.items():
            nb = tensor_nbytes(t)
            if self._buffer and self._buffer_bytes + nb > self.max_shard_bytes:
                self._flush()
            self._claim([name])
            self._buffer[name] = t
            self._buffer_bytes += nb

    def _flush(self) -> None:
        if not self._buffer:
            return
        fname = f"auto-{len(self._auto):05d}.safetensors"
        self._sizes[fname] = write_safetensors_atomic(self.tmp / fname, self._buffer)
        self._auto.append((fname, list(self._buffer)))
        self._buffer, self._buffer_bytes = {}, 0

    def has_shard(self, filename: str) -> bool:
        """A complete shard of that name is already in the temporary folder (resume)."""
        return (self.tmp / filename).exists()

    def write_shard(self, tensors: Mapping[str, torch.Tensor] | None, filename: str) -> None:
        """Write one shard under its final file name. ``tensors=None`` adopts a shard already present
        in the temporary folder (resume): its names and sizes are read from its header."""
        if "/" in filename or not self.files.owns(filename):
            raise FormatError(f"invalid shard file name {filename!r} (expected {self.files.single} or "
                              f"{self.files.stem}-*.safetensors)")
        if filename in self._explicit:
            raise FormatError(f"shard {filename!r} written twice")
        if tensors is None:
            header = read_header(self.tmp / filename)
            names = [n for n in header if n != "__metadata__"]
            self._sizes[filename] = sum(e["data_offsets"][1] - e["data_offsets"][0]
                                        for n, e in header.items() if n != "__metadata__")
        else:
            names = list(tensors)
            self._sizes[filename] = write_safetensors_atomic(self.tmp / filename, tensors)
        self._claim(names)
        self._explicit[filename] = names

    # ------------------------------------------------------------------ other files
    def write_json(self, name: str, obj: Any) -> None:
        write_json_atomic(self.tmp / name, obj)

    def copy_aux_files(self, src: str | Path | None) -> list[str]:
        return copy_aux_files(src, self.tmp)

    def save_tokenizer(self, tokenizer) -> None:
        """``tokenizer.save_pretrained`` into the temporary folder; a write it cannot make is an
        OSError naming that folder (its files are written by transformers and tokenizers, which
        name none)."""
        with writing(self.tmp):
            tokenizer.save_pretrained(str(self.tmp))

    # ------------------------------------------------------------------ finish
    def close(self, remove: tuple[str, ...] = ()) -> Path:
        """Write the index, check the folder and rename it to the output; returns the output.
        ``remove``: entries of the temporary folder (a resumable run's own state) deleted once
        every other file is written, just before the rename, so a refused write before then
        leaves them for a resumed run."""
        if self._closed:
            return self.out
        self._flush()
        weight_map: dict[str, str] = {}
        n_auto = len(self._auto)
        total_shards = n_auto + len(self._explicit)
        if total_shards == 0:
            raise FormatError(f"no tensors were written to {str(self.out)!r}")
        for i, (fname, names) in enumerate(self._auto):
            if total_shards == 1 and not self.always_index:
                final = self.files.single
            else:
                final = self.files.shard(i + 1, n_auto)
            if final in self._explicit:
                raise FormatError(f"shard name {final!r} is used twice")
            os.replace(self.tmp / fname, self.tmp / final)
            self._sizes[final] = self._sizes.pop(fname)
            weight_map.update({n: final for n in names})
        for fname, names in self._explicit.items():
            weight_map.update({n: fname for n in names})
        if total_shards > 1 or self.always_index or self.files.single not in self._sizes:
            self.write_json(self.files.index, {"metadata": {"total_size": sum(self._sizes.values())},
                                               "weight_map": dict(sorted(weight_map.items()))})
        if not (self.tmp / "config.json").exists():
            raise FormatError(f"no config.json was written to {str(self.out)!r}")
        for other in (WeightFiles(s) for s in WEIGHT_STEMS if s != self.files.stem):
            stray = [n for n in (other.index, other.single) if (self.tmp / n).exists()]
            if stray:  # e.g. left by a resumed run: a stock loader would read it instead of failing
                raise FormatError(f"{str(self.tmp / stray[0])!r} does not belong in a folder whose weights are "
                                  f"{self.files.stem}* files")
        for name in remove:
            shutil.rmtree(self.tmp / name)
        self._finalize()
        self._closed = True
        self._release()
        return self.out

    def _finalize(self) -> None:
        trash = None
        if self.out.exists():
            trash = self.out.parent / f".{self.out.name}.lowbit-old"
            if trash.exists():
                shutil.rmtree(trash)
            os.replace(self.out, trash)
        os.replace(self.tmp, self.out)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)

    def abort(self) -> None:
        """Remove the temporary folder and release the lock; the output is untouched."""
        self._buffer.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)
        self._closed = True
        self._release()

    def keep_for_resume(self) -> None:
        """Stop without finishing: the temporary folder stays for a resumed run (``resume=True``),
        the lock is released, the output is untouched."""
        self._buffer.clear()
        self._closed = True
        self._release()

    def __enter__(self) -> "CheckpointWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.close()
            except BaseException as e:
                self._fail(e)
                raise
            return
        if isinstance(exc, BaseException):
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        """After an error: remove the temporary folder (kept with resume=True, for the next run),
        release the lock, and raise a refused write as an OutputError naming its path."""
        if not self._closed and not self.resume:
            self.abort()
        self._release()
        if isinstance(exc, OSError) and not isinstance(exc, LowbitError):
            raise write_failure(exc, self.out) from None
