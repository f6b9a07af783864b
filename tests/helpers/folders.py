"""Comparing the safetensors of two folders bit for bit."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file


def folder_tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            assert k not in out, f"{k} written twice"
            out[k] = v
    return out


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        x, y = a[k], b[k]
        assert x.dtype == y.dtype and x.shape == y.shape, k
        assert torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)), k
