"""A whole GGUF file from lowbit (lowbit.quantize_gguf / write_gguf): each tensor's
type as the mix chose it, each quantized tensor's bytes as lowbit's GGML encoders make them from
the rows the converter placed, read back by gguf-py as llama.cpp reads it."""

from __future__ import annotations


import numpy as np
import pytest
import torch

from helpers.gguf_folders import save_gguf_folder, skip_without_converter, tiny_llama_folder
from helpers.models import tiny_llama
from lowbit.errors import FormatError

skip_without_converter()

from lowbit.files.folder import SafetensorsFolder  # noqa: E402
from lowbit.formats.gguf.convert import plan_gguf  # noqa: E402
from lowbit.formats.gguf.mixes import Mix  # noqa: E402
from lowbit.formats import Format, get_format  # noqa: E402
from lowbit.gguf_quantize import quantize_gguf  # noqa: E402
from lowbit.numerics.ggml import GgmlType, decode, encode  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_llama_folder(tmp_path_factory.mktemp("llama"))


def _read(path):
    import gguf

    r = gguf.GGUFReader(path)
    return r, {t.name: t for t in r.tensors}


def test_q4_k_m_file_holds_the_mix_types_and_lowbits_bytes(folder, tmp_path):
    import gguf

    report = quantize_gguf(folder, tmp_path / "m.gguf", "Q4_K_M", progress=False)
    reader, tensors = _read(tmp_path / "m.gguf")
    plan = plan_gguf(folder)
    want = get_format(Format.GGUF).tensor_types(plan, Mix.Q4_K_M)
    st = SafetensorsFolder(folder)
    checked = 0
    for rm in plan.rowmaps().values():
        t = tensors[rm.name]
        kind = want[rm.name]
        if not isinstance(kind, GgmlType):
            continue
        assert t.tensor_type.name == kind.name == report.types[rm.name]
        rows = rm.gather(lambda n: st[n].float())
        expect = encode(rows.reshape(-1, rows.shape[-1]), kind).numpy()
        assert np.array_equal(np.asarray(t.data).reshape(expect.shape), expect), rm.name
        # and gguf-py's dequantization (llama.cpp's) of the file equals lowbit's decode
        deq = gguf.dequantize(t.data, t.tensor_type).reshape(rows.shape)
        assert np.array_equal(deq, decode(torch.from_numpy(expect), kind).reshape(rows.shape).numpy())
        checked += 1
    assert checked >= 8
    # 2 layers: llama-quantize's "more bits" layers are i >= 7 n / 8, so blk.1 only
    assert report.types["blk.0.attn_v.weight"] == "Q4_K" and report.types["blk.1.attn_v.weight"] == "Q6_K"
    assert report.types["blk.1.ffn_down.weight"] == "Q6_K" and report.types["output.weight"] == "Q6_K"
    assert report.types["blk.0.attn_norm.weight"] == "F32"
    keys = {f.name: f for f in reader.fields.values()}
    assert int(keys["general.file_type"].parts[-1][0]) == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    assert "tokenizer.ggml.tokens" in keys and report.size_bytes == (tmp_path / "m.gguf").stat().st_size


def test_importance_weighs_the_search_and_changes_the_bytes(folder, tmp_path):
    ids = torch.randint(3, 300, (4, 32), generator=torch.Generator().manual_seed(0))
    from lowbit.calibration import CalibrationConfig

    plain = quantize_gguf(folder, tmp_path / "p.gguf", "Q3_K_M", progress=False)
    weighted = quantize_gguf(folder, tmp_path / "w.gguf", "Q3_K_M", calibration=ids, progress=False,
                             config=CalibrationConfig(num_samples=4, seq_len=32, batch_size=2))
    assert plain.types == weighted.types
    _, a = _read(tmp_path / "p.gguf")
    _, b = _read(tmp_path / "w.gguf")
    differ = [n for n, k in plain.types.items() if k.startswith("Q") and not np.array_equal(a[n].data, b[n].data)]
    assert len(differ) >= 8


