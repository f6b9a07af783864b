"""Which tensors model-free quantization quantizes: exact rules from config.json, names and shapes
(the same linears lowbit.targets finds on the built model), and the streaming shard writer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lowbit.errors import FormatError
from lowbit.modelfree import Checkpoint, Kind, make_plan
from lowbit.modelfree.stwriter import StreamingShardWriter
from lowbit.schemes import get_scheme
from lowbit.targets import quantizable_linears

TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=64)


def _arch(name: str):
    import transformers as tf

    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**TINY, tie_word_embeddings=True))
    if name == "qwen2":  # biases on q/k/v, untied head
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**TINY, tie_word_embeddings=False))
    if name == "phi3":  # fused qkv_proj and gate_up_proj
        return tf.Phi3ForCausalLM(tf.Phi3Config(**TINY, pad_token_id=0))
    if name == "gpt_neox":  # embed_out head, query_key_value, dense_h_to_4h
        c = dict(TINY)
        c.pop("num_key_value_heads")
        return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**c))
    raise KeyError(name)


def _plan(folder: Path, scheme="nvfp4a16", **kw):
    return make_plan(Checkpoint(folder), get_scheme(scheme), **kw)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3", "gpt_neox"])
def test_same_linears_as_the_built_model(arch, tmp_path):
    torch.manual_seed(0)
    model = _arch(arch)
    model.save_pretrained(tmp_path)
    linears = quantizable_linears(model)
    assert sorted(_plan(tmp_path).quantized) == sorted(linears)
    # the head under its checkpoint name (transformers 5 calls GPT-NeoX's embed_out lm_head in memory)
    head = "embed_out" if arch == "gpt_neox" else "lm_head"
    assert sorted(_plan(tmp_path, include_lm_head=True).quantized) == sorted(linears + [head])
    assert quantizable_linears(model, include_lm_head=True) == linears + ["lm_head"]


def _write(folder: Path, shapes: dict[str, tuple[int, ...]], config: dict, dtype=torch.float32) -> Path:
    folder.mkdir()
    save_file({k: torch.ones(s, dtype=dtype) for k, s in shapes.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_exact_rules_on_names_and_shapes(tmp_path):
    V, H = 256, 32
    shapes = {
        "model.embed_tokens.weight": (V, H),
        "model.layers.0.input_layernorm.weight": (H,),
        "model.layers.0.attention.output.dense.weight": (H, H),       # "output" inside a block: a linear
        "model.layers.0.attention.output.dense.bias": (H,),
        "model.layers.0.attn.head_proj.weight": (H, H),               # "head" substring: a linear
        "model.layers.0.block_sparse_moe.gate.weight": (4, H),        # MoE router: float
        "model.layers.0.block_sparse_moe.experts.0.w1.weight": (2 * H, H),
        "model.layers.0.block_sparse_moe.experts.0.w3.weight": (2 * H, H),
        "model.layers.0.block_sparse_moe.experts.0.w2.weight": (H, 2 * H),
        "model.layers.0.block_sparse_moe.experts.1.w1.weight": (2 * H, H),
        "model.vision_tower.layers.0.fc1.weight": (H, H),              # non-text tower: float
        "model.layers.0.conv.weight": (H, 1, 4),                       # not 2-D
        "model.pos_table.weight": (V, H),                              # unnamed top-level vocab table
        "output.weight": (V, H),                                       # InternLM2 head
    }
    src = _write(tmp_path / "src", shapes, {"model_type": "custom", "vocab_size": V})
    plan = _plan(src, ignore=[r"model\.layers\.0\.attn\..*"])
    kinds = {it.src.info.name: it.kind for it in plan.shards["model.safetensors"]}
    q = {n for n, k in kinds.items() if k is Kind.QUANTIZE}
    assert q == {
        "model.layers.0.attention.output.dense.weight",
        "model.layers.0.block_sparse_moe.experts.0.w1.weight", "model.layers.0.block_sparse_moe.experts.0.w3.weight",
        "model.layers.0.block_sparse_moe.experts.0.w2.weight", "model.layers.0.block_sparse_moe.experts.1.w1.weight",
    }
    assert set(kinds) == set(shapes)  # everything else is copied
    assert set(plan.ignored) == {"model.layers.0.attn.head_proj", "model.layers.0.block_sparse_moe.gate",
                                 "model.vision_tower.layers.0.fc1", "output"}
    # NVFP4 global scales: one per fused group (w1/w3 of the same expert), singletons otherwise
    groups = {it.name: sorted(s.info.name for s in it.group) for it in plan.shards["model.safetensors"]
              if it.kind is Kind.QUANTIZE}
    e0 = "model.layers.0.block_sparse_moe.experts.0"
    assert groups[f"{e0}.w1"] == groups[f"{e0}.w3"] == [f"{e0}.w1.weight", f"{e0}.w3.weight"]
    assert groups["model.layers.0.block_sparse_moe.experts.1.w1"] == [
        "model.layers.0.block_sparse_moe.experts.1.w1.weight"]
    plan = _plan(src, include_lm_head=True)
    assert "output" in plan.quantized


def test_refused_sources(tmp_path):
    with pytest.raises(FormatError, match="Conv1D"):
        _plan(_write(tmp_path / "gpt2", {"h.0.attn.c_attn.weight": (32, 96)}, {"model_type": "gpt2"}))
    with pytest.raises(FormatError, match="already quantized.*gptq"):
        _plan(_write(tmp_path / "gptq", {"a.weight": (32, 32)},
                     {"model_type": "llama", "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(FormatError, match="fp8_no_scale.*F8_E4M3|no .*weight_scale_inv"):
        _plan(_write(tmp_path / "fp8_no_scale", {"a.weight": (32, 32)},
                     {"model_type": "llama", "quantization_config": {"quant_method": "fp8",
                                                                     "weight_block_size": [16, 16]}},
                     dtype=torch.float8_e4m3fn))
    with pytest.raises(FormatError, match="a.weight.*dtype I8"):
        _plan(_write(tmp_path / "int", {"a.weight": (32, 32)}, {"model_type": "llama"}, dtype=torch.int8))


def test_streaming_writer_matches_safetensors(tmp_path):
    tensors = {"b.weight": torch.randn(7, 5, dtype=torch.bfloat16), "a.scale": torch.tensor([3.0]),
               "c.codes": torch.randint(0, 255, (4, 6), dtype=torch.uint8), "d.empty": torch.zeros(0, 3),
               "e.fp8": torch.randn(3, 3).to(torch.float8_e4m3fn), "f.scalar": torch.tensor(2.5)}
    for reserve in (4096, 16):  # room for the header, and too little: the data is moved once
        path = tmp_path / f"r{reserve}.safetensors"
        w = StreamingShardWriter(path, reserve)
        for k, v in tensors.items():
            w.add(k, v)
        size = w.finish()
        assert size == path.stat().st_size and not list(tmp_path.glob("*.partial*"))
        back = load_file(str(path))
        assert list(back) == sorted(tensors) or set(back) == set(tensors)
        for k, v in tensors.items():
            assert back[k].dtype == v.dtype and back[k].shape == v.shape
            assert torch.equal(back[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
        with safe_open(str(path), "pt") as f:
            assert f.metadata() == {"format": "pt"}


@pytest.mark.parametrize("kernel_copy", [True, False])
def test_streaming_writer_raw_copy_and_parts(tmp_path, monkeypatch, kernel_copy):
    """Tensors copied byte for byte from a source shard (kernel copy or plain reads), and a shard
    assembled from data-only parts: the same bytes as writing it in one go."""
    import os

    from lowbit.modelfree.source import read_header
    from lowbit.modelfree.stwriter import assemble

    if not kernel_copy:
        def refuse(*a, **k):
            raise OSError("no copy_file_range here")
        monkeypatch.setattr(os, "copy_file_range", refuse)
    src = tmp_path / "src.safetensors"
    save_file({"x": torch.randn(300, 7), "y": torch.arange(5, dtype=torch.int64)}, str(src))
    infos, _ = read_header(src)
    tensors = {"a": torch.randn(3, 4, dtype=torch.bfloat16), "b": torch.tensor([1.5])}

    def write(w):
        w.add("a", tensors["a"])
        for n in ("x", "y"):
            i = infos[n]
            w.add_raw(n, i.dtype, i.shape, src, i.data_start + i.begin, i.nbytes)
        w.add("b", tensors["b"])

    whole = tmp_path / "whole.safetensors"
    w = StreamingShardWriter(whole, 1024)
    write(w)
    w.finish()
    back = load_file(str(whole))
    ref = load_file(str(src))
    assert torch.equal(back["x"], ref["x"]) and torch.equal(back["y"], ref["y"])
    assert torch.equal(back["a"], tensors["a"]) and torch.equal(back["b"], tensors["b"])
    p1, p2 = StreamingShardWriter(tmp_path / "p1", 0, data_only=True), StreamingShardWriter(tmp_path / "p2", 0,
                                                                                           data_only=True)
    p1.add("a", tensors["a"])
    i = infos["x"]
    p1.add_raw("x", i.dtype, i.shape, src, i.data_start + i.begin, i.nbytes)
    i = infos["y"]
    p2.add_raw("y", i.dtype, i.shape, src, i.data_start + i.begin, i.nbytes)
    p2.add("b", tensors["b"])
    p1.finish(), p2.finish()
    joined = tmp_path / "joined.safetensors"
    assemble(joined, 1024, [(tmp_path / "p1", p1.entries_meta()), (tmp_path / "p2", p2.entries_meta())])
    assert joined.read_bytes() == whole.read_bytes()
