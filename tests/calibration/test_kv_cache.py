"""The calibrated FP8 (E4M3) KV cache (``kv_cache="fp8"``): scales are amax/448 of the post-RoPE
K and V, the forward QDQs them exactly as an independent reference does, and every format writes
and reads them back exactly (compressed-tensors: the names, dtypes and shapes compressed-tensors
itself writes)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import lowbit
from helpers.cli import assert_one_error, run
from helpers.eval_fixtures import save_tiny_folder
from helpers.models import tiny_llama
from lowbit.errors import QuantizationError
from lowbit.files.folder import SafetensorsFolder
from lowbit.kvcache.attention import attention_modules

SCHEME = "w8a8-int8-dynamic"  # RTN weights: the same with and without calibration data
FIELDS = ("num_bits", "type", "symmetric", "group_size", "strategy", "dynamic", "block_structure")


def _ids(n=4, seq=32, seed=0):
    return torch.randint(0, 256, (n, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def pair():
    """(the scheme without KV quantization, the same with kv_cache="fp8" calibrated on _ids())."""
    plain = lowbit.quantize(tiny_llama(), SCHEME)
    kv = lowbit.quantize(tiny_llama(), SCHEME, calibration=_ids(), kv_cache="fp8", num_samples=4, seq_len=32)
    return plain, kv


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


@torch.no_grad()
def _kv_amax(model, ids):
    """amax |K| (after RoPE, recomputed from k_proj's output and the rotary embedding) and |V|
    per attention module, from forward hooks on the projections of ``model`` (no lowbit wrapper)."""
    cfg = model.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    outs, hooks = {}, []
    for name, m in attention_modules(model).items():
        for proj in ("k_proj", "v_proj"):
            hooks.append(getattr(m, proj).register_forward_hook(
                lambda mod, i, o, key=(name, proj): outs.setdefault(key, []).append(o.detach())))
    model(ids, use_cache=False)
    for h in hooks:
        h.remove()
    pos = torch.arange(ids.shape[1])[None]
    cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), pos)
    res = {}
    for name in attention_modules(model):
        k = outs[(name, "k_proj")][0]
        k = k.view(*k.shape[:2], -1, hd).transpose(1, 2)
        k_rope = k * cos[:, None] + _rotate_half(k) * sin[:, None]
        res[name] = (k_rope.abs().amax(), outs[(name, "v_proj")][0].abs().amax(), k.abs().amax())
    return res


def test_scales_are_amax_over_448_of_post_rope_k_and_v(pair):
    plain, kv = pair
    ref = _kv_amax(plain, _ids())
    assert set(kv.lowbit_kv_calibration) == set(ref) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    for name, (k_amax, v_amax, k_pre_rope) in ref.items():
        m = kv.get_submodule(name)
        assert m.k_scale.dtype == torch.float32 and m.k_scale.shape == (1,)
        torch.testing.assert_close(m.k_scale, (k_amax / 448).reshape(1), rtol=1e-6, atol=0)
        torch.testing.assert_close(m.v_scale, (v_amax / 448).reshape(1), rtol=1e-6, atol=0)
        assert not torch.isclose(k_amax, k_pre_rope, rtol=1e-5)  # the scale is RoPE'd K's, not k_proj's


def _ref_attention(module, query, key, value, attention_mask, **kwargs):
    """K and V QDQ'd with torch's own float8_e4m3fn cast (not lowbit's numerics), then sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    s = module.ref_scales
    q = [(t.float() / sc).to(torch.float8_e4m3fn).float() * sc for t, sc in zip((key, value), s)]
    return sdpa_attention_forward(module, query, q[0].to(key.dtype), q[1].to(value.dtype), attention_mask, **kwargs)


@torch.no_grad()
def test_forward_qdqs_k_and_v_as_an_independent_reference(pair):
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    plain, kv = pair
    ids = _ids(2, 24, seed=5)
    ref_model = copy.deepcopy(plain)
    AttentionInterface.register("test_kv_ref", _ref_attention)
    AttentionMaskInterface.register("test_kv_ref", ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    for name, m in attention_modules(ref_model).items():
        m.ref_scales = (kv.get_submodule(name).k_scale, kv.get_submodule(name).v_scale)
    ref_model.config._attn_implementation = "test_kv_ref"
    got, want, base = kv(ids).logits, ref_model(ids).logits, plain(ids).logits
    change = (got - base).abs().max().item()
    assert change > 1e-3  # the KV cache's cost is measured
    assert torch.equal(got, want)  # bit for bit: lowbit's E4M3 QDQ is torch's float8_e4m3fn rounding


@torch.no_grad()
def test_observing_leaves_the_forward_unchanged_and_cached_decoding_matches():
    from lowbit.kvcache.attention import disable, enable, start_observing, stop_observing

    m = lowbit.quantize(tiny_llama(), SCHEME)
    ids = _ids(2, 16)
    base = m(ids).logits
    mods = attention_modules(m)
    enable(m)
    start_observing(mods)
    assert torch.equal(m(ids).logits, base)
    stop_observing(mods)
    disable(m)
    assert m.config._attn_implementation == "sdpa"
    kv = lowbit.quantize(tiny_llama(), SCHEME, calibration=_ids(), kv_cache="fp8", num_samples=4, seq_len=32)
    full = kv(ids).logits
    out = kv(ids[:, :10], use_cache=True)
    step = kv(ids[:, 10:11], cache=out.cache, use_cache=True).logits
    torch.testing.assert_close(step[:, -1], full[:, 10], rtol=0, atol=1e-5)


@pytest.mark.parametrize("fmt", ["lowbit", "fake", "compressed-tensors"])
@torch.no_grad()
def test_round_trip_is_exact(pair, fmt, tmp_path):
    _, kv = pair
    out = lowbit.save(kv, tmp_path / fmt, format=fmt)
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "_attn_implementation" not in json.loads((out / "config.json").read_text())
    folder = SafetensorsFolder(out)
    names = [f"model.layers.{i}.self_attn.{s}" for i in range(2) for s in ("k_scale", "v_scale")]
    if fmt == "fake":
        assert not any(k.endswith("_scale") for k in folder)  # plain transformers reads it as a float model
        assert set(qcfg["kv_cache"]["scales"]) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    else:
        for k in names:
            assert folder[k].dtype == torch.float32 and tuple(folder[k].shape) == (1,), k
    if fmt == "compressed-tensors":
        assert {f: qcfg["kv_cache_scheme"][f] for f in FIELDS} == {
            "num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "tensor",
            "dynamic": False, "block_structure": None}
    else:
        assert qcfg["kv_cache"]["name"] == "fp8" and qcfg["kv_cache"]["spec"]["format"] == "e4m3"
    back = lowbit.load(out, backend="reference")  # the fake format's weights: the reference's dequantized ones
    assert back.lowbit_kv_cache == "fp8" and back.config._attn_implementation == "lowbit_kv_sdpa"
    for name, m in attention_modules(kv).items():
        b = back.get_submodule(name)
        assert torch.equal(b.k_scale, m.k_scale) and torch.equal(b.v_scale, m.v_scale)
    ids = _ids(2, 20, seed=9)
    ref = copy.deepcopy(kv)
    lowbit.use_backend(ref, "reference")
    assert torch.equal(back(ids).logits, ref(ids).logits)
    from lowbit.checkpoint.inspect import inspect_checkpoint

    report = inspect_checkpoint(out)
    assert report["inconsistencies"] == [] and report["kv_cache"]["scheme"] == "fp8"
    assert len(report["kv_cache"]["scales"]) == 2


def test_without_kv_cache_nothing_changes(pair, tmp_path):
    plain, _ = pair
    for fmt in ("lowbit", "compressed-tensors"):
        qcfg = json.loads((lowbit.save(plain, tmp_path / fmt, format=fmt) / "config.json").read_text())
        assert "kv_cache" not in qcfg["quantization_config"]
        assert qcfg["quantization_config"].get("kv_cache_scheme") is None
    assert getattr(plain, "lowbit_kv_cache", None) is None and plain.config._attn_implementation == "sdpa"


def test_compressed_tensors_writes_the_same_kv_tensors(pair, tmp_path, monkeypatch):
    pytest.importorskip("compressed_tensors")
    import compressed_tensors.quantization.lifecycle.apply as ct_apply
    import compressed_tensors.quantization.lifecycle.initialize as ct_init
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs, QuantizationConfig, apply_quantization_config, preset_name_to_scheme,
    )

    # compressed-tensors 0.20.1 looks for `past_key_values` in the attention's forward signature,
    # which transformers 5's LlamaAttention no longer has (it takes `cache`): name the modules for it
    is_attn = lambda m: type(m).__name__ == "LlamaAttention"  # noqa: E731
    monkeypatch.setattr(ct_apply, "is_cached_attention_module", is_attn)
    monkeypatch.setattr(ct_init, "is_cached_attention_module", is_attn)
    model = tiny_llama()
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme("FP8_DYNAMIC", ["Linear"])}, ignore=["lm_head"],
        kv_cache_scheme=QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)))
    comp = ModelCompressor.from_pretrained_model(model)
    comp.compress_model(model)
    model.save_pretrained(tmp_path / "ct")
    comp.update_config(tmp_path / "ct")
    _, kv = pair
    ours = lowbit.save(kv, tmp_path / "lb", format="compressed-tensors")
    a, b = SafetensorsFolder(tmp_path / "ct"), SafetensorsFolder(ours)
    ka = {k for k in a if k.endswith(("k_scale", "v_scale"))}
    assert ka == {k for k in b if k.endswith(("k_scale", "v_scale"))} and len(ka) == 4
    for k in ka:
        assert (a[k].dtype, a[k].shape) == (b[k].dtype, b[k].shape), k
    ca = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]
    cb = json.loads((ours / "config.json").read_text())["quantization_config"]["kv_cache_scheme"]
    assert {f: ca.get(f) for f in FIELDS} == {f: cb.get(f) for f in FIELDS}
    # and lowbit reads compressed-tensors' own config (null fields dropped) as the FP8 KV cache
    from lowbit.formats import parse_quantization_config

    cfg = json.loads((tmp_path / "ct" / "config.json").read_text())
    assert parse_quantization_config(cfg)[1].kv_cache == "fp8"