def test_one_type_for_every_tensor_falls_back_where_rows_do_not_fit(folder, tmp_path):
    r = quantize_gguf(folder, tmp_path / "p.gguf", "q4_k", progress=False)
    assert r.types["blk.0.attn_q.weight"] == "Q4_K" and r.types["blk.1.ffn_down.weight"] == "Q4_K"
    assert r.types["output.weight"] == "Q4_K"   # --pure: the output too
    small = save_gguf_folder(tiny_llama(vocab_size=300), tmp_path / "small")  # hidden 64: Q4_K -> Q5_0
    s = quantize_gguf(small, tmp_path / "s.gguf", "q4_k", progress=False)
    assert s.types["blk.0.attn_q.weight"] == "Q5_0"


def test_bad_requests_are_one_error_and_leave_nothing(folder, tmp_path):
    with pytest.raises(FormatError, match="unknown GGUF scheme 'q4_kk'"):
        quantize_gguf(folder, tmp_path / "x.gguf", "q4_kk")
    (tmp_path / "y.gguf").write_text("mine")
    with pytest.raises(FormatError, match="exists"):
        quantize_gguf(folder, tmp_path / "y.gguf", "Q8_0")
    assert (tmp_path / "y.gguf").read_text() == "mine"
    with pytest.raises(FormatError, match="override 'blk\\[': not a regular expression"):
        quantize_gguf(folder, tmp_path / "z.gguf", "Q8_0", overrides={"blk[": "q8_0"})
    assert not list(tmp_path.glob("*z.gguf*"))


def test_a_gguf_file_loads_back_as_llama_cpp_dequantizes_it(folder, tmp_path):
    from lowbit.models import load_model
    from lowbit.models.builtin import resolve_model_path

    r = quantize_gguf(folder, tmp_path / "q.gguf", "Q8_0", progress=False)
    model, _ = load_model(tmp_path / "q.gguf", cache_dir=tmp_path / "cache", gguf_weights="float")
    codes, _ = load_model(tmp_path / "q.gguf", cache_dir=tmp_path / "cache")   # default: the blocks kept
    plan = plan_gguf(folder)
    st = SafetensorsFolder(folder)
    rm = plan.rowmaps()["blk.0.ffn_down.weight"]
    assert r.types[rm.name] == "Q8_0" and rm.identity
    w = st[rm.sources[0]].float()
    expect = decode(encode(w, GgmlType.Q8_0), GgmlType.Q8_0)
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, expect)
    assert torch.equal(codes.model.layers[0].mlp.down_proj.decoded_weight(), expect)
    again = resolve_model_path(tmp_path / "q.gguf", cache_dir=tmp_path / "cache")  # cached: no second expansion
    assert again == resolve_model_path(tmp_path / "q.gguf", cache_dir=tmp_path / "cache")


def test_mixtral_stacked_experts_take_their_mix_types_and_bytes(tmp_path):
    from helpers.moe_models import tiny_moe

    moe = save_gguf_folder(tiny_moe("mixtral"), tmp_path / "moe")
    r = quantize_gguf(moe, tmp_path / "moe.gguf", "Q4_K_M", progress=False)
    # 8 experts: llama-quantize's attn_k / attn_v Q8_0 and attn_output Q5_K (-> Q5_1: 128 columns)
    assert r.types["blk.0.attn_k.weight"] == "Q8_0" and r.types["blk.0.attn_v.weight"] == "Q8_0"
    assert r.types["blk.0.attn_output.weight"] == "Q5_1" and r.types["blk.0.ffn_gate_inp.weight"] == "F32"
    _, tensors = _read(tmp_path / "moe.gguf")
    plan = plan_gguf(moe)
    rm = plan.rowmaps()["blk.1.ffn_down_exps.weight"]
    kind = GgmlType[r.types[rm.name]]
    rows = rm.gather(SafetensorsFolder(moe))
    expect = encode(rows.reshape(-1, rows.shape[-1]).float(), kind).numpy()
    assert rows.shape[0] == 8 and np.array_equal(np.asarray(tensors[rm.name].data).reshape(expect.shape), expect)


