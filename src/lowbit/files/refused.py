"""A write the system refused (disk full, read-only file system, no permission), as one error line.

Every write of an output goes through here, whichever library does it:

    with writing(path):          # a block that writes the file (or folder) ``path``
        save_file(tensors, path)
    # a refused write leaves the block as an OSError with its errno and reason, naming ``path``
    # when the error named no file: Python's write()/close() name none, and the Rust writers
    # (safetensors' SafetensorError "Error while serializing: I/O error: ... (os error 28)",
    # tokenizers' Exception "... (os error 28)") raise no OSError at all

    except OSError as e:
        raise write_failure(e, out)                 # OutputError: "cannot write FILE (output folder OUT): REASON"
        raise resumable_failure(e, out, "layers")   # the same, naming the temporary folder that stays
                                                    # and saying that the same command resumes

An OutputError is a LowbitError: the CLI prints it as one ``error:`` line and exits 2. Nothing
here imports torch (the CLI's light paths write files too).
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from lowbit.errors import LowbitError, OutputError
from lowbit.files.staging import temporary_folder

# how Rust's std::io::Error ends its message ("No space left on device (os error 28)")
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)\s*$")


def refused(exc: BaseException, path: str | os.PathLike, partial: str | os.PathLike | None = None) -> OSError | None:
    """The OSError of a write of ``path`` that ``exc`` reports, or None when ``exc`` is no I/O
    error (a LowbitError, a bug, an interruption: raised as they are).

    An OSError comes back naming the file it wrote: its own file name, or for a call on two paths
    (a copy, a rename) the second; ``path`` when it names none (write(), close() of an open file)
    or names ``partial``, the temporary name ``path`` is written under (lowbit.files.atomic). A
    Rust writer's error ending in "(os error N)" comes back as the OSError of errno N naming
    ``path``. An OSError without an errno is returned as it is."""
    if isinstance(exc, LowbitError):
        return None
    if isinstance(exc, OSError):
        written = exc.filename if exc.filename2 is None else exc.filename2
        if partial is not None and written is not None and Path(written) == Path(partial):
            written = None
        if exc.errno is None or (written is not None and exc.filename2 is None):
            return exc
        return OSError(exc.errno, exc.strerror or os.strerror(exc.errno), str(path if written is None else written))
    if isinstance(exc, Exception):
        m = _RUST_OS_ERROR.search(str(exc))
        if m is not None:
            code = int(m.group(1))
            return OSError(code, os.strerror(code), str(path))
    return None


@contextmanager
def writing(path: str | os.PathLike, partial: str | os.PathLike | None = None) -> Iterator[None]:
    """Run a block that writes ``path`` (a file, or a folder a library writes its files into;
    ``partial``: as for ``refused``): a write the system refuses leaves it as the OSError of
    ``refused`` (the original chained to it); anything else leaves it unchanged."""
    try:
        yield
    except Exception as e:
        err = refused(e, path, partial)
        if err is None or err is e:
            raise
        raise err from e


def write_failure(exc: OSError, out: str | os.PathLike, what: str = "") -> OutputError:
    """One line for a write the system refused: the path it names (else ``out``) and its reason;
    ``what`` is appended."""
    out = Path(out)
    reason = exc.strerror or str(exc) or type(exc).__name__
    if exc.filename is None:
        return OutputError(f"cannot write the output folder {out}: {reason}{what}")
    return OutputError(f"cannot write {exc.filename} (output folder {out}): {reason}{what}")


def resumable_failure(exc: OSError, out: str | os.PathLike, what: str) -> OutputError:
    """``write_failure`` of a resumable run: when its temporary folder stays, the line names it,
    says what it holds (``what``: the finished units, e.g. "shards") and how to go on."""
    tmp = temporary_folder(out)
    hint = (f"; the finished {what} stay in {tmp}: run the same command again to resume, or delete that "
            f"folder") if tmp.exists() else ""
    return write_failure(exc, out, hint)
