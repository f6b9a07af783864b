"""A real client reads our compressed-tensors files.

1. transformers' AutoModelForCausalLM.from_pretrained (with the compressed-tensors package), in a
   subprocess that never imports lowbit, loads folders written by lowbit.save for w8a8-int8,
   w8a8-fp8, nvfp4 and w4a16; its logits match lowbit's reference backend.
2. compressed-tensors' own decompressors turn our tensors into exactly our dequantized weights.

Measured numerics differences that are not format differences (and so set the tolerances):
- float32 models (int8, fp8, int4): identical logits.
- NVFP4 must be loaded in bf16 by transformers (its decompressed weights are bf16, formats.md).
  Weight-only (nvfp4a16) agrees to bf16 rounding. With FP4 activations compressed-tensors rounds
  amax/6 to bf16 before scaling and rounding the block scale to FP8, where lowbit rounds once from
  float32, so a few activation block scales (and their codes) differ: a looser bound there.
"""

from __future__ import annotations

import json

import pytest
import torch

import lowbit
from lowbit.formats import get_layout
from lowbit.files.folder import SafetensorsFolder
from lowbit.quant import dequantize
from helpers.ct_client import assert_close_logits, client_logits
from helpers.formats_support import logits, quant_layers, quantized_model

pytest.importorskip("compressed_tensors")

# scheme -> (model dtype, tiny_llama overrides, max |diff| allowed relative to max |logit|)
CASES = {
    # (w4a16-asym is not here: transformers 5.24 builds its zero points unpacked, [out, G], and refuses
    # compressed-tensors' packed [out/8, G], for the folder compressed-tensors writes itself too;
    # tests/formats/test_ct_writes_the_same.py checks that lowbit writes exactly that folder)
    "w8a8-int8": (torch.float32, {}, 1e-5),  # measured: identical (0.0)
    "w8a8-fp8": (torch.float32, {}, 1e-5),   # measured: identical
    "w4a16": (torch.float32, {"hidden_size": 128, "intermediate_size": 256}, 1e-5),  # measured: identical
    "w4a8-int8": (torch.float32, {"hidden_size": 128, "intermediate_size": 256}, 0.05),  # CT: dynamic int8 amax/127.5
    "w4a8-fp8": (torch.float32, {"hidden_size": 128, "intermediate_size": 256}, 1e-5),
    "fp8-block": (torch.float32, {"hidden_size": 128, "intermediate_size": 256}, 1e-5),
    "mxfp6-e2m3": (torch.bfloat16, {}, 0.01),  # transformers runs MX folders in bf16
    "mxfp6-mxfp8": (torch.bfloat16, {}, 0.15),
    "mxfp4-mxfp8": (torch.bfloat16, {}, 0.15),
    "nvfp4a16": (torch.bfloat16, {}, 0.01),  # bf16 weights exact; bf16 matmul rounding only
    "nvfp4": (torch.bfloat16, {}, 0.15),
}


@pytest.mark.subprocess
def test_transformers_loads_our_compressed_tensors_folders(tmp_path):
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    refs, folders = {}, {}
    for name, (dtype, overrides, _) in CASES.items():
        model = quantized_model(name, dtype=dtype, **overrides)
        lowbit.use_backend(model, "reference")
        refs[name] = logits(model, ids).float()
        lowbit.save(model, tmp_path / name, format="compressed-tensors")
        folders[name] = (str(tmp_path / name), str(dtype).removeprefix("torch."))
    got = client_logits(tmp_path, ids, folders)
    assert_close_logits(got, refs, CASES)
    for name, (_, _, rel) in CASES.items():
        scale = refs[name].abs().max().item()
        if rel > 0.01:  # loose only where the activation arithmetic differs; still close on average
            assert (got[name] - refs[name]).abs().mean().item() < 0.02 * scale, name


@pytest.mark.parametrize("name", ["w8a8-int8", "w8a8-int8-dynamic", "w8a8-fp8", "w8a8-fp8-dynamic", "nvfp4",
                                  "nvfp4a16", "mxfp4", "mxfp8", "w8a16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compressed_tensors_decompression_equals_ours(name, dtype, tmp_path):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    model = quantized_model(name, dtype=dtype)
    if dtype is not torch.float32:  # compressed-tensors stores int/fp8 scales in the model dtype
        for m in quant_layers(model).values():
            if not m.scheme.weights.is_microscaled:
                m.weight_scale = m.weight_scale.to(dtype).float()
            if m.input_scale is not None:
                m.input_scale = m.input_scale.to(dtype).float()
    lowbit.save(model, tmp_path / "ck", format="compressed-tensors")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())["quantization_config"]["config_groups"]
    g = cfg["group_0"]
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**g["weights"]),
                                input_activations=None if g["input_activations"] is None
                                else QuantizationArgs(**g["input_activations"]))
    compressor = BaseCompressor.get_value_from_registry(g["format"])
    folder = SafetensorsFolder(tmp_path / "ck")
    for n, m in quant_layers(model).items():
        sd = {k[len(n) + 1:]: folder[k] for k in folder if k.startswith(n + ".") and k.count(".") == n.count(".") + 1}
        theirs = compressor.decompress(sd, scheme)["weight"]
        ours = dequantize(m.weight_qtensor(), theirs.dtype)
        assert torch.equal(theirs, ours), (name, n)


def test_e5m3_has_no_compressed_tensors_layout():
    with pytest.raises(lowbit.errors.FormatError, match="nvfp4-e5m3.*no standard compressed-tensors layout"):
        get_layout("compressed-tensors").check_scheme(lowbit.get_scheme("nvfp4-e5m3"))