def test_gptq_keeps_the_searched_scales_and_lowers_the_output_error(folder, tmp_path):
    """With calibration (default rounding GPTQ) each affine tensor keeps the scales of the importance
    search (the rtn file's) and takes other codes; on the calibration inputs the layer's output error
    ||X (W - Q)^T|| is smaller than with the search's own codes."""
    from transformers import AutoModelForCausalLM

    from lowbit.calibration import CalibrationConfig
    from lowbit.numerics.ggml_codes import AFFINE, codes_of, grid_of

    ids = torch.randint(3, 300, (8, 64), generator=torch.Generator().manual_seed(1))
    cfg = dict(num_samples=8, seq_len=64, batch_size=4)
    rtn = quantize_gguf(folder, tmp_path / "r.gguf", "Q3_K_M", calibration=ids, progress=False,
                        config=CalibrationConfig(weight_rounding="rtn", **cfg))
    gptq = quantize_gguf(folder, tmp_path / "g.gguf", "Q3_K_M", calibration=ids, progress=False,
                         config=CalibrationConfig(**cfg))
    assert rtn.types == gptq.types and rtn.from_encoded == []
    _, a = _read(tmp_path / "r.gguf")
    _, b = _read(tmp_path / "g.gguf")
    affine = [n for n, k in gptq.types.items() if k.startswith("Q") and GgmlType(k.lower()) in AFFINE]
    # every linear's weight; the (untied) token embedding is read by no linear: the search's codes
    assert sorted(gptq.from_encoded) == sorted(n for n in affine if n != "token_embd.weight") and len(affine) >= 10
    moved = 0
    for n in affine:
        kind = GgmlType(gptq.types[n].lower())
        ra, rb = (torch.from_numpy(np.asarray(t[n].data).copy()) for t in (a, b))
        ra, rb = ra.reshape(-1, ra.shape[-1]), rb.reshape(-1, rb.shape[-1])
        ga, gb = grid_of(ra, kind), grid_of(rb, kind)
        assert torch.equal(ga.step, gb.step) and torch.equal(ga.offset, gb.offset), n
        moved += int((codes_of(ra, kind) != codes_of(rb, kind)).sum())
    assert moved > 1000
    # the output error of one layer's MLP down projection on the calibration inputs
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    seen = []
    h = model.model.layers[0].mlp.down_proj.register_forward_pre_hook(lambda m, x: seen.append(x[0].reshape(-1, 512)))
    with torch.no_grad():
        model(input_ids=ids)
    h.remove()
    X = torch.cat(seen)
    W = model.model.layers[0].mlp.down_proj.weight.detach()
    kind = GgmlType(gptq.types["blk.0.ffn_down.weight"].lower())
    err = {}
    for label, t in (("rtn", a), ("gptq", b)):
        data = torch.from_numpy(np.asarray(t["blk.0.ffn_down.weight"].data).copy()).reshape(W.shape[0], -1)
        err[label] = float(((X @ (W - decode(data, kind)).T) ** 2).sum())
    assert err["gptq"] < 0.9 * err["rtn"], err


