"""The native library's build: compiled once into the cache (atomically, keyed by source, flags
and compiler), loaded from there afterwards; without a compiler or when the build fails, asking for the
native implementation is an error and ``auto`` falls back to torch with one warning (same bits
either way)."""

from __future__ import annotations

import logging
import threading
import warnings
from dataclasses import replace

import pytest
import torch

from lowbit.kernels import BuildOptions, Implementation, KernelUnavailable, native, select, using
from lowbit.kernels.native import build
from lowbit.quant import native_quant, quantize
from lowbit.schemes import get_scheme

HAS_CC = build.find_compiler() is not None
NO_CC = ("lowbit-no-such-compiler",)


@pytest.fixture
def fresh(tmp_path):
    """Build options with an empty cache folder, and no loaded library; restored afterwards."""
    select.reset()
    yield BuildOptions(cache_dir=tmp_path / "native")
    select.reset()


def _weight():
    return (torch.randn(16, 64, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)


def test_no_compiler_native_is_an_error_and_auto_warns_once(fresh, caplog):
    w, spec = _weight(), get_scheme("nvfp4-e5m3").weights
    no_cc = replace(fresh, compilers=NO_CC)
    with caplog.at_level(logging.DEBUG, logger=build.__name__):
        assert build.library(no_cc) is None
        assert build.library(no_cc) is None  # tried once
    assert "no C compiler" in build.unavailable_reason(no_cc)
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
    with pytest.raises(KernelUnavailable, match="'native' is unavailable: RuntimeError: no C compiler"):
        with using(Implementation.NATIVE, build=no_cc):
            pass
    caplog.clear()
    with using(Implementation.AUTO, build=no_cc), warnings.catch_warnings(record=True) as caught:
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
    assert not fresh.cache_dir.exists() or not any(fresh.cache_dir.iterdir())


@pytest.mark.compile
@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
def test_failed_build_falls_back_and_leaves_no_file(fresh):
    bad = replace(fresh, flags=fresh.flags + ("-lowbit-invalid-flag",))
    assert build.library(bad) is None
    assert "failed" in build.unavailable_reason(bad)
    assert not list(fresh.cache_dir.glob("*.so")) and not list(fresh.cache_dir.glob("*.tmp"))  # the temporary output was removed


@pytest.mark.compile
@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
def test_native_and_fallback_give_the_same_bits(fresh):
    w = _weight()
    for name in ("nvfp4-e5m3", "w4a16", "mxfp4", "w8a8-int8-dynamic"):
        spec = get_scheme(name).weights
        select.reset()
        with using(Implementation.AUTO, build=fresh):
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
            assert not list(fresh.cache_dir.glob("*.so")), "the library appears only when complete"
            assert out.endswith(".tmp") and out.startswith(str(fresh.cache_dir))
        return real_run(cmd, *a, **kw)

    monkeypatch.setattr(build.subprocess, "run", spy)
    assert build.library(fresh) is not None
    libs = list(fresh.cache_dir.glob("*.so"))
    assert len(seen) == 1 and len(libs) == 1 and not list(fresh.cache_dir.glob("*.tmp"))
    key = build.library_key(build.find_compiler(), fresh)
    assert libs[0].name == f"lowbit_native-{key}.so"
    build.reset()
    mtime = libs[0].stat().st_mtime_ns
    assert build.library(fresh) is not None and len(seen) == 1  # loaded from the cache, not rebuilt
    assert libs[0].stat().st_mtime_ns == mtime
    flagged = replace(fresh, flags=fresh.flags + ("-DLOWBIT_TEST_FLAG=1",))
    assert build.library_key(build.find_compiler(), flagged) != key  # other flags: another library


@pytest.mark.compile
@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
def test_concurrent_first_use_builds_once_per_process(fresh):
    results = []
    threads = [threading.Thread(target=lambda: results.append(build.library(fresh))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and all(r is results[0] for r in results) and results[0] is not None
    assert len(list(fresh.cache_dir.glob("*.so"))) == 1


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
    first = build.target_macros(cc, fresh)
    assert "__x86_64__" in first or "__aarch64__" in first or "__GNUC__" in first
    assert build.target_macros(cc, fresh) == first and len(calls) == 1  # kept in the cache folder
    assert len(list(fresh.cache_dir.glob("target-*.txt"))) == 1
    flagged = replace(fresh, flags=fresh.flags + ("-DLOWBIT_TEST_FLAG=1",))
    assert "LOWBIT_TEST_FLAG" in build.target_macros(cc, flagged) and len(calls) == 2  # other flags: asked again
    no_cpu = replace(flagged, cpuinfo=fresh.cache_dir / "no-cpuinfo")  # no CPU facts: never kept
    build.target_macros(cc, no_cpu)
    build.target_macros(cc, no_cpu)
    assert len(calls) == 4 and len(list(fresh.cache_dir.glob("target-*.txt"))) == 2


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
