"""Where a calibrated GGUF run keeps what it has finished before the writer takes it: the encoded
rows (``Spill``, in files of a hidden folder beside the output) and, for a run that can resume,
its checkpoint in the same folder (``Checkpoint``).

A resumable run's folder is named by ``run_key``: a hash of everything that decides the file (the
source folder's path and its shards' sizes and times, the target, every tensor's type, the
calibration config, the importance search, the calibration windows' token ids and lowbit's
version). After a decoder layer whose rows are all in the folder (GPTQ's queue empty), the
checkpoint records the next layer, the hidden states it takes (float and, with reconstruction,
the quantized model's), the importance vectors so far, the reconstruction's per-layer summaries
and the rows' index; ``state.json`` is written last, through a temporary name, so a checkpoint is
whole or absent. The same command finds the folder, checks the key and starts at that layer.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from lowbit.numerics.ggml import GgmlType


class Spill(MutableMapping):
    """HF weight name -> (GGML type, uint8 rows), the rows kept in files of a folder and read back
    memory-mapped (copy on write: the file is never changed), as ``write_gguf``'s ``encoded``
    takes them. ``close()`` removes the folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._items: dict[str, tuple[GgmlType, tuple[int, ...], Path]] = {}
        self.locked: int | None = None  # ``resumable``'s locked descriptor while this process holds it

    @classmethod
    def beside(cls, out: Path) -> "Spill":
        """A new spill folder next to the output file ``out`` (a hidden temporary name)."""
        return cls(Path(tempfile.mkdtemp(prefix=f".{out.name}.rows-", dir=out.parent)))

    @classmethod
    def resumable(cls, out: Path, key: str) -> "Spill":
        """The spill folder of the run ``key`` (``run_key``) next to ``out``: a hidden name fixed by
        the key, so that the same command finds what a killed run left (``Checkpoint``)."""
        folder = out.parent / f".{out.name}.rows-{key[:16]}"
        folder.mkdir(exist_ok=True)
        spill = cls(folder)
        spill._lock(out)
        return spill

    def _lock(self, out: Path) -> None:
        """Claim the folder for this process: an exclusive ``flock`` on ``LOCK`` (its pid written in
        it), held while the process runs and dropped by the system when it ends, however it ends.
        The same command started while another process holds it is one QuantizationError, not two
        writers of one checkpoint; a killed run's folder is free to resume at once."""
        from lowbit.errors import QuantizationError

        try:
            import fcntl
        except ImportError:  # no flock on this platform: unguarded, as before
            return
        lock = self.folder / LOCK
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise QuantizationError(f"{out}: another run with the same options (pid {holder}) is calibrating into "
                                    f"{self.folder} (it holds {lock}); wait for it to finish") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self.locked = fd

    def release(self) -> None:
        """Give up the folder's lock, keeping its files (a stopped run, for the next to resume)."""
        if self.locked is not None:
            os.close(self.locked)  # closing the descriptor drops the flock
            self.locked = None

    def index(self) -> list:
        """The rows held, as JSON-able entries (``restore`` takes them back)."""
        return [[n, k.value, list(shape), p.name] for n, (k, shape, p) in self._items.items()]

    def restore(self, index: list) -> None:
        """Hold again the rows ``index`` lists (their files are in the folder)."""
        self._items = {n: (GgmlType(k), tuple(shape), self.folder / f) for n, k, shape, f in index}

    def __setitem__(self, name: str, value: tuple[GgmlType, torch.Tensor]) -> None:
        kind, rows = value
        rows = torch.as_tensor(rows)
        if rows.dtype != torch.uint8:
            raise TypeError(f"{name}: encoded rows must be uint8, got {rows.dtype}")
        path = self.folder / f"{len(self._items)}-{abs(hash(name)) % 10**8}.bin"
        rows.contiguous().numpy().tofile(path)
        self._items[name] = (kind, tuple(rows.shape), path)

    def __getitem__(self, name: str) -> tuple[GgmlType, torch.Tensor]:
        kind, shape, path = self._items[name]
        if not all(shape):
            return kind, torch.empty(shape, dtype=torch.uint8)
        return kind, torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c", shape=shape))

    def __delitem__(self, name: str) -> None:
        del self._items[name]  # the file goes with the folder

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def close(self) -> None:
        self._items.clear()
        self.release()
        shutil.rmtree(self.folder, ignore_errors=True)


