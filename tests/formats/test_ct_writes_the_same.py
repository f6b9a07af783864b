"""lowbit's compressed-tensors output for the CT presets matches what compressed-tensors itself
writes: the same tensor names, dtypes, shapes and values, the same config fields. compressed-tensors
is given lowbit's scales (it has no observer of its own without llm-compressor) and compresses the
model with its own ModelCompressor."""

from __future__ import annotations

import json

import pytest
import torch

import lowbit
from helpers.models import tiny_llama
from lowbit.files.folder import SafetensorsFolder
from lowbit.formats.lowbit_layout import file_scale
from lowbit.quant import quantize
from lowbit.schemes import PRESETS

pytest.importorskip("compressed_tensors")
FIELDS = ("num_bits", "type", "symmetric", "group_size", "strategy", "dynamic", "block_structure")


def _ct_folder(preset: str, scheme: str, out, dims: dict):
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme

    model = tiny_llama(**dims)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])}, ignore=["lm_head"]))
    spec = PRESETS[scheme].weights
    with torch.no_grad():
        for _, m in model.named_modules():
            if hasattr(m, "weight_scale"):
                qt = quantize(m.weight.float(), spec)
                m.weight_scale.copy_(file_scale(qt.scale, spec).reshape(m.weight_scale.shape).to(m.weight_scale.dtype))
                if qt.zero_point is not None:
                    m.weight_zero_point.copy_(qt.zero_point.reshape(m.weight_zero_point.shape))
    comp = ModelCompressor.from_pretrained_model(model)
    comp.compress_model(model)
    model.save_pretrained(out)
    comp.update_config(out)
    return out


@pytest.mark.parametrize("preset,scheme", [("W4AFP8", "w4a8-fp8"), ("W4A8", "w4a8-int8"), ("W4A16_ASYM", "w4a16-asym"),
                                           ("MXFP6A16", "mxfp6-e2m3"), ("MXFP6A8", "mxfp6-mxfp8"),
                                           ("FP8_BLOCK", "fp8-block"), ("FP8_BLOCK", "fp8-block-ragged")])
# (compressed-tensors' MXFP4XFP8 is not lowbit's mxfp4-mxfp8: its activations are FP8 per group of 128
# with float scales, not MXFP8 (group 32, E8M0) as the preset's name says here)
def test_lowbit_writes_what_compressed_tensors_writes(preset, scheme, tmp_path):
    dims = {"hidden_size": 128, "intermediate_size": 256}
    if scheme == "fp8-block-ragged":  # 192 and 320 are not multiples of 128: ceil-shaped block scales
        scheme, dims = "fp8-block", {"hidden_size": 192, "intermediate_size": 320}
    theirs = _ct_folder(preset, scheme, tmp_path / "ct", dims)
    ours = lowbit.save(lowbit.quantize(tiny_llama(**dims), scheme), tmp_path / "lb", format="compressed-tensors")
    a, b = SafetensorsFolder(theirs), SafetensorsFolder(ours)
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k
    ca = json.loads((theirs / "config.json").read_text())["quantization_config"]
    cb = json.loads((ours / "config.json").read_text())["quantization_config"]
    assert ca["format"] == cb["format"]
    ga, gb = ca["config_groups"]["group_0"], cb["config_groups"]["group_0"]
    assert ga["format"] == gb["format"] and ga["targets"] == gb["targets"]
    for part in ("weights", "input_activations"):
        if ga[part] is None:
            assert gb[part] is None
            continue
        assert {f: ga[part].get(f) for f in FIELDS} == {f: gb[part].get(f) for f in FIELDS}, part