def test_the_importance_search_changes_only_the_symmetric_32_blocks(folder, tmp_path):
    """``importance_search``: 'direct' (the default) and 'llama-cpp' choose other scales for Q4_0 /
    Q5_0 tensors only (the other types take llama.cpp's search either way); the same types, and with
    the search's own codes (rtn) the direct file's Q4_0 / Q5_0 tensors have the lower error weighted
    by their importance vectors; an unknown search is one FormatError naming the choices."""
    from lowbit.calibration import CalibrationConfig
    from transformers import AutoModelForCausalLM

    from lowbit.calibration.importance import input_statistics

    ids = torch.randint(3, 300, (8, 64), generator=torch.Generator().manual_seed(1))
    cfg = CalibrationConfig(num_samples=8, seq_len=64, batch_size=4, weight_rounding="rtn")
    got = {s: quantize_gguf(folder, tmp_path / f"{s}.gguf", "Q4_0", calibration=ids, progress=False, config=cfg,
                            importance_search=s) for s in ("direct", "llama-cpp")}
    assert got["direct"].types == got["llama-cpp"].types
    _, a = _read(tmp_path / "direct.gguf")
    _, b = _read(tmp_path / "llama-cpp.gguf")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    imp, _ = input_statistics(model, ids, batch_size=4)
    sym = [n for n, k in got["direct"].types.items() if k in ("Q4_0", "Q5_0")]
    assert len(sym) >= 4
    for n, k in got["direct"].types.items():
        same = np.array_equal(np.asarray(a[n].data), np.asarray(b[n].data))
        assert same == (n not in sym or n == "token_embd.weight"), n  # the embedding has no importance
    hf = {"attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
          "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}  # rows as stored (q / k: rope-permuted)
    errs = {"direct": 0.0, "llama-cpp": 0.0}
    for n in sym:
        _, layer, part, _ = n.split(".") if n.count(".") == 3 else (None, None, None, None)
        if part not in hf:
            continue
        name = f"model.layers.{layer}.{hf[part]}"
        W = model.get_submodule(name).weight.detach()
        kind = GgmlType(got["direct"].types[n].lower())
        for label, t in (("direct", a), ("llama-cpp", b)):
            q = decode(torch.from_numpy(np.asarray(t[n].data).copy()).reshape(W.shape[0], -1), kind)
            errs[label] += float((imp[name] * (W - q) ** 2).sum())
    assert errs["direct"] < 0.98 * errs["llama-cpp"], errs  # 0.952: random weights, near-even importance
    with pytest.raises(FormatError, match="importance search .best.: one of llama-cpp, direct"):
        quantize_gguf(folder, tmp_path / "x.gguf", "Q4_K_M", calibration=ids, importance_search="best")


def test_the_writer_holds_a_few_tensors_not_the_file(folder, tmp_path):
    """Tensors are encoded at most a few ahead of the one written (``writer._in_order``): when a
    tensor is written, the weights read so far reach at most ``ahead`` GGML tensors past it; the
    file is the same as with the whole file encoded ahead."""
    from lowbit.formats.gguf import writer as w
    from lowbit.formats.gguf.rowmap import RowMap

    plan = plan_gguf(folder)
    fmt = get_format(Format.GGUF)
    types = fmt.tensor_types(plan, Mix.Q4_K_M)
    src = SafetensorsFolder(folder)
    order = [t.name for t in plan.tensors if isinstance(types.get(t.name), GgmlType)]
    first_of = {s: t.name for t in reversed(plan.tensors) if isinstance(t, RowMap) for s in t.sources}
    read: set[str] = set()

    def weights(name):
        read.add(first_of[name])
        return src[name]

    seen = []
    ahead = 2

    def progress(name):
        if name in order:
            done = {order.index(n) for n in read if n in order}
            assert max(done) <= order.index(name) + ahead, (name, sorted(done))
            seen.append(name)

    got = list(w._in_order(plan, types, weights, None, None, w.ImportanceSearch.LLAMA_CPP, ahead=ahead))
    assert [t.name for t, _, _ in got] == [t.name for t in plan.tensors] and len(order) > 2 * ahead
    read.clear()
    for t, kind, data in w._in_order(plan, types, weights, None, None, w.ImportanceSearch.LLAMA_CPP, ahead=ahead):
        progress(t.name)
    assert seen == order
    one = fmt.write(plan, tmp_path / "a.gguf", src, Mix.Q4_K_M, types)
    assert one.path.read_bytes() == quantize_gguf(folder, tmp_path / "b.gguf", "Q4_K_M", progress=False).path.read_bytes()