def test_bad_values_and_missing_calibration_are_one_line_errors():
    with pytest.raises(QuantizationError, match=r"'int8': kv_cache='fp8' is the only choice"):
        lowbit.quantize(tiny_llama(), SCHEME, calibration=_ids(), kv_cache="int8")
    with pytest.raises(QuantizationError, match=r"kv_cache='fp8' needs calibration data"):
        lowbit.quantize(tiny_llama(), SCHEME, kv_cache="fp8")
    from lowbit.report.compare import CompareOptions

    with pytest.raises(QuantizationError, match="kv_cache"):
        CompareOptions(kv_cache="fp16")


def test_cli_quantize_kv_cache(tmp_path, capsys):
    src = save_tiny_folder(tmp_path / "m")
    code, _, err = run(capsys, "quantize", src, "--scheme", SCHEME, "--kv-cache", "int8", "-o", tmp_path / "bad")
    assert "--kv-cache fp8" in assert_one_error(code, err, "--kv-cache")
    code, _, err = run(capsys, "quantize", src, "--scheme", SCHEME, "--kv-cache", "fp8", "--model-free",
                       "-o", tmp_path / "mf")
    assert_one_error(code, err, "--kv-cache", "--model-free")
    (tmp_path / "calib.txt").write_text("\n".join(f"line {i} of the calibration text, long enough." for i in range(40)))
    code, out, err = run(capsys, "quantize", src, "--scheme", SCHEME, "--kv-cache", "fp8", "--calib",
                         tmp_path / "calib.txt", "--calib-samples", "2", "--calib-seq-len", "32",
                         "-f", "compressed-tensors", "-o", tmp_path / "q")
    assert code == 0, err
    assert "KV cache fp8" in out
    qcfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qcfg["kv_cache_scheme"]["type"] == "float"
    m, _ = lowbit.models.load_model(tmp_path / "q")  # what `lowbit eval` evaluates
    assert m.lowbit_kv_cache == "fp8" and m.config._attn_implementation == "lowbit_kv_sdpa"
    code, out, err = run(capsys, "inspect", tmp_path / "q")
    assert code == 0 and "KV cache: fp8" in out and "no inconsistencies" in out, out + err


