"""The native library's build: compiled once into the cache (atomically, keyed by source, flags
and compiler), loaded from there afterwards; without a compiler or when the build fails, asking for the
native implementation is an error and ``auto`` falls back to torch with one warning (same bits
either way)."""

from __future__ import annotations

import logging
import threading
import warnings

import pytest
import torch

from lowbit.kernels import Implementation, KernelUnavailable, native, select, using
from lowbit.kernels.native import build
from lowbit.quant import native_quant, quantize
from lowbit.schemes import get_scheme

HAS_CC = build.find_compiler() is not None
NO_CC = ("lowbit-no-such-compiler",)


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty cache folder and no loaded library; restored afterwards."""
    monkeypatch.setattr(build, "cache_dir", lambda: tmp_path / "native")
    select.reset()
    yield tmp_path / "native"
    select.reset()


def _weight():
    return (torch.randn(16, 64, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)


def test_no_compiler_native_is_an_error_and_auto_warns_once(fresh, monkeypatch, caplog):
    w, spec = _weight(), get_scheme("nvfp4-e5m3").weights
    with caplog.at_level(logging.DEBUG, logger=build.__name__):
        assert build.library(NO_CC) is None
        assert build.library(NO_CC) is None  # tried once
    assert "no C compiler" in build.unavailable_reason(NO_CC)
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
    with pytest.raises(KernelUnavailable, match="'native' is unavailable: RuntimeError: no C compiler"):
        with using(Implementation.NATIVE, compilers=NO_CC):
            pass
    caplog.clear()
    with using(Implementation.AUTO, compilers=NO_CC), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert select.resolve() is Implementation.TORCH
        assert not native.usable(w) and not native_quant.supports(w, spec)
        qt = quantize(w, spec)  # the torch path
        assert select.resolve() is Implementation.TORCH
    assert [str(c.message) for c in caught] == [
        "lowbit native kernels unavailable (RuntimeError: no C compiler found (looked for lowbit-no-such-compiler)): "
        "using the torch kernels"]
    assert [r.levelno for r in caplog.records if r.name == select.__name__] == [logging.WARNING]
    assert qt.codes.shape == (16, 64) and qt.scale.shape == (16, 4)
    assert not fresh.exists() or not any(fresh.iterdir())


@pytest.mark.compile
@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
def test_failed_build_falls_back_and_leaves_no_file(fresh, monkeypatch):
    monkeypatch.setattr(build, "FLAGS", build.FLAGS + ("-lowbit-invalid-flag",))
    assert build.library() is None
    assert "failed" in build.unavailable_reason()
    assert not list(fresh.glob("*.so")) and not list(fresh.glob("*.tmp"))  # the temporary output was removed


@pytest.mark.compile
@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
def test_native_and_fallback_give_the_same_bits(fresh, monkeypatch):
    w = _weight()
    for name in ("nvfp4-e5m3", "w4a16", "mxfp4", "w8a8-int8-dynamic"):
        spec = get_scheme(name).weights
        select.reset()
        nat = quantize(w, spec)
        assert native_quant.quantize_native(w, spec) is not None
        with using(Implementation.TORCH):
            assert nat.equal(quantize(w, spec)), name


@pytest.mark.compile
@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
def test_build_is_atomic_cached_and_keyed(fresh, monkeypatch):
    seen = []
    real_run = build.subprocess.run

    def spy(cmd, *a, **kw):
        if "-o" in cmd:
            out = cmd[cmd.index("-o") + 1]
            seen.append(out)
            assert not list(fresh.glob("*.so")), "the library appears only when complete"
            assert out.endswith(".tmp") and out.startswith(str(fresh))
        return real_run(cmd, *a, **kw)

    monkeypatch.setattr(build.subprocess, "run", spy)
    assert build.library() is not None
    libs = list(fresh.glob("*.so"))
    assert len(seen) == 1 and len(libs) == 1 and not list(fresh.glob("*.tmp"))
    key = build.library_key(build.find_compiler())
    assert libs[0].name == f"lowbit_native-{key}.so"
    build.reset()
    mtime = libs[0].stat().st_mtime_ns
    assert build.library() is not None and len(seen) == 1  # loaded from the cache, not rebuilt
    assert libs[0].stat().st_mtime_ns == mtime
    monkeypatch.setattr(build, "FLAGS", build.FLAGS + ("-DLOWBIT_TEST_FLAG=1",))
    assert build.library_key(build.find_compiler()) != key  # other flags: another library


@pytest.mark.compile
@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
def test_concurrent_first_use_builds_once_per_process(fresh):
    results = []
    threads = [threading.Thread(target=lambda: results.append(build.library())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and all(r is results[0] for r in results) and results[0] is not None
    assert len(list(fresh.glob("*.so"))) == 1


def test_switch_forces_the_torch_path():
    with using(Implementation.TORCH):
        assert select.native_library() is None and not native.usable(_weight())
        assert not native_quant.supports(_weight(), get_scheme("w4a16").weights)


@pytest.mark.compile
@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
def test_target_macros_are_asked_once_and_keyed_by_flags(fresh, monkeypatch):
    calls = []
    real_run = build.subprocess.run

    def spy(cmd, *a, **kw):
        calls.append(cmd)
        return real_run(cmd, *a, **kw)

    monkeypatch.setattr(build.subprocess, "run", spy)
    cc = build.find_compiler()
    first = build.target_macros(cc)
    assert "__x86_64__" in first or "__aarch64__" in first or "__GNUC__" in first
    assert build.target_macros(cc) == first and len(calls) == 1  # kept in the cache folder
    assert len(list(fresh.glob("target-*.txt"))) == 1
    monkeypatch.setattr(build, "FLAGS", build.FLAGS + ("-DLOWBIT_TEST_FLAG=1",))
    assert "LOWBIT_TEST_FLAG" in build.target_macros(cc) and len(calls) == 2  # other flags: asked again
    monkeypatch.setattr(build, "_cpu_identity", lambda: None)  # no CPU facts: never kept
    build.target_macros(cc)
    build.target_macros(cc)
    assert len(calls) == 4 and len(list(fresh.glob("target-*.txt"))) == 2


@pytest.mark.compile
@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
def test_the_library_reports_the_abi_of_its_python_mirrors():
    """One ABI version (constants.py, through the generated header) and parameter blocks of the
    sizes of their ctypes mirrors: what the loader checks once."""
    import ctypes

    from lowbit.kernels.native import abi
    from lowbit.kernels.native.constants import ABI_VERSION

    lib = build.library()
    assert lib is not None and lib.lb_version() == ABI_VERSION
    assert [lib.lb_sizeof(i) for i in range(len(abi.BLOCKS))] == [ctypes.sizeof(b) for b in abi.BLOCKS]
    assert lib.lb_sizeof(len(abi.BLOCKS)) == -1
