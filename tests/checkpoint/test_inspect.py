"""``lowbit inspect PATH``: format, schemes, ignored layers, size against float, inconsistencies."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import lowbit
from lowbit.cli.app import app, main
from lowbit.checkpoint.inspect import inspect_checkpoint
from helpers.formats_support import quantized_model

runner = CliRunner()


@pytest.fixture
def folder(tmp_path):
    out = tmp_path / "ck"
    lowbit.save(quantized_model("w8a8-int8"), out, format="compressed-tensors")
    return out


def test_inspect_reports_a_good_folder(folder):
    r = inspect_checkpoint(folder)
    assert r["format"] == "compressed-tensors" and r["dtype"] == "float32"
    assert [(g["scheme"], g["layers"]) for g in r["groups"]] == [("w8a8-int8", 14)]
    assert r["groups"][0]["spec"]["input_activations"]["dynamic"] == "static"
    assert r["ignored"] == ["lm_head"] and r["inconsistencies"] == []
    assert 0.2 < r["ratio"] < 0.6  # int8 linears, float embeddings
    res = runner.invoke(app, ["inspect", str(folder)])
    assert res.exit_code == 0, res.output
    assert "compressed-tensors" in res.output and "w8a8-int8" in res.output and "lm_head" in res.output
    assert "no inconsistencies" in res.output
    res = runner.invoke(app, ["inspect", str(folder), "--json"])
    assert json.loads(res.output)["layers"]["model.layers.1.mlp.down_proj"] == "w8a8-int8"


def test_inspect_lists_every_inconsistency(folder):
    t = load_file(str(folder / "model.safetensors"))
    del t["model.layers.0.mlp.down_proj.input_scale"]
    t["model.layers.1.self_attn.k_proj.input_scale"] = torch.tensor([0.5])  # q/k/v no longer shared
    del t["model.norm.weight"]
    save_file(t, str(folder / "model.safetensors"))
    r = inspect_checkpoint(folder)
    text = "\n".join(r["inconsistencies"])
    assert "'model.layers.0.mlp.down_proj.input_scale' is missing" in text
    assert "model.layers.1.self_attn.k_proj" in text and "input_scale values differ" in text
    assert "'model.norm.weight' is missing" in text
    assert len(r["inconsistencies"]) == 3
    res = runner.invoke(app, ["inspect", str(folder), "--strict"])
    assert res.exit_code == 1 and "3 inconsistencies" in res.output


def test_inspect_damaged_shard_and_unknown_format(folder, capsys):
    raw = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(raw[:-100])
    r = inspect_checkpoint(folder)
    assert any("model.safetensors" in p and "truncated" in p for p in r["inconsistencies"])
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "hqq"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit) as e:
        main(["inspect", str(folder)])
    assert e.value.code == 2
    assert "unknown quant_method 'hqq'" in capsys.readouterr().err


def test_inspect_flags_lowbit_format_under_standard_names(tmp_path):
    """A lowbit-format folder whose weights carry the standard names would be misread silently by
    transformers: inspect says so (lowbit.load still reads it)."""
    out = tmp_path / "lb"
    lowbit.save(quantized_model("w4a16"), out, format="lowbit")
    assert inspect_checkpoint(out)["inconsistencies"] == []
    (out / "lowbit-model.safetensors").rename(out / "model.safetensors")
    r = inspect_checkpoint(out)
    assert len(r["inconsistencies"]) == 1
    assert "model.safetensors" in r["inconsistencies"][0] and "lowbit-model" in r["inconsistencies"][0]
    assert "uninitialised" in r["inconsistencies"][0]
    assert r["groups"][0]["layers"] == 14  # the layers were still read


def test_inspect_names_what_stock_loaders_do_with_misnamed_weight_files(tmp_path):
    """A lowbit-format folder whose weights sit in model.safetensors: transformers would load
    uninitialised layers; the layout says so (its own rule), nothing is said of a good folder."""
    out = tmp_path / "lb"
    lowbit.save(quantized_model("w8a16"), out, format="lowbit")
    assert inspect_checkpoint(out)["inconsistencies"] == []
    (out / "lowbit-model.safetensors").rename(out / "model.safetensors")
    text = "\n".join(inspect_checkpoint(out)["inconsistencies"])
    assert "'lowbit' format weights belong in lowbit-model*.safetensors" in text
    assert "would load uninitialised weights for its layers" in text
