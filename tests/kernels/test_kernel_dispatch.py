"""The fast paths are reachable only through the one dispatch point: each implementation module is
imported only by the entry points of its operations (which ask lowbit.kernels.select), and the
kernel layers import only downwards (numerics <- kernels <- quant). Read from the sources."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import lowbit
from lowbit.kernels import KernelUnavailable, gpu
from lowbit.schemes import get_scheme

SRC = Path(lowbit.__file__).parent

# implementation module -> the modules allowed to import it (the entry points of its operations)
# the Triton kernels' entry points (which ask lowbit.kernels.select), and the PTX audit (which compiles
# the kernels themselves): the Triton backends of lowbit.backends and triton_ops go through lowbit.kernels.gpu
TRITON_USERS = {"lowbit.kernels.gpu", "lowbit.kernels.ptx_audit"}
ENTRY_POINTS = {
    "lowbit.kernels.torch_ops": {"lowbit.kernels.codes", "lowbit.kernels.rounding"},
    "lowbit.kernels.native": {"lowbit.kernels.codes", "lowbit.kernels.rounding", "lowbit.quant.native_quant",
                              "lowbit.kernels.offsets", "lowbit.kernels.ggml"},
    "lowbit.kernels.native.build": {"lowbit.kernels.select"},
    "lowbit.quant.fast_qdq": {"lowbit.quant.qdq"},
    "lowbit.kernels.triton_ops": {"lowbit.quant.qdq"},
    "lowbit.kernels.gpu": {"lowbit.kernels.triton_ops", "lowbit.backends.triton_mx", "lowbit.backends.gpu_w8a8",
                           "lowbit.backends.triton_conformance"},
    "lowbit.quant.native_quant": {"lowbit.quant.qdq"},
    **{f"lowbit.kernels.{m}": TRITON_USERS for m in ("actquant", "dequant", "matmul", "gemm", "epilogue")},
}
TRITON_MODULES = {f"lowbit.kernels.{m}" for m in ("actquant", "dequant", "matmul", "gemm", "epilogue", "bits")}
# package -> the lowbit packages (and top-level modules) it may import
LAYERS = {
    "numerics": {"errors"},
    "kernels": {"numerics", "schemes", "errors", "cache"},
    "quant": {"numerics", "schemes", "errors", "kernels"},
}


def _module(f: Path) -> str:
    parts = f.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(f: Path) -> set[str]:
    """Every lowbit module ``f`` imports (``from a import b``: a.b where that is a module, else a)."""
    out = set()
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("lowbit.")}


def _graph() -> dict[str, set[str]]:
    return {_module(f): _imports(f) for f in SRC.rglob("*.py")}


def test_implementations_are_imported_only_by_their_entry_points():
    bad = []
    for mod, imports in _graph().items():
        for impl, allowed in ENTRY_POINTS.items():
            inside = mod == impl or mod.startswith(impl + ".") or (impl in TRITON_MODULES and mod in TRITON_MODULES)
            if impl in imports and not inside and mod not in allowed:
                bad.append(f"{mod} imports {impl}")
    assert not bad, bad


def test_the_native_library_is_loaded_only_by_the_selection():
    users = [_module(f) for f in SRC.rglob("*.py") if "library(" in f.read_text()
             and _module(f) not in ("lowbit.kernels.select", "lowbit.kernels.native.build", "lowbit.kernels.native")]
    assert not users, users
    build = (SRC / "kernels" / "native" / "build.py").read_text()
    assert "ENABLED" not in build  # no module switch: lowbit.kernels.using decides


def test_kernel_layers_import_only_downwards():
    bad = []
    for mod, imports in _graph().items():
        pkg = mod.split(".")[1] if mod.count(".") else ""
        if pkg not in LAYERS:
            continue
        for m in imports:
            tgt = m.split(".")[1]
            if tgt != pkg and tgt not in LAYERS[pkg]:
                bad.append(f"{mod} imports {m}")
    assert not bad, bad


def test_no_constant_is_restated_in_c():
    src = "".join(p.read_text() for p in (SRC / "kernels" / "native").glob("*.[ch]"))
    assert "#define NSTEPS" not in src and "return 4;" not in src  # both come from the generated header


def test_the_triton_entry_points_ask_the_selection(monkeypatch):
    """Without Triton and a CUDA device (and outside Triton's interpreter) every Triton entry
    point of lowbit.kernels.gpu refuses with KernelUnavailable."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # Triton's setting: compiled kernels, which need CUDA
    spec = get_scheme("nvfp4").input_activations
    x = torch.zeros(2, 16)
    calls = [lambda: gpu.quantize_blocks(x, spec), lambda: gpu.quantize_rows(x, spec),
             lambda: gpu.pack_microscaled(x, x, spec), lambda: gpu.pack_int(x, spec),
             lambda: gpu.dequantize_microscaled(x, x, spec, out_features=2, in_features=16),
             lambda: gpu.dequantize_int(x, x, spec, out_features=2, in_features=16),
             lambda: gpu.mx_matmul(x, x, x, spec, out_features=2),
             lambda: gpu.scale_epilogue(x, x, x, None, torch.float32)]
    for call in calls:
        with pytest.raises(KernelUnavailable, match="'triton' is unavailable"):
            call()
