"""Which tensors model-free quantization quantizes: exact rules from config.json, names and shapes
(the same linears lowbit.targets finds on the built model), and the streaming shard writer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lowbit.errors import FormatError, LowbitError
from lowbit.modelfree import Checkpoint, Kind, make_plan
from lowbit.modelfree.outshape import ShardFile
from lowbit.recipes import Assignment
from lowbit.files.regions import RegionWriter, create_shard_file, shard_file_matches
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
    return make_plan(Checkpoint(folder), Assignment.for_all(get_scheme(scheme)), **kw)


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


def _entries(tensors):
    from lowbit.modelfree.outshape import Entry
    from lowbit.files.folder import DTYPE_NAMES

    return [Entry(k, DTYPE_NAMES[v.dtype], tuple(v.shape), v.numel() * v.element_size()) for k, v in tensors.items()]


def test_shard_written_in_place_matches_safetensors(tmp_path):
    """A shard created at its final size and header, then filled by two writers (in either order,
    each owning a run of entries): safetensors reads back every tensor, dtype and shape."""
    tensors = {"b.weight": torch.randn(7, 5, dtype=torch.bfloat16), "a.scale": torch.tensor([3.0]),
               "c.codes": torch.randint(0, 255, (4, 6), dtype=torch.uint8), "d.empty": torch.zeros(0, 3),
               "e.fp8": torch.randn(3, 3).to(torch.float8_e4m3fn), "f.scalar": torch.tensor(2.5)}
    entries = _entries(tensors)
    sf = ShardFile.of(entries)
    assert len(sf.header) % 8 == 0 and sf.size == len(sf.header) + sum(e.nbytes for e in entries)
    files = []
    for order in ((0, 1), (1, 0)):
        path = tmp_path / f"o{order[0]}.safetensors"
        create_shard_file(path, sf.header, sf.size)
        assert shard_file_matches(path, sf.header, sf.size)
        runs = [list(tensors.items())[:3], list(tensors.items())[3:]]
        for k in order:
            first = 0 if k == 0 else 3
            w = RegionWriter(path, sf.offsets[first], entries[first:first + len(runs[k])])
            for name, t in runs[k]:
                w.add(name, t)
            w.finish()
        files.append(path.read_bytes())
        back = load_file(str(path))
        assert set(back) == set(tensors)
        for k, v in tensors.items():
            assert back[k].dtype == v.dtype and back[k].shape == v.shape
            assert torch.equal(back[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))
        with safe_open(str(path), "pt") as f:
            assert f.metadata() == {"format": "pt"}
    assert files[0] == files[1]
    assert not shard_file_matches(tmp_path / "missing", sf.header, sf.size)
    assert not shard_file_matches(path, sf.header, sf.size + 8)


def test_region_writer_refuses_a_tensor_it_was_not_planned_for(tmp_path):
    t = {"a": torch.ones(2, 3), "b": torch.zeros(4, dtype=torch.int8)}
    entries = _entries(t)
    sf = ShardFile.of(entries)
    path = tmp_path / "x.safetensors"
    create_shard_file(path, sf.header, sf.size)
    w = RegionWriter(path, sf.offsets[0], entries)
    with pytest.raises(LowbitError, match=r"got tensor 'a' F32 \(3, 2\).*says 'a' F32 \(2, 3\)"):
        w.add("a", torch.ones(3, 2))
    w.add("a", t["a"])
    with pytest.raises(LowbitError, match="1 planned tensors were not written .*'b'"):
        w.finish()
    with pytest.raises(LowbitError, match="tensor 'a' written twice"):
        w.add("a", t["a"])
    w.add("b", t["b"])
    with pytest.raises(LowbitError, match="got tensor 'c'.*says no such tensor"):
        w.add("c", t["b"])
    w.finish()
    assert load_file(str(path))["a"].equal(t["a"])


@pytest.mark.parametrize("kernel_copy", [True, False])
def test_region_writer_raw_copy(tmp_path, monkeypatch, kernel_copy):
    """Tensors copied byte for byte from a source shard (kernel copy or plain reads) between
    tensors written from memory."""
    import os

    from lowbit.modelfree.outshape import Entry
    from lowbit.files.tensors import read_header

    if not kernel_copy:
        def refuse(*a, **k):
            raise OSError("no copy_file_range here")
        monkeypatch.setattr(os, "copy_file_range", refuse)
    src = tmp_path / "src.safetensors"
    save_file({"x": torch.randn(300, 7), "y": torch.arange(5, dtype=torch.int64)}, str(src))
    infos, _ = read_header(src)
    tensors = {"a": torch.randn(3, 4, dtype=torch.bfloat16), "b": torch.tensor([1.5])}
    entries = [_entries({"a": tensors["a"]})[0]] + [Entry(n, infos[n].dtype, infos[n].shape, infos[n].nbytes)
                                                    for n in ("x", "y")] + [_entries({"b": tensors["b"]})[0]]
    sf = ShardFile.of(entries)
    whole = tmp_path / "whole.safetensors"
    create_shard_file(whole, sf.header, sf.size)
    w = RegionWriter(whole, sf.offsets[0], entries)
    w.add("b", tensors["b"])  # any order: each tensor goes to its entry's offset
    for n in ("y", "x"):
        i = infos[n]
        w.add_raw(n, i.dtype, i.shape, src, i.data_start + i.begin, i.nbytes)
    w.add("a", tensors["a"])
    w.finish()
    back = load_file(str(whole))
    ref = load_file(str(src))
    assert torch.equal(back["x"], ref["x"]) and torch.equal(back["y"], ref["y"])
    assert torch.equal(back["a"], tensors["a"]) and torch.equal(back["b"], tensors["b"])


MODEL_FREE_SCHEMES = ["w4a16", "w8a16", "nvfp4a16", "w8a8-int8-dynamic", "w8a8-fp8-dynamic", "nvfp4-e5m3", "mxfp4",
                      "mxfp8"]


@pytest.mark.parametrize("fmt", ["lowbit", "compressed-tensors", "fake"])
@pytest.mark.parametrize("scheme", MODEL_FREE_SCHEMES)
def test_output_entries_are_predicted_exactly(scheme, fmt):
    """The entries planned for a quantized linear (from one- and two-row probes) are exactly the
    tensors the quantizer and layout write for the real weight, for every width and dtype."""
    from lowbit.formats import get_layout
    from lowbit.modelfree.outshape import OutputShapes
    from lowbit.modelfree.plan_types import Item, Source
    from lowbit.files.folder import DTYPE_NAMES
    from lowbit.files.tensors import TensorInfo
    from lowbit.modelfree.bands import quantize_rows
    from lowbit.quant import global_scale_from_amax

    s = get_scheme(scheme)
    layout = get_layout(fmt)
    try:
        layout.check_scheme(s)
    except FormatError:
        pytest.skip(f"{fmt} cannot hold {scheme}")
    shapes = OutputShapes(s, layout, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    for rows, cols, dtype in [(37, 96, torch.bfloat16), (1, 64, torch.float32), (130, 160, torch.float16)]:
        if fmt == "compressed-tensors" and s.weights.group_size and cols % s.weights.group_size:
            continue
        if s.weights.group_size and cols % s.weights.group_size and s.weights.is_microscaled:
            continue
        w = torch.randn(rows, cols, generator=g).to(dtype)
        info = TensorInfo("m.weight", "x.safetensors", DTYPE_NAMES[dtype], (rows, cols), 0, w.numel() * w.element_size())
        planned = shapes.entries(Item(Kind.QUANTIZE, "m", Source(info)))
        gs = global_scale_from_amax(w.float().abs().amax().reshape(1), s.weights) if s.weights.global_scale else None
        qt = quantize_rows(w, s.weights, gs, "m.weight", band_elems=rows * cols // 3 + 1,
                           pack=layout.nibble_packed(s, cols))
        real = layout.linear_tensors("m", qt, s, dtype=dtype)
        assert [(e.name, e.dtype, e.shape, e.nbytes) for e in planned] == [
            (k, DTYPE_NAMES[v.dtype], tuple(v.shape), v.numel() * v.element_size()) for k, v in real.items()]
