"""The one selection point of the kernel implementations.

Every kernel operation (encode and decode, nearest rounding, quantize groups, QDQ; see
lowbit.kernels.interface) has a ``reference`` implementation (the definitions in lowbit.numerics
and lowbit.quant), and some have faster ones, bit-identical to it: ``torch`` (fewer eager passes),
``native`` (the C library of lowbit.kernels.native, CPU tensors) and ``triton`` (the GPU kernels
of lowbit.kernels, CUDA tensors). Which one runs is decided here, and only here:

    from lowbit.kernels import Implementation, using
    with using(Implementation.TORCH):            # no C library in this block
        qt = lowbit.quant.quantize(w, spec)

The setting is one typed value for the process (threads share it; ``using`` restores the previous
value on exit; worker processes adopt their parent's, ``adopt``): the implementation, and how the
native library is built (``BuildOptions``: compilers, flags, cache folder). ``Implementation.AUTO``
(the default) resolves, once per process and build options, to the best available CPU implementation:
``native`` when the C library builds and loads, else ``torch``, and that fallback is reported
once, as a warning (RuntimeWarning and a warning log line) naming why the library is unavailable.
Triton runs at the entry points only when asked for; the Triton backends of lowbit.backends are
chosen per module and reach the Triton kernels only through lowbit.kernels.gpu, whose entry points
ask ``require(Implementation.TRITON)`` first. Asking for an implementation that is unavailable (``using(NATIVE)`` without a
C compiler, ``using(TRITON)`` without Triton and CUDA) raises KernelUnavailable.

The implementations are ordered REFERENCE < TORCH < NATIVE < TRITON. An operation runs the
highest implementation it has that is not above the resolved one and takes its input (native
kernels take CPU tensors of float32/bfloat16/float16, Triton kernels CUDA tensors); so
``using(REFERENCE)`` runs the reference everywhere, ``using(TORCH)`` never calls C. The choice
never changes a bit of any result: every implementation is tested against the reference
(tests/kernels/test_kernel_conformance.py).
"""

from __future__ import annotations

import logging
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterator

from lowbit.errors import LowbitError
from lowbit.kernels.build_options import BuildOptions

log = logging.getLogger(__name__)


class Implementation(str, Enum):
    AUTO = "auto"
    REFERENCE = "reference"
    TORCH = "torch"
    NATIVE = "native"
    TRITON = "triton"

    @property
    def level(self) -> int:
        return _LEVELS[self]

    def __str__(self) -> str:
        return self.value


_LEVELS = {Implementation.REFERENCE: 0, Implementation.TORCH: 1, Implementation.NATIVE: 2,
           Implementation.TRITON: 3, Implementation.AUTO: 3}


class KernelUnavailable(LowbitError, RuntimeError):
    """An implementation was asked for that cannot run here."""


@dataclass(frozen=True)
class Selection:
    """The kernel setting: the implementation asked for, and how the native library is built
    (``build``; the library is built once per value)."""

    implementation: Implementation = Implementation.AUTO
    build: BuildOptions = field(default_factory=BuildOptions)


_lock = threading.Lock()
_setting: list[Selection] = [Selection()]
_resolved: dict[Selection, tuple[Implementation, object]] = {}  # what resolve() and native_library() give
_warned: set[BuildOptions] = set()


def current() -> Selection:
    """The kernel setting in force."""
    return _setting[0]


def _native_library(options: BuildOptions):
    from lowbit.kernels.native.build import library

    return library(options)


def _native_reason(options: BuildOptions) -> str:
    from lowbit.kernels.native.build import unavailable_reason

    return unavailable_reason(options) or "unknown reason"


def _triton_ready() -> bool:
    from lowbit.kernels.support import cuda_triton_available

    return cuda_triton_available()


def _triton_interpreted() -> bool:
    from lowbit.kernels.support import triton_interpreted

    return triton_interpreted()


def available(impl: Implementation, build: BuildOptions = BuildOptions()) -> bool:
    """Whether ``impl`` can run here (NATIVE: the C library builds and loads under ``build``;
    TRITON: Triton and a CUDA device; REFERENCE, TORCH and AUTO: always)."""
    if impl is Implementation.NATIVE:
        return _native_library(build) is not None
    if impl is Implementation.TRITON:
        return _triton_ready()
    return True


