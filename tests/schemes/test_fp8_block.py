"""fp8-block: E4M3 weights in 128 x 128 tiles with fp32 scales (ragged tiles at the edges), E4M3
per-token groups of 128 for activations; the same numbers in memory, model-free and every format."""

from __future__ import annotations

import json

import pytest
import torch

import lowbit
from helpers.eval_fixtures import byte_tokenizer
from helpers.folders import assert_same_tensors, folder_tensors
from helpers.models import tiny_llama
from lowbit.errors import FormatError, SchemeError
from lowbit.files.folder import SafetensorsFolder
from lowbit.quant import dequantize, quantize
from lowbit.schemes import PRESETS, Granularity, QuantSpec

torch.set_grad_enabled(False)
SPEC = PRESETS["fp8-block"].weights
RAGGED = {"hidden_size": 192, "intermediate_size": 320}  # neither a multiple of 128


def test_tile_scales_are_the_tile_amax_over_448_and_shared_by_its_rows():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 260, generator=g)
    w[5, 7], w[299, 259] = 40.0, -9.0
    qt = quantize(w, SPEC)
    assert qt.scale.shape == (300, 3)
    for r0, r1 in ((0, 128), (128, 256), (256, 300)):
        for c0, c1, gi in ((0, 128, 0), (128, 256, 1), (256, 260, 2)):
            tile = w[r0:r1, c0:c1]
            want = tile.abs().amax() / 448.0
            assert torch.equal(qt.scale[r0:r1, gi], want.expand(r1 - r0)), (r0, c0)
    assert float(qt.scale[0, 0]) == float(torch.tensor(40.0) / 448) and float(qt.scale[299, 2]) == float(torch.tensor(9.0) / 448)
    d = dequantize(qt)
    assert d[5, 7] == 40.0 and d[299, 259] == -9.0  # each tile's extreme is exact


def test_block_specs_are_static_symmetric_max_fp32():
    with pytest.raises(SchemeError, match="block granularity"):
        QuantSpec("e4m3", Granularity.BLOCK, 128, observer="mse")
    with pytest.raises(SchemeError, match="positive group_size"):
        QuantSpec("e4m3", Granularity.BLOCK)
    assert SPEC.describe().startswith("e4m3, block 128x128")


@pytest.mark.parametrize("fmt", ["lowbit", "fake", "compressed-tensors"])
def test_ragged_round_trips_exact(fmt, tmp_path):
    q = lowbit.quantize(tiny_llama(**RAGGED), "fp8-block")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    out = lowbit.save(q, tmp_path / fmt, format=fmt)
    back = lowbit.load(out)
    assert torch.equal(back(input_ids=ids).logits, q(input_ids=ids).logits)
    if fmt != "fake":
        sk = "model.layers.0.mlp.down_proj.weight_scale"  # [192, 320]: ceil -> [2, 3]
        assert SafetensorsFolder(out)[sk].shape == (2, 3)
        assert torch.equal(back.model.layers[0].mlp.down_proj.weight_qtensor().scale,
                           q.model.layers[0].mlp.down_proj.weight_qtensor().scale)
    if fmt == "compressed-tensors":
        w = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
        assert w["weights"]["strategy"] == "block" and w["weights"]["block_structure"] == [128, 128]
        assert w["input_activations"]["strategy"] == "group" and w["input_activations"]["group_size"] == 128


def test_model_free_equals_in_memory_across_row_bands(tmp_path):
    from lowbit.modelfree import RunOptions, quantize_model_free

    model = tiny_llama(**RAGGED)
    src = tmp_path / "src"
    model.save_pretrained(src)
    byte_tokenizer().save_pretrained(src)
    # bands of 128 rows (the smallest whole-tile band) against the in-memory whole tensor
    quantize_model_free(src, tmp_path / "mf", "fp8-block", format="compressed-tensors",
                        run_options=RunOptions(part_bytes=1 << 12))
    lowbit.save(lowbit.quantize(lowbit.load_model(src)[0], "fp8-block"), tmp_path / "mem", format="compressed-tensors")
    assert_same_tensors(folder_tensors(tmp_path / "mf"), folder_tensors(tmp_path / "mem"))


def test_an_fp8_source_is_not_rounded_twice(tmp_path):
    from lowbit.modelfree import quantize_model_free

    src = tmp_path / "src"
    tiny_llama().save_pretrained(src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match="already FP8.*second time"):
        quantize_model_free(src, tmp_path / "out", "fp8-block")
    assert not (tmp_path / "out").exists()


def test_gptq_keeps_the_tile_scales():
    model = tiny_llama(**RAGGED)
    calib = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(2))
    rtn = lowbit.quantize(tiny_llama(**RAGGED), "fp8-block")
    gq = lowbit.quantize(model, "fp8-block", calibration=calib, num_samples=4, seq_len=32, weight_rounding="gptq")
    a, b = rtn.model.layers[1].mlp.down_proj.weight_qtensor(), gq.model.layers[1].mlp.down_proj.weight_qtensor()
    assert not torch.equal(a.codes, b.codes)
    s = b.scale  # still one value per tile
    assert torch.equal(s[:128], s[:1].expand(128, -1)) and torch.equal(s[128:], s[128:129].expand(64, -1))


@pytest.mark.parametrize("scheme", ["w4a16-asym", "w4a8-fp8", "mxfp6-e2m3"])
def test_model_free_equals_in_memory_for_the_other_new_schemes(scheme, tmp_path):
    """(Their compressed-tensors layouts group rows too: zero points packed eight to an int32 down
    the output dimension.)"""
    from lowbit.modelfree import quantize_model_free

    model = tiny_llama(hidden_size=128, intermediate_size=256)
    src = tmp_path / "src"
    model.save_pretrained(src)
    byte_tokenizer().save_pretrained(src)
    quantize_model_free(src, tmp_path / "mf", scheme, format="compressed-tensors")
    lowbit.save(lowbit.quantize(lowbit.load_model(src)[0], scheme), tmp_path / "mem", format="compressed-tensors")
    assert_same_tensors(folder_tensors(tmp_path / "mf"), folder_tensors(tmp_path / "mem"))


def test_a_bf16_model_saves_to_compressed_tensors_with_its_tile_scales_checked(tmp_path):
    """The rounded-scale check compares the tile scales as the file holds them (one per tile)."""
    q = lowbit.quantize(tiny_llama(**RAGGED).to(torch.bfloat16), "fp8-block")
    with pytest.warns(UserWarning, match="scales .* not exactly representable in bfloat16"):
        out = lowbit.save(q, tmp_path / "ct", format="compressed-tensors")
    assert SafetensorsFolder(out)["model.layers.0.mlp.down_proj.weight_scale"].shape == (2, 3)
    lowbit.load(out)
