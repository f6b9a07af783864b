"""Stock transformers reads lowbit's compressed-tensors MoE folders: the experts are written under
the names the family's checkpoints use, as transformers' own conversion mapping gives them
(``lowbit.moe.naming``), and every float router is in ``ignore`` under the names both the checkpoint
and transformers' model give it. PhiMoE's experts were written under the model's names, which
transformers did not load (it ran the model with random experts: relative logit error 0.45)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import lowbit
from helpers.ct_client import assert_close_logits, client_logits
from helpers.families import tiny_model
from lowbit.files.folder import SafetensorsFolder
from lowbit.moe.naming import checkpoint_names, model_names

CALIB = torch.randint(3, 256, (4, 32), generator=torch.Generator().manual_seed(0))
IDS = torch.randint(3, 256, (2, 24), generator=torch.Generator().manual_seed(1))


def _saved(model_type: str, scheme: str, path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = lowbit.quantize(tiny_model(model_type), scheme, calibration=CALIB, num_samples=4, seq_len=32)
    return lowbit.save(q, path, format="compressed-tensors")


def test_names_are_the_ones_transformers_maps():
    key = "model.layers.0.mlp.experts.3.gate_proj.weight_packed"
    assert checkpoint_names("phimoe", [key])[key] == "model.layers.0.block_sparse_moe.experts.3.w1.weight_packed"
    assert checkpoint_names("mixtral", [key])[key] == "model.layers.0.block_sparse_moe.experts.3.w1.weight_packed"
    assert checkpoint_names("qwen3_moe", [key])[key] == key
    head = "model.layers.0.mlp.router.weight"
    assert checkpoint_names("phimoe", [head])[head] == "model.layers.0.block_sparse_moe.gate.weight"
    emb = "model.embeddings.weight"
    assert checkpoint_names("nemotron_h", [emb])[emb] == "backbone.embeddings.weight"
    for mt, k in [("phimoe", key), ("phimoe", head), ("nemotron_h", emb), ("mixtral", key)]:
        disk = checkpoint_names(mt, [k])[k]
        assert model_names(mt, [disk])[disk] == k


def test_phimoe_folder_keeps_the_checkpoint_names(tmp_path):
    out = _saved("phimoe", "w4a16", tmp_path / "ct")
    keys = set(SafetensorsFolder(out))
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight_packed" in keys
    assert not any(".mlp.experts." in k for k in keys)
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert {"model.layers.0.block_sparse_moe.gate", "model.layers.0.mlp.router"} <= set(ignore)


@pytest.mark.subprocess
def test_stock_transformers_computes_what_lowbit_computes(tmp_path):
    folders, refs = {}, {}
    for mt in ("phimoe", "mixtral", "qwen3_moe"):
        out = _saved(mt, "w4a16", tmp_path / mt)
        with torch.no_grad():
            refs[mt] = lowbit.load(out)(input_ids=IDS, use_cache=False).logits
        folders[mt] = (str(out), "float32")
    got = client_logits(tmp_path, IDS, folders)
    assert_close_logits(got, refs, {mt: (1e-5,) for mt in folders})
