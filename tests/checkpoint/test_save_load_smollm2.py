"""Save/load on the real built-in model (SmolLM2-135M, float32): slow."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import lowbit
from helpers.models import SMOLLM2_MARKS
from lowbit.checkpoint.inspect import inspect_checkpoint
from helpers.ct_client import CLIENT
from helpers.formats_support import assert_same_layers, logits

pytestmark = SMOLLM2_MARKS


def test_smollm2_lowbit_and_fake_roundtrip(smollm2, tmp_path):
    model, tok = smollm2
    ids = tok(["It is a truth universally acknowledged, that a single man"], return_tensors="pt").input_ids
    q = lowbit.quantize(copy.deepcopy(model), "nvfp4-e5m3")  # the fixture is shared: keep it float
    lowbit.use_backend(q, "reference")
    ref = logits(q, ids)
    for fmt in ("lowbit", "fake"):
        lowbit.save(q, tmp_path / fmt, format=fmt)
        assert (tmp_path / fmt / "tokenizer.json").exists()
        loaded = lowbit.load(tmp_path / fmt, backend="reference")
        if fmt == "lowbit":
            assert_same_layers(q, loaded)
        assert torch.equal(logits(loaded, ids), ref)
    r = inspect_checkpoint(tmp_path / "lowbit")
    assert r["inconsistencies"] == [] and r["groups"][0]["layers"] == 210
    assert r["ratio"] < 0.6  # the embeddings (a third of SmolLM2) stay float


@pytest.mark.subprocess
def test_smollm2_compressed_tensors_in_transformers(smollm2, tmp_path):
    from lowbit.models import load_model

    model, tok = load_model(None)
    ids = tok(["It is a truth universally acknowledged, that a single man"], return_tensors="pt").input_ids
    calib = torch.randint(0, 49152, (4, 64), generator=torch.Generator().manual_seed(0))
    q = lowbit.quantize(model, "w8a8-int8", calibration=calib)
    lowbit.use_backend(q, "reference")
    ref = logits(q, ids)
    lowbit.save(q, tmp_path / "ct", format="compressed-tensors")
    loaded = lowbit.load(tmp_path / "ct", backend="reference")
    assert_same_layers(q, loaded)
    save_file({"ids": ids}, str(tmp_path / "ids.safetensors"))
    jobs = {"ids": str(tmp_path / "ids.safetensors"), "out": str(tmp_path / "lg.safetensors"),
            "folders": {"w8a8-int8": [str(tmp_path / "ct"), "float32"]}}
    p = subprocess.run([sys.executable, "-c", CLIENT, json.dumps(jobs)], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    got = load_file(str(tmp_path / "lg.safetensors"))["w8a8-int8"]
    torch.testing.assert_close(got, ref.float(), rtol=1e-4, atol=1e-4)
