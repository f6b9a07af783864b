"""The ``device`` option of model-free quantization: checked before anything is read or written."""

from __future__ import annotations

import torch

from lowbit.errors import LowbitError


class DeviceError(LowbitError, ValueError):
    """The requested device does not exist or cannot be used here."""


def resolve_device(device: str | torch.device | None) -> torch.device | None:
    """None for the CPU (the default), else the checked torch device ("cuda", "cuda:N").

    Raises DeviceError naming the option when the device is not a torch device, is not a CUDA
    device, or is not available in this process (no CUDA build, no GPU, index out of range)."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise DeviceError(f"device={device!r} is not a torch device ({e}); use 'cpu' or 'cuda[:N]'") from None
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        raise DeviceError(f"device={device!r}: model-free quantization runs on 'cpu' or 'cuda[:N]', "
                          f"not {dev.type!r}")
    if not torch.cuda.is_available():
        raise DeviceError(f"device={device!r}: CUDA is not available here (torch {torch.__version__}, CUDA build "
                          f"{torch.version.cuda or 'none'}); drop the option to quantize on the CPU")
    n = torch.cuda.device_count()
    if dev.index is not None and dev.index >= n:
        raise DeviceError(f"device={device!r}: this machine has {n} CUDA device(s) (cuda:0..cuda:{n - 1})")
    return torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
