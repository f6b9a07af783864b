"""What a bug report needs to know about this installation: versions, the host CPU and which
kernel implementations can run here.

``collect()`` returns one ordered mapping of plain strings; nothing in it raises (a missing or
broken package reads as ``"not installed"`` or as the error it gave), so ``lowbit env`` prints
something on any machine.
"""

from __future__ import annotations

import platform
import sys
from importlib import metadata

import lowbit
from lowbit.hostcpu import cpu_flags

#: distribution name -> the label printed (the packages whose version changes lowbit's numbers or files)
PACKAGES = {"torch": "torch", "transformers": "transformers", "compressed-tensors": "compressed-tensors",
            "safetensors": "safetensors", "triton": "triton"}

#: label -> the /proc/cpuinfo flags that must all be present
CPU_FEATURES = {"AVX2": ("avx2",), "AVX-512": ("avx512f",), "VNNI": ("avx512_vnni",), "AVX-VNNI": ("avx_vnni",)}


def package_version(dist: str) -> str:
    """The installed version of distribution ``dist``, or ``"not installed"``."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def cpu_model(path: str = "/proc/cpuinfo") -> str:
    """The first CPU's model name in ``path`` (Linux), else what ``platform`` knows."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_features(flags: frozenset[str]) -> str:
    """``"AVX2 yes, AVX-512 no, ..."`` for CPU_FEATURES under ``flags``; ``"unknown"`` without flags."""
    if not flags:
        return "unknown (no /proc/cpuinfo flags)"
    return ", ".join(f"{name} {'yes' if all(f in flags for f in need) else 'no'}"
                     for name, need in CPU_FEATURES.items())


def native_build() -> str:
    """``"built (<path>)"`` when the C library builds and loads here, else ``"not built: <why>"``.
    Asking builds it once (into the user cache directory), as the first quantization would."""
    try:
        from lowbit.kernels.select import native_status

        path, why = native_status()
        return f"built ({path})" if path is not None else f"not built: {why}"
    except Exception as e:  # noqa: BLE001 - a report line, not a failure
        return f"not built: {type(e).__name__}: {e}"


def cuda() -> str:
    """``"available: N device(s), <name>"``, ``"not available"`` or the torch build's lack of CUDA."""
    try:
        import torch

        if torch.version.cuda is None:
            return "not available (torch built without CUDA)"
        if not torch.cuda.is_available():
            return f"not available (torch built for CUDA {torch.version.cuda}, no device)"
        n = torch.cuda.device_count()
        return f"available: {n} device(s), {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
    except Exception as e:  # noqa: BLE001
        return f"unknown: {type(e).__name__}: {e}"


def triton() -> str:
    """Whether lowbit's Triton kernels can run compiled here (Triton installed and a CUDA device)."""
    try:
        from lowbit.kernels.support import cuda_triton_available, triton_available

        if not triton_available():
            return "not installed"
        return "usable (CUDA device present)" if cuda_triton_available() else "installed, no CUDA device (kernels unused)"
    except Exception as e:  # noqa: BLE001
        return f"unknown: {type(e).__name__}: {e}"


def collect(cpuinfo: str = "/proc/cpuinfo") -> dict[str, str]:
    """The report, label -> value, in print order."""
    info = {"lowbit": lowbit.__version__}
    info.update({label: package_version(dist) for dist, label in PACKAGES.items()})
    info["python"] = f"{platform.python_version()} ({sys.executable})"
    info["platform"] = platform.platform()
    info["cpu"] = cpu_model(cpuinfo)
    info["cpu features"] = cpu_features(cpu_flags(cpuinfo))
    info["native library"] = native_build()
    info["triton kernels"] = triton()
    info["cuda"] = cuda()
    return info