def native_status(build: BuildOptions = BuildOptions()) -> tuple[str | None, str | None]:
    """``(path, None)`` when the C library builds and loads under ``build`` (the loaded file's
    path), else ``(None, why)``; asking builds it once, as the first quantization would."""
    lib = _native_library(build)
    if lib is not None:
        return lib._name, None
    return None, _native_reason(build)


def _check(sel: Selection) -> None:
    impl = sel.implementation
    if impl is Implementation.NATIVE and _native_library(sel.build) is None:
        raise KernelUnavailable(f"kernel implementation 'native' is unavailable: {_native_reason(sel.build)}")
    if impl is Implementation.TRITON and not _triton_ready():
        raise KernelUnavailable("kernel implementation 'triton' is unavailable: it needs Triton and a CUDA device")


@contextmanager
def using(implementation: Implementation, *, build: BuildOptions | None = None) -> Iterator[Selection]:
    """Run the block with ``implementation`` (and, for the native library, the ``build`` options;
    None: the setting's), then restore the previous setting. Raises KernelUnavailable at entry when
    it cannot run here."""
    sel = Selection(Implementation(implementation), build if build is not None else current().build)
    _check(sel)
    with _lock:
        before = _setting[0]
        _setting[0] = sel
    try:
        yield sel
    finally:
        with _lock:
            _setting[0] = before


def require(implementation: Implementation) -> None:
    """Raise KernelUnavailable unless ``implementation`` can run here: the check ``using`` makes
    at entry, for the entry points that run one implementation directly (lowbit.kernels.gpu, the
    Triton operations of the Triton backends, which are chosen per module). TRITON also runs
    under Triton's CPU interpreter (Triton's own setting, which lowbit never sets), on CPU tensors."""
    impl = Implementation(implementation)
    if impl is Implementation.TRITON:
        if not (_triton_ready() or _triton_interpreted()):
            raise KernelUnavailable("kernel implementation 'triton' is unavailable: it needs Triton and a CUDA "
                                    "device (or Triton's CPU interpreter)")
        return
    _check(Selection(impl, current().build))


def adopt(selection: Selection) -> None:
    """Make ``selection`` this process's setting: a worker process's initializer takes its
    parent's ``current()`` (lowbit.modelfree's pool), so that the choice holds there too."""
    _check(selection)
    with _lock:
        _setting[0] = selection


def resolve() -> Implementation:
    """The implementation in force, never AUTO: AUTO becomes NATIVE when the C library is
    available, else TORCH (reported once per process and build options, at warning level)."""
    return _resolution()[0]


def _resolution() -> tuple[Implementation, object]:
    """(resolve(), the C library or None where the resolved implementation is below NATIVE),
    worked out once per setting: every kernel call asks."""
    sel = _setting[0]
    got = _resolved.get(sel)
    if got is None:
        impl = _resolve(sel)
        got = (impl, _native_library(sel.build) if impl.level >= Implementation.NATIVE.level else None)
        _resolved[sel] = got
    return got


def _resolve(sel: Selection) -> Implementation:
    if sel.implementation is not Implementation.AUTO:
        return sel.implementation
    if _native_library(sel.build) is not None:
        return Implementation.NATIVE
    if sel.build not in _warned:
        with _lock:
            first = sel.build not in _warned
            _warned.add(sel.build)
        if first:
            msg = f"lowbit native kernels unavailable ({_native_reason(sel.build)}): using the torch kernels"
            log.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
    return Implementation.TORCH


def reset() -> None:
    """Forget the resolutions, the warnings given and the loaded libraries (tests: retry a build)."""
    from lowbit.kernels.native.build import reset as forget_libraries

    with _lock:
        _resolved.clear()
        _warned.clear()
    forget_libraries()


def allows(impl: Implementation) -> bool:
    """Whether an operation may run its ``impl`` implementation under the setting in force."""
    return _LEVELS[impl] <= _LEVELS[_resolution()[0]]


def native_library():
    """The C library when the setting allows the native implementation, else None."""
    return _resolution()[1]
