"""Other tools' mixed-precision folders read as lowbit reads its own: an auto-round folder whose
``extra_config`` gives the down projections 8 bits (what AutoScheme writes) loads every layer
under its own scheme, bit for bit."""

from __future__ import annotations

import re

import torch

import lowbit
from helpers.formats_support import float_tensors, llama_config, logits, quant_layers, write_folder
from helpers.models import tiny_llama
from lowbit.checkpoint.inspect import inspect_checkpoint
from lowbit.schemes import PRESETS, QuantSpec, Scheme, WeightObserver

IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
INT8_G128 = Scheme("auto-round-int-w8", QuantSpec("int8", "group", 128, observer=WeightObserver.FULL_RANGE), None)


def test_auto_round_mixed_bits_folder_reads_each_layer_under_its_scheme(tmp_path):
    from formats.test_read_gptq import gptq_tensors  # auto_gptq packing of a lowbit QuantizedTensor

    ref = lowbit.quantize(tiny_llama(), {r"re:.*down_proj": INT8_G128.to_dict(), "default": "w4a16"})
    lowbit.use_backend(ref, "reference")
    tensors = float_tensors(tiny_llama())
    for n, m in quant_layers(ref).items():
        del tensors[f"{n}.weight"]
        tensors.update(gptq_tensors(n, m.weight_qtensor(), 128))
    downs = [n for n in quant_layers(ref) if n.endswith("down_proj")]
    qcfg = {"quant_method": "auto-round", "packing_format": "auto_round:auto_gptq", "data_type": "int", "bits": 4,
            "group_size": 128, "sym": True, "iters": 0, "block_name_to_quantize": "model.layers",
            "extra_config": {n: {"bits": 8, "group_size": 128, "sym": True, "data_type": "int"} for n in downs}}
    folder = write_folder(tmp_path / "ar", llama_config(quantization_config=qcfg), tensors)
    loaded = lowbit.load(folder, backend="reference")
    got = quant_layers(loaded)
    assert {n: m.scheme.weights.bits for n, m in got.items()} == \
        {n: 8 if re.match(r".*down_proj", n) else 4 for n in quant_layers(ref)}
    for n, m in got.items():
        assert m.weight_qtensor().equal(quant_layers(ref)[n].weight_qtensor()), n
    assert got[downs[0]].scheme == INT8_G128 and got["model.layers.0.self_attn.q_proj"].scheme is PRESETS["w4a16"]
    assert torch.equal(logits(loaded, IDS), logits(ref, IDS))
    rep = inspect_checkpoint(folder)
    assert rep["inconsistencies"] == [] and rep["average_bits"] > 4.2
