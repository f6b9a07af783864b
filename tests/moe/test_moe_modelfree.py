"""Model-free quantization of MoE checkpoints equals the in-memory path, expert for expert."""

from __future__ import annotations

import pytest
import torch

import lowbit
from helpers.eval_fixtures import byte_tokenizer
from helpers.moe_models import tiny_moe
from lowbit.errors import FormatError
from lowbit.files.folder import SafetensorsFolder
from lowbit.modelfree import quantize_checkpoint

torch.set_grad_enabled(False)


def _source(tmp_path, family):
    src = tmp_path / family
    tiny_moe(family).save_pretrained(src)  # transformers writes experts per expert (Mixtral: w1/w2/w3)
    byte_tokenizer().save_pretrained(src)
    return src


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
@pytest.mark.parametrize("scheme", ["nvfp4a16", "w8a8-int8-dynamic"])
def test_model_free_equals_in_memory(tmp_path, family, scheme):
    src = _source(tmp_path, family)
    quantize_checkpoint(src, tmp_path / "mf", scheme, format="compressed-tensors")
    model, _ = lowbit.load_model(src)
    lowbit.save(lowbit.quantize(model, scheme), tmp_path / "mem", format="compressed-tensors")
    mf, mem = SafetensorsFolder(tmp_path / "mf"), SafetensorsFolder(tmp_path / "mem")
    assert set(mf) == set(mem)
    expert_keys = [k for k in mf if ".experts." in k]
    assert len(expert_keys) >= 8 * 3 * 2  # every expert's linears, with their scales
    for k in mf:
        assert torch.equal(mf[k], mem[k]), k


def test_fused_experts_on_disk_are_refused_not_copied(tmp_path):
    src = _source(tmp_path, "gpt_oss")
    with pytest.raises(FormatError, match=r"experts\.down_proj' \[8, 128, 128\] holds fused experts.*in memory"):
        quantize_checkpoint(src, tmp_path / "mf", "w8a16")
    assert not (tmp_path / "mf").exists()
    # the in-memory path splits them: every expert quantized, and the output loads
    model, _ = lowbit.load_model(src)
    out = lowbit.save(lowbit.quantize(model, "w8a16"), tmp_path / "mem", format="compressed-tensors")
    assert "model.layers.1.mlp.experts.7.down_proj.weight_scale" in SafetensorsFolder(out)
    back = lowbit.load(out)
    ids = torch.randint(0, 256, (1, 12))
    assert torch.equal(back(input_ids=ids).logits, model(input_ids=ids).logits)