def test_compare_adds_the_kv_cache_to_every_row(llama):
    from helpers.eval_fixtures import byte_tokenizer
    from lowbit.report.compare import CompareOptions, quantize_with_options, row_label

    opts = CompareOptions(schemes=[SCHEME], calib_samples=2, calib_seq_len=32, kv_cache="fp8", progress=False)
    q, calibrated, _ = quantize_with_options(copy.deepcopy(llama), SCHEME, byte_tokenizer(), opts)
    assert calibrated and q.lowbit_kv_cache == "fp8"
    assert row_label({"scheme": SCHEME, "kv_cache": "fp8"}) == f"{SCHEME}+kv-fp8"
    assert row_label({"scheme": SCHEME, "kv_cache": None}) == SCHEME


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_moe_families_sdpa_and_eager(family, tmp_path):
    from helpers.moe_models import tiny_moe

    model = tiny_moe(family)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    q = lowbit.quantize(model, "w8a8-fp8-dynamic", calibration=ids, kv_cache="fp8", num_samples=2, seq_len=16)
    impl = {"qwen3_moe": "sdpa", "gpt_oss": "eager"}[family]
    assert q.config._attn_implementation == f"lowbit_kv_{impl}" and len(q.lowbit_kv_calibration) == 2
    back = lowbit.load(lowbit.save(q, tmp_path / "ct", format="compressed-tensors"))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, q(ids).logits)


