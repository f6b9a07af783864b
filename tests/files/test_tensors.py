"""lowbit.files.tensors.TensorReader: tensors as views of the shard's memory map, equal to what
safetensors reads, misaligned data copied, the file never written, maps replaced as they fill."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lowbit.errors import FormatError
from lowbit.files.tensors import TensorReader, read_header


def write_misaligned(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file whose bf16 and f32 tensors start at odd offsets (allowed by the format;
    safetensors' own writer never makes one), written byte by byte."""
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.arange(3, dtype=torch.uint8), "b": torch.randn(5, 4, generator=gen).to(torch.bfloat16),
               "c": torch.randn(3, generator=gen), "d": torch.zeros(0, dtype=torch.float16),
               "e": torch.tensor(2.5, dtype=torch.float32)}
    names = {torch.uint8: "U8", torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}
    header, blobs, off = {}, [], 0
    for k, t in tensors.items():
        b = t.contiguous().view(torch.uint8).numpy().tobytes() if t.dim() else t.reshape(1).view(torch.uint8).numpy().tobytes()
        header[k] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((-len(h)) % 8)  # an aligned data section: the offsets inside it are what is odd
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    return tensors


def test_reader_equals_safetensors_misaligned_included(tmp_path):
    f = tmp_path / "m.safetensors"
    want = write_misaligned(f)
    infos, _ = read_header(f)
    assert infos["b"].begin % 2 == 1 and infos["c"].begin % 4 != 0
    r = TensorReader(tmp_path)
    with safe_open(str(f), "pt") as h:
        for name, info in infos.items():
            got = r.get(info)
            assert got.dtype == want[name].dtype and got.shape == want[name].shape
            assert torch.equal(got, h.get_tensor(name)) and torch.equal(got, want[name])
    r.close()


def test_reader_never_writes_the_file_and_remaps(tmp_path):
    f = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(64, 32), "v": torch.full((16,), 3.0)}, str(f))
    before = f.read_bytes()
    infos, _ = read_header(f)
    r = TensorReader(tmp_path, reopen_bytes=1)  # a new map for every tensor
    w = r.get(infos["w"])
    w.mul_(7.0)  # a private mapping: the file is untouched
    v = r.get(infos["v"])
    assert torch.equal(v, torch.full((16,), 3.0)) and float(w[0, 0]) == 7.0
    r.close()
    assert f.read_bytes() == before


def test_reader_refuses_a_tensor_past_the_end(tmp_path):
    f = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(64, 32)}, str(f))
    info = read_header(f)[0]["w"]
    with open(f, "r+b") as h:
        h.truncate(f.stat().st_size - 4)  # cut after its header was read
    with pytest.raises(FormatError, match="'w' extends past the end"):
        TensorReader(tmp_path).get(info)
