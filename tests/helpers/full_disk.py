"""A disk that fills up: the writes an output makes are counted, and the Nth is refused as a full
disk refuses it, each by the error its own writer raises:

- a safetensors file (``lowbit.files.writer.save_file``): safetensors' SafetensorError
  "Error while serializing: I/O error: No space left on device (os error 28)", part of the file written;
- a text file (``Path.write_text``): an OSError(ENOSPC) naming no file (write() names none), part written;
- a copy (``shutil.copyfile``): an OSError(ENOSPC) naming both files;
- a tokenizer's ``save_pretrained``: tokenizers' plain Exception "No space left on device (os error 28)";
- a region of a shard file written in place (``os.pwrite``, model-free): an OSError(ENOSPC) naming
  no file (``os.copy_file_range`` is taken away, so raw copies go through pwrite too);
- a figure (matplotlib's ``Figure.savefig``): an OSError(ENOSPC) naming no file.

    disk = FullDisk(monkeypatch, fail_at=3)              # the 3rd write is refused, later ones succeed
    disk = FullDisk(monkeypatch, fail_at=1, only="progress.json")   # count only the files so named
    disk.sites       # the file names written, in order, less ".partial" (a counting run: fail_at=None)
    disk.refused     # the path refused
    disk.fail_at = None                                  # from now on the disk has room again
    FullDisk(monkeypatch, fail_at=1, error=errno.EROFS)  # refused as a read-only file system refuses

Everything is patched through ``monkeypatch`` (a pytest fixture, or a ``pytest.MonkeyPatch()`` in a
subprocess), so ``monkeypatch.undo()`` restores it all.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path


class FullDisk:
    def __init__(self, monkeypatch, fail_at: int | None = None, only: str | None = None,
                 error: int = errno.ENOSPC) -> None:
        """``error``: the errno of the refusal (ENOSPC; EROFS, EACCES: a read-only file system, no permission)."""
        import safetensors
        import transformers

        import lowbit.files.writer as writer

        reason = os.strerror(error)
        rust_text = f"{reason} (os error {error})"  # how Rust's std::io::Error says it
        self.fail_at, self.only = fail_at, only
        self.count = 0
        self.sites: list[str] = []
        self.refused: list[str] = []
        real_save, real_text, real_copy = writer.save_file, Path.write_text, shutil.copyfile
        real_tok, real_pwrite = transformers.PreTrainedTokenizerBase.save_pretrained, os.pwrite

        def save_file(tensors, filename, metadata=None):
            if self._hit(filename):
                Path(filename).write_bytes(b"\0" * 64)  # part of the shard made it to disk
                raise safetensors.SafetensorError(f"Error while serializing: I/O error: {rust_text}")
            return real_save(tensors, filename, metadata=metadata)

        def write_text(path, data, *a, **k):
            if self._hit(path):
                real_text(path, data[: len(data) // 2], *a, **k)
                raise OSError(error, reason)
            return real_text(path, data, *a, **k)

        def copyfile(src, dst, *a, **k):
            if self._hit(dst):
                raise OSError(error, reason, str(src), None, str(dst))
            return real_copy(src, dst, *a, **k)

        def save_pretrained(tok, folder, *a, **k):
            if self._hit(Path(folder) / "tokenizer (save_pretrained)"):
                raise Exception(rust_text)
            return real_tok(tok, folder, *a, **k)

        def pwrite(fd, data, offset):
            if self._hit(os.readlink(f"/proc/self/fd/{fd}")):
                raise OSError(error, reason)
            return real_pwrite(fd, data, offset)

        monkeypatch.setattr(writer, "save_file", save_file)
        monkeypatch.setattr(Path, "write_text", write_text)
        monkeypatch.setattr(shutil, "copyfile", copyfile)
        monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "save_pretrained", save_pretrained)
        monkeypatch.setattr(os, "pwrite", pwrite)
        monkeypatch.delattr(os, "copy_file_range", raising=False)
        try:
            from matplotlib.figure import Figure
        except ImportError:
            return
        real_fig = Figure.savefig

        def savefig(fig, fname, *a, **k):
            if self._hit(fname):
                raise OSError(error, reason)
            return real_fig(fig, fname, *a, **k)

        monkeypatch.setattr(Figure, "savefig", savefig)

    def _hit(self, path) -> bool:
        """Count a write of ``path`` (with ``only``: if its file name, less ``.partial``, is that);
        whether it is the one refused."""
        name = site_name(path)
        if self.only is not None and name != self.only:
            return False
        self.count += 1
        self.sites.append(name)
        if self.count == self.fail_at:
            self.refused.append(str(path))
            return True
        return False


def site_name(path) -> str:
    """The file name a write makes, without the ``.partial`` it is written under."""
    return Path(str(path)).name.removesuffix(".partial")
