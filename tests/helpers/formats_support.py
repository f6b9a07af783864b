"""Helpers shared by the checkpoint-format tests (no tests here): tiny quantized models with
shared static scales, comparisons of quantized layers, and writing folders by hand."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from helpers.models import tiny_llama
from lowbit.fusion import fused_groups
from lowbit.model_quant import every_linear, quantize_rtn
from lowbit.modules import QuantLinear
from lowbit.schemes import Dynamic, Scheme, get_scheme


def quant_layers(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def tiny_llama_as(dtype: torch.dtype, seed: int = 0, **overrides):
    """tiny_llama in ``dtype``, as transformers builds it in that dtype (rotary buffers stay float32)."""
    model = tiny_llama(seed=seed, **overrides)
    if dtype != torch.float32:
        rot = model.model.rotary_emb
        keep = {n: b.clone() for n, b in rot.named_buffers()}
        model.to(dtype)
        for n, b in keep.items():
            setattr(rot, n, b)
    return model


def quantized_model(scheme: str | Scheme, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """tiny_llama quantized by RTN; static input scales set per fused group (shared by q/k/v and
    gate/up, different between groups), as calibration would."""
    model = tiny_llama_as(dtype, seed=seed, **overrides)
    s = get_scheme(scheme)
    quantize_rtn(model, every_linear(model, s))
    a = s.input_activations
    layers = quant_layers(model)
    for i, group in enumerate(fused_groups(list(layers))):
        kw = {}
        if a is not None and a.dynamic is Dynamic.STATIC:
            kw["input_scale"] = torch.tensor([0.011 * (i % 5 + 1) + 0.0003])
        if a is not None and a.global_scale:
            kw["input_global_scale"] = torch.tensor([97.3 + 13 * (i % 4)])
        for n in group:
            layers[n].set_input_scales(**kw)
    return model


def assert_same_layers(a, b) -> None:
    """Bit-identical quantized weights, static scales, biases and dtypes, layer by layer."""
    la, lb = quant_layers(a), quant_layers(b)
    assert list(la) == list(lb)
    for n in la:
        x, y = la[n], lb[n]
        assert x.scheme == y.scheme, n
        assert x.weight_qtensor().equal(y.weight_qtensor()), n
        for attr in ("input_scale", "input_global_scale"):
            u, v = getattr(x, attr), getattr(y, attr)
            assert (u is None) == (v is None), (n, attr)
            if u is not None:
                assert u.dtype == v.dtype and torch.equal(u, v), (n, attr)
        assert (x.bias is None) == (y.bias is None)
        if x.bias is not None:
            assert torch.equal(x.bias, y.bias)
        assert x.dtype == y.dtype


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def write_folder(path: Path, config: dict, tensors: dict[str, torch.Tensor], shards: int = 1) -> Path:
    """A checkpoint folder written by hand (as another tool would): config.json + safetensors."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    names = sorted(tensors)
    if shards == 1:
        save_file({k: tensors[k].contiguous() for k in names}, str(path / "model.safetensors"))
        return path
    wm = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, str(path / fname))
        wm.update({k: fname for k in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": wm}))
    return path


def llama_config(dtype: str = "float32", **overrides) -> dict:
    """config.json of tiny_llama (as transformers writes it)."""
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=64,
               intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=128, tie_word_embeddings=True, rms_norm_eps=1e-6, hidden_act="silu",
               dtype=dtype)
    cfg.update(overrides)
    return cfg


def float_tensors(model, dtype=None) -> dict[str, torch.Tensor]:
    """A float model's tensors as a checkpoint stores them (tied lm_head left out)."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    if dtype is not None:
        sd = {k: v.to(dtype) for k, v in sd.items()}
    return sd
