"""How the native library is built: one frozen value, ``BuildOptions``, that the kernel setting
carries (lowbit.kernels.select.Selection.build) and lowbit.kernels.native.build takes.

Importing this module imports nothing but ``lowbit.cache``: the selection point holds the options
without loading the build machinery.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lowbit.cache import default_cache_dir

DEFAULT_COMPILERS = ("cc", "gcc", "clang")  # the default search order; the first one found is used
# IEEE float32 arithmetic: no -ffast-math, no FMA contraction
DEFAULT_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-std=c11")
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class BuildOptions:
    """The native library's build settings; the library is built and loaded once per process and
    value.

    - ``compilers``: the C compilers looked for, in order (the first one found builds);
    - ``flags``: the compiler flags (they key the library and the compiler's target macros);
    - ``cache_dir``: where the library and the target macros are kept (None: ``native`` in the user
      cache folder, lowbit.cache.default_cache_dir, at the time of use);
    - ``cpuinfo``: the file naming this CPU's model and feature flags, which key the kept target
      macros (unreadable: nothing is kept and the compiler is asked every time).
    """

    compilers: tuple[str, ...] = field(default=DEFAULT_COMPILERS)
    flags: tuple[str, ...] = field(default=DEFAULT_FLAGS)
    cache_dir: Path | None = None
    cpuinfo: Path = CPUINFO

    def __post_init__(self) -> None:
        object.__setattr__(self, "compilers", tuple(self.compilers))
        object.__setattr__(self, "flags", tuple(self.flags))
        if self.cache_dir is not None:
            object.__setattr__(self, "cache_dir", Path(self.cache_dir))
        object.__setattr__(self, "cpuinfo", Path(self.cpuinfo))

    def folder(self) -> Path:
        """The cache folder in force: ``cache_dir``, else ``<user cache>/native``."""
        return self.cache_dir if self.cache_dir is not None else default_cache_dir() / "native"
