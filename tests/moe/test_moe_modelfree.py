"""Model-free quantization of MoE checkpoints equals the in-memory path, expert for expert."""

from __future__ import annotations

import json

import pytest
import torch

import lowbit
from helpers.eval_fixtures import byte_tokenizer
from helpers.moe_models import tiny_moe
from lowbit.errors import FormatError
from lowbit.files.folder import SafetensorsFolder
from lowbit.modelfree import quantize_model_free
from lowbit.quant import dequantize, quantize

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
    quantize_model_free(src, tmp_path / "mf", scheme, format="compressed-tensors")
    model, _ = lowbit.load_model(src)
    lowbit.save(lowbit.quantize(model, scheme), tmp_path / "mem", format="compressed-tensors")
    mf, mem = SafetensorsFolder(tmp_path / "mf"), SafetensorsFolder(tmp_path / "mem")
    assert set(mf) == set(mem)
    expert_keys = [k for k in mf if ".experts." in k]
    assert len(expert_keys) >= 8 * 3 * 2  # every expert's linears, with their scales
    for k in mf:
        assert torch.equal(mf[k], mem[k]), k


@pytest.mark.parametrize("scheme", ["nvfp4a16", "w8a16"])
def test_fused_experts_on_disk_are_split_per_expert_as_in_memory(tmp_path, scheme):
    """gpt-oss keeps its experts fused on disk ([E, H, 2I] interleaved, with biases): model-free
    splits them exactly as the in-memory path does."""
    src = _source(tmp_path, "gpt_oss")
    assert "model.layers.0.mlp.experts.gate_up_proj" in SafetensorsFolder(src)
    quantize_model_free(src, tmp_path / "mf", scheme, format="compressed-tensors")
    model, _ = lowbit.load_model(src)
    lowbit.save(lowbit.quantize(model, scheme), tmp_path / "mem", format="compressed-tensors")
    mf, mem = SafetensorsFolder(tmp_path / "mf"), SafetensorsFolder(tmp_path / "mem")
    assert set(mf) == set(mem)
    assert {"model.layers.1.mlp.experts.7.gate_proj.bias", "model.layers.1.mlp.experts.7.down_proj.weight_scale"} <= set(mf)
    assert not any(k.endswith(("gate_up_proj", "gate_up_proj_bias")) for k in mf)
    for k in mf:
        assert torch.equal(mf[k], mem[k]), k
    ids = torch.randint(0, 256, (1, 12))
    assert torch.equal(lowbit.load(tmp_path / "mf")(input_ids=ids).logits, lowbit.load(tmp_path / "mem")(input_ids=ids).logits)


def test_ignored_fused_experts_are_written_per_expert_in_float(tmp_path):
    src = _source(tmp_path, "gpt_oss")
    quantize_model_free(src, tmp_path / "mf", "w8a16", ignore=[r"model\.layers\.0\.mlp\.experts\..*"])
    mf = SafetensorsFolder(tmp_path / "mf")
    assert mf["model.layers.0.mlp.experts.3.down_proj.weight"].dtype == torch.float32
    assert "model.layers.1.mlp.experts.3.down_proj.weight_codes" in mf
    lowbit.load(tmp_path / "mf")  # loads: every expert under its own name


def test_fused_experts_of_an_unknown_layout_are_refused_not_copied(tmp_path):
    """A fused experts tensor of a family whose on-disk layout lowbit does not know is an error."""
    src = _source(tmp_path, "gpt_oss")
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "gpt_oss_unknown"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FormatError, match=r"experts\.down_proj' \[8, 128, 128\] holds fused experts.*in memory"):
        quantize_model_free(src, tmp_path / "mf", "w8a16")
    assert not (tmp_path / "mf").exists()


def _mxfp4_gpt_oss_source(tmp_path):
    """A gpt-oss folder in its own MXFP4 layout (experts as *_blocks / *_scales, [out, in] rows),
    and the float model holding exactly the values it decodes to."""
    from safetensors.torch import save_file

    from lowbit.quant import pack_nibbles
    from lowbit.schemes import PRESETS

    model = tiny_moe("gpt_oss")
    spec = PRESETS["mxfp4"].weights
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            ex = layer.mlp.experts
            for name in ("gate_up_proj", "down_proj"):
                w = getattr(ex, name)                      # [E, in, out] (transposed in the model)
                rows = w.transpose(1, 2).contiguous()      # [E, out, in], as the checkpoint stores it
                qt = quantize(rows.reshape(-1, rows.shape[-1]), spec)
                deq = dequantize(qt).reshape(rows.shape)
                w.copy_(deq.transpose(1, 2))
                e, o, n = rows.shape
                key = f"model.layers.{i}.mlp.experts.{name}"
                sd.pop(key)
                sd[key + "_blocks"] = pack_nibbles(qt.codes).reshape(e, o, n // 32, 16)
                sd[key + "_scales"] = qt.scale_codes().reshape(e, o, n // 32)
    src = tmp_path / "mx"
    src.mkdir()
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                     "model.layers.*.mlp.router"]}
    (src / "config.json").write_text(json.dumps(cfg))
    byte_tokenizer().save_pretrained(src)
    return src, model


def test_gpt_oss_mxfp4_checkpoint_is_dequantized_per_expert_and_quantized(tmp_path):
    src, deq = _mxfp4_gpt_oss_source(tmp_path)
    quantize_model_free(src, tmp_path / "mf", "w8a16", format="compressed-tensors")
    lowbit.save(lowbit.quantize(deq, "w8a16"), tmp_path / "mem", format="compressed-tensors")
    mf, mem = SafetensorsFolder(tmp_path / "mf"), SafetensorsFolder(tmp_path / "mem")
    assert set(mf) == set(mem) and not any(k.endswith(("_blocks", "_scales")) for k in mf)
    for k in mf:
        assert torch.equal(mf[k], mem[k]), k
    cfg = json.loads((tmp_path / "mf" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