#: the lock file of a resumable run's folder (``Spill._lock``: flock, pid inside)
LOCK = "run.lock"


def run_key(src: Path, target: str, types: dict, config: Any, search: Any, tokens: torch.Tensor) -> str:
    """The hash that names a resumable run's folder (module docstring)."""
    import lowbit

    shards = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in Path(src).glob("*.safetensors"))
    head = json.dumps({"src": str(Path(src).resolve()), "shards": shards, "target": target,
                       "types": {k: str(v) for k, v in types.items()}, "config": repr(config),
                       "search": str(search), "version": lowbit.__version__}, sort_keys=True)
    h = hashlib.sha256(head.encode())
    h.update(tokens.detach().cpu().contiguous().to(torch.int64).numpy().tobytes())
    return h.hexdigest()


class Checkpoint:
    """The resume state of a run in its spill folder (module docstring)."""

    def __init__(self, spill: Spill, key: str) -> None:
        self.spill, self.key = spill, key
        self.state = spill.folder / "state.json"
        self.tensors = spill.folder / "state.safetensors"
        self.unreadable = False  # ``load`` found a checkpoint it cannot read (its error says so)

    def exists(self) -> bool:
        return self.state.is_file()

    def load(self) -> tuple[int, list[torch.Tensor], list[torch.Tensor] | None, dict, dict] | None:
        """(next layer, its float hidden states per batch, the quantized ones or None, importance
        vectors, reconstruction summaries) of the last checkpoint, the spill's rows restored; None
        when there is none or it is another run's."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        from lowbit.errors import QuantizationError

        if not self.exists():
            return None
        try:
            meta = json.loads(self.state.read_text())
            if meta.get("key") != self.key:
                return None
            t = load_file(self.tensors)
            states = [t[f"float.{b}"] for b in range(meta["batches"])]
            quantized = [t[f"quantized.{b}"] for b in range(meta["batches"])] if meta["quantized"] else None
            importance = {n: t[f"importance.{i}"] for i, n in enumerate(meta["importance"])}
            missing = [f for _, _, _, f in meta["rows"] if not (self.spill.folder / f).is_file()]
            if missing:
                raise ValueError(f"rows file {missing[0]} is missing")
            self.spill.restore(meta["rows"])
            return meta["layer"], states, quantized, importance, meta["reports"]
        except (OSError, ValueError, KeyError, TypeError, SafetensorError) as e:  # json's errors are ValueErrors
            self.unreadable = True
            raise QuantizationError(f"{self.state}: a killed run's checkpoint cannot be read ({type(e).__name__}: "
                                    f"{e}); delete {self.spill.folder} to start over") from None

    def save(self, layer: int, states: list[torch.Tensor], quantized: list[torch.Tensor] | None,
             importance: dict[str, torch.Tensor], reports: dict) -> None:
        """Record that every layer before ``layer`` is done (their rows in the spill)."""
        from safetensors.torch import save_file

        t = {f"float.{b}": h.contiguous() for b, h in enumerate(states)}
        if quantized is not None:
            t.update({f"quantized.{b}": h.contiguous() for b, h in enumerate(quantized)})
        names = list(importance)
        t.update({f"importance.{i}": importance[n].contiguous() for i, n in enumerate(names)})
        tmp = self.tensors.with_suffix(".tmp")
        save_file(t, str(tmp))
        meta = {"key": self.key, "layer": layer, "batches": len(states), "quantized": quantized is not None,
                "importance": names, "reports": reports, "rows": self.spill.index()}
        if self.state.exists():
            self.state.unlink()  # a state never points at tensors of another checkpoint
        os.replace(tmp, self.tensors)
        tmp_state = self.state.with_suffix(".tmp")
        tmp_state.write_text(json.dumps(meta))
        os.replace(tmp_state, self.state)
