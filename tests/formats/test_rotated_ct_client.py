"""A rotated model saved as compressed-tensors is an ordinary checkpoint: stock transformers (with the
compressed-tensors package, no transform_config, lowbit never imported) loads it, with its untied
lm_head, and computes lowbit's logits. Tolerances: tests/formats/test_formats_ct_client.py's."""

from __future__ import annotations

import json

import pytest
import torch

import lowbit
from helpers.ct_client import assert_close_logits, client_logits
from helpers.formats_support import tiny_llama_as

pytest.importorskip("compressed_tensors")

CALIB = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(2))
# scheme -> (model dtype, tiny_llama overrides, max |diff| allowed relative to max |logit|)
CASES = {
    "w8a8-int8": (torch.float32, {}, 1e-5),   # static scales, SmoothQuant 0.8 after the rotation
    "w4a16": (torch.float32, {"hidden_size": 128, "intermediate_size": 256}, 1e-5),
    "nvfp4a16": (torch.bfloat16, {}, 0.01),
}


@pytest.mark.subprocess
def test_transformers_loads_rotated_compressed_tensors_folders(tmp_path):
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    refs, folders = {}, {}
    for name, (dtype, overrides, _) in CASES.items():
        q = lowbit.quantize(tiny_llama_as(dtype, **overrides), name, calibration=CALIB, rotation="hadamard", progress=False)
        assert q.lowbit_rotation.untied
        lowbit.use_backend(q, "reference")
        with torch.no_grad():
            refs[name] = q(ids).logits.float()
        lowbit.save(q, tmp_path / name, format="compressed-tensors")
        cfg = json.loads((tmp_path / name / "config.json").read_text())
        assert cfg["tie_word_embeddings"] is False and not cfg["quantization_config"]["transform_config"]
        folders[name] = (str(tmp_path / name), str(dtype).removeprefix("torch."))
    assert_close_logits(client_logits(tmp_path, ids, folders), refs, CASES)