def test_models_without_k_and_v_projections_are_refused_before_any_work():
    from helpers.moe_models import tiny_moe

    model = tiny_moe("deepseek_v3")  # MLA: the cache holds a compressed latent, not K and V
    with pytest.raises(QuantizationError, match=r"kv_cache='fp8' needs attention modules with k_proj/v_proj"):
        lowbit.quantize(model, "w8a8-fp8-dynamic", calibration=_ids(), kv_cache="fp8")
    assert not any(hasattr(m, "scheme") for m in model.modules())


def test_bf16_model_lowbit_exact_compressed_tensors_in_the_model_dtype(tmp_path):
    model = tiny_llama()
    rot = model.model.rotary_emb
    keep = {n: b.clone() for n, b in rot.named_buffers()}
    model.to(torch.bfloat16)
    for n, b in keep.items():  # as transformers builds a bf16 model: rotary buffers stay float32
        setattr(rot, n, b)
    q = lowbit.quantize(model, SCHEME, calibration=_ids(), kv_cache="fp8", num_samples=4, seq_len=32)
    assert q.model.layers[0].self_attn.k_scale.dtype == torch.float32
    ids = _ids(2, 16, seed=2)
    lowbit.use_backend(q, "reference")  # bf16 round trips are exact on the reference backend (test_save_load)
    back = lowbit.load(lowbit.save(q, tmp_path / "lb", format="lowbit"), backend="reference")
    with torch.no_grad():
        assert torch.equal(back(ids).logits, q(ids).logits)
    with pytest.warns(UserWarning, match="KV-cache scales"):
        out = lowbit.save(q, tmp_path / "ct", format="compressed-tensors")
    t = SafetensorsFolder(out)["model.layers.0.self_attn.k_scale"]
    assert t.dtype == torch.bfloat16 and tuple(t.shape) == (1,)  # compressed-tensors: the observed (model) dtype


def test_cli_eval_measures_the_kv_cache_and_compare_labels_its_rows(tmp_path, capsys):
    src = save_tiny_folder(tmp_path / "m")
    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"paragraph {i}: the long day ended quietly by the garden window." for i in range(30)))
    ppl = {}
    for kv in (None, "fp8"):
        model, tok = lowbit.models.load_model(src)
        q = lowbit.quantize(model, SCHEME, calibration=str(text), tokenizer=tok, kv_cache=kv, num_samples=2,
                            seq_len=32)
        out = lowbit.save(q, tmp_path / str(kv), tokenizer=tok)
        code, js, err = run(capsys, "eval", out, "--text", text, "--limit", 60, "--window", 32, "--lastword", 0,
                            "--json", "--no-progress")
        assert code == 0, err
        ppl[kv] = json.loads(js)["model"]["perplexity"]
    assert ppl["fp8"] != ppl[None]
    code, js, err = run(capsys, "compare", src, "--schemes", SCHEME, "--kv-cache", "fp8", "--text", text, "--calib",
                        text, "--calib-samples", 2, "--calib-seq-len", 32, "--limit", 30, "--window", 32,
                        "--lastword", 0, "--spread", 0, "-o", tmp_path / "rep", "--json", "--no-progress")
    assert code == 0, err
    row = json.loads(js)["schemes"][0]
    assert row["status"] == "ok" and row["kv_cache"] == "fp8" and row["calibrated"] is True
    code, out, err = run(capsys, "compare", src, "--schemes", SCHEME, "--kv-cache", "fp8", "--text", text, "--calib",
                         text, "--calib-samples", 2, "--calib-seq-len", 32, "--limit", 30, "--window", 32,
                         "--lastword", 0, "--spread", 0, "-o", tmp_path / "rep2", "--no-progress")
    assert code == 0 and f"{SCHEME}+kv-fp8" in out, out + err


def test_float_weights_with_only_the_kv_cache_in_memory(tmp_path):
    from lowbit.errors import FormatError

    float_model = tiny_llama()
    kv = lowbit.quantize(tiny_llama(), None, calibration=_ids(), kv_cache="fp8", num_samples=4, seq_len=32)
    assert not any(hasattr(m, "scheme") for m in kv.modules()) and kv.lowbit_kv_cache == "fp8"
    ref = _kv_amax(float_model, _ids())
    for name, (k_amax, v_amax, _) in ref.items():
        torch.testing.assert_close(kv.get_submodule(name).k_scale, (k_amax / 448).reshape(1), rtol=1e-6, atol=0)
        torch.testing.assert_close(kv.get_submodule(name).v_scale, (v_amax / 448).reshape(1), rtol=1e-6, atol=0)
    with torch.no_grad():
        assert not torch.equal(kv(_ids(1, 16)).logits, float_model(_ids(1, 16)).logits)
    with pytest.raises(FormatError, match="KV cache but no quantized layers"):
        lowbit.save(kv, tmp_path / "o")
    with pytest.raises(QuantizationError, match="needs calibration data"):
        lowbit.quantize(tiny_llama(), None, kv_cache="fp8")
