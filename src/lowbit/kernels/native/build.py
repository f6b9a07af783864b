"""Build and load the native kernels (lowbit_native.c, gptq_native.c, reconstruct_native.c,
ggml_native.c, ggml_fp4_native.c) at first use.

The C sources ship in the package, with the header ``lowbit_constants.h`` generated from
lowbit.kernels.native.constants (the step count and the ABI version: stated once, in Python).
Every function takes the build settings as one value,
lowbit.kernels.build_options.BuildOptions (compilers, flags, cache folder; the selection point's
setting carries it). The first call compiles them with the first compiler found into one library
in the cache folder, ``<cache>/lowbit_native-<hash>.so`` (by default ``<user cache>/native``),
where the hash covers the sources, their headers (the generated one included), the flags, the
compiler and what ``-march=native`` means on this machine (the compiler's predefined macros,
target_macros), so an edited source, other flags or another CPU get their own library. The
library is written under a temporary name and renamed, so concurrent builds (threads, worker
processes) never load a half-written file. It is loaded with ctypes (calls release the GIL), its
ABI version and parameter blocks checked once at load (lowbit.kernels.native.abi).

No compiler, a failed build or a failed load: ``library(options)`` returns None and
``unavailable_reason(options)`` says why; whether that is an error or a fallback (reported once
at warning level) is decided by the one selection point, lowbit.kernels.select. The flags keep IEEE
float32 arithmetic: no -ffast-math, no FMA contraction. Nothing here reads the environment
except the default cache directory's location (lowbit.cache.default_cache_dir); numerics never
depend on it.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from lowbit.kernels.build_options import BuildOptions
from lowbit.kernels.native.abi import open_checked
from lowbit.kernels.native.constants import header

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).with_name(n) for n in ("lowbit_native.c", "gptq_native.c", "reconstruct_native.c",
                                                           "ggml_native.c", "ggml_fp4_native.c"))
HEADERS = (Path(__file__).with_name("lowbit_native.h"),)  # hashed with the sources
DEFAULT = BuildOptions()

_lock = threading.Lock()
_state: dict[BuildOptions, tuple[ctypes.CDLL | None, str | None]] = {}  # options -> (library, why not)


def find_compiler(compilers: tuple[str, ...] = DEFAULT.compilers) -> str | None:
    """The path of the first of ``compilers`` found, or None."""
    for c in compilers:
        p = shutil.which(c)
        if p:
            return p
    return None


def target_macros(compiler: str, options: BuildOptions = DEFAULT) -> str:
    """The compiler's predefined macros under ``options.flags`` (its version, and the instruction sets
    -march=native enables here). Asking costs a compiler run (bench/modelfree/RESULTS-modelfree.md,
    section 7), so the answer is kept in the cache folder under a hash of what it depends on: the
    flags, the compiler binary (path, size, modification time) and this CPU's model and feature
    flags (``options.cpuinfo``; where that is unreadable, nothing is kept and the compiler is asked
    every time)."""
    flags = options.flags
    ask = lambda: subprocess.run([compiler, *flags, "-dM", "-E", "-x", "c", os.devnull],  # noqa: E731
                                 capture_output=True, text=True, timeout=60, check=True).stdout
    cpu = _cpu_identity(options.cpuinfo)
    if cpu is None:
        return ask()
    st = Path(compiler).resolve().stat()
    ident = json.dumps([flags, str(Path(compiler).resolve()), st.st_size, st.st_mtime_ns, cpu])
    path = options.folder() / f"target-{hashlib.sha256(ident.encode()).hexdigest()[:20]}.txt"
    try:
        return path.read_text()
    except OSError:
        pass
    macros = ask()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(macros)
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache: ask again next time
        log.debug("cannot keep the compiler's target macros in %s: %s", path, e)
    return macros


def _cpu_identity(cpuinfo: Path) -> list[str] | None:
    """This CPU's model name and feature flags (Linux: /proc/cpuinfo), or None."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return None
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features", "vendor_id")]
    return sorted(set(keep)) or None


def library_key(compiler: str, options: BuildOptions = DEFAULT) -> str:
    """Hash of the sources and headers (the generated one included), the flags and the compiler with
    its target (target_macros)."""
    macros = target_macros(compiler, options)
    h = hashlib.sha256()
    for part in (*(f.read_bytes() for f in SOURCES + HEADERS), header().encode(), " ".join(options.flags).encode(),
                 compiler.encode(), macros.encode()):
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:20]


def build(compiler: str, target: Path, options: BuildOptions = DEFAULT) -> None:
    """Compile SOURCES with ``options.flags`` into ``target`` atomically (temporary name in the same
    folder, then rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(prefix="lowbit-native-") as inc:
            Path(inc, "lowbit_constants.h").write_text(header())
            r = subprocess.run([compiler, *options.flags, "-I", inc, "-o", tmp, *map(str, SOURCES), "-lm"],
                               capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"{compiler} failed ({r.returncode}): {r.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(options: BuildOptions = DEFAULT) -> ctypes.CDLL:
    """Build (if needed) and load the library; raises on any failure."""
    compiler = find_compiler(options.compilers)
    if compiler is None:
        raise RuntimeError(f"no C compiler found (looked for {', '.join(options.compilers)})")
    target = options.folder() / f"lowbit_native-{library_key(compiler, options)}.so"
    if not target.is_file():
        build(compiler, target, options)
    return open_checked(target)


def library(options: BuildOptions = DEFAULT) -> ctypes.CDLL | None:
    """The library built under ``options`` (with the first of its compilers found), or None when it
    cannot be built or loaded (``unavailable_reason`` says why). Tried once per process and options."""
    got = _state.get(options)
    if got is None:
        with _lock:
            got = _state.get(options)
            if got is None:
                try:
                    got = (load(options), None)
                except Exception as e:  # noqa: BLE001 - any failure means no library
                    got = (None, f"{type(e).__name__}: {e}")
                    log.debug("lowbit native kernels unavailable: %s", got[1])
                _state[options] = got
    return got[0]


def reset() -> None:
    """Forget the loaded libraries (tests: rebuild or retry with other settings)."""
    with _lock:
        _state.clear()


def unavailable_reason(options: BuildOptions = DEFAULT) -> str | None:
    """Why library(options) is None (after it was tried), else None."""
    got = _state.get(options)
    return None if got is None else got[1]
