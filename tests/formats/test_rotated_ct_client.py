"""A rotated model saved as compressed-tensors is an ordinary checkpoint: stock transformers (with the
compressed-tensors package, no transform_config, lowbit never imported) loads it, with its untied
lm_head, and computes lowbit's logits. Tolerances: tests/formats/test_formats_ct_client.py's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import lowbit
from helpers.ct_client import CLIENT
from helpers.models import tiny_llama

pytest.importorskip("compressed_tensors")

CALIB = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(2))
# scheme -> (model dtype, tiny_llama overrides, max |diff| allowed relative to max |logit|)
CASES = {
    "w8a8-int8": (torch.float32, {}, 1e-5),   # static scales, SmoothQuant 0.8 after the rotation
    "w4a16": (torch.float32, {"hidden_size": 128, "intermediate_size": 256}, 1e-5),
    "nvfp4a16": (torch.bfloat16, {}, 0.01),
}


def _model(dtype, overrides):
    model = tiny_llama(**overrides)
    if dtype != torch.float32:  # as transformers builds a bf16 model: rotary buffers stay float32
        rot = model.model.rotary_emb
        keep = {n: b.clone() for n, b in rot.named_buffers()}
        model.to(dtype)
        for n, b in keep.items():
            setattr(rot, n, b)
    return model


@pytest.mark.subprocess
def test_transformers_loads_rotated_compressed_tensors_folders(tmp_path):
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    refs, folders = {}, {}
    for name, (dtype, overrides, _) in CASES.items():
        q = lowbit.quantize(_model(dtype, overrides), name, calibration=CALIB, rotation="hadamard", progress=False)
        assert q.lowbit_rotation.untied
        lowbit.use_backend(q, "reference")
        with torch.no_grad():
            refs[name] = q(ids).logits.float()
        lowbit.save(q, tmp_path / name, format="compressed-tensors")
        cfg = json.loads((tmp_path / name / "config.json").read_text())
        assert cfg["tie_word_embeddings"] is False and not cfg["quantization_config"]["transform_config"]
        folders[name] = (str(tmp_path / name), str(dtype).removeprefix("torch."))
    save_file({"ids": ids}, str(tmp_path / "ids.safetensors"))
    jobs = {"ids": str(tmp_path / "ids.safetensors"), "out": str(tmp_path / "logits.safetensors"), "folders": folders}
    p = subprocess.run([sys.executable, "-c", CLIENT, json.dumps(jobs)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = load_file(str(tmp_path / "logits.safetensors"))
    for name, (_, _, rel) in CASES.items():
        diff = (got[name] - refs[name]).abs().max().item()
        scale = refs[name].abs().max().item()
        print(f"{name}: max |diff| {diff:.4g}, max |logit| {scale:.4g}")
        assert diff <= rel * scale, (name, diff, scale)
