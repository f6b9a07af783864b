"""lowbit.save / lowbit.load: every scheme x format round trip, complete folders, bad input."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import lowbit
from helpers.models import tiny_llama
from lowbit.modules import FakeQuantLinear
from lowbit.errors import FormatError
from lowbit.formats import LAYOUTS, Format
from lowbit.files.folder import SafetensorsFolder
from lowbit.quant import dequantize
from lowbit.schemes import PRESETS
from helpers.formats_support import assert_same_layers, logits, quant_layers, quantized_model

FORMATS = [layout.format.value for layout in LAYOUTS]  # the folder formats (GGUF: tests/formats/gguf)


def _ids():
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("scheme", list(PRESETS))
def test_roundtrip_every_scheme_and_format(scheme, tmp_path):
    ids = _ids()
    wide = {"hidden_size": 128, "intermediate_size": 256} if PRESETS[scheme].weights.group_size == 128 else {}
    model = quantized_model(scheme, **wide)  # group-128 schemes: whole groups, as compressed-tensors needs
    lowbit.use_backend(model, "reference")
    ref = logits(model, ids)
    for fmt in FORMATS:
        out = tmp_path / fmt
        if fmt == "compressed-tensors" and scheme in ("nvfp4-e5m3", "mxfp6-e3m2"):  # no standard layout
            with pytest.raises(FormatError, match="format='lowbit'"):
                lowbit.save(model, out, format=fmt)
            assert not out.exists()
            continue
        lowbit.save(model, out, format=fmt)
        loaded = lowbit.load(out, backend="reference")
        assert loaded.lowbit_format is Format(fmt)
        if fmt == "fake":
            fakes = {n: m for n, m in loaded.named_modules() if isinstance(m, FakeQuantLinear)}
            layers = quant_layers(model)
            assert list(fakes) == list(layers)
            for n, m in fakes.items():
                assert torch.equal(m.weight, dequantize(layers[n].weight_qtensor(), torch.float32))
                for attr in ("input_scale", "input_global_scale"):
                    a, b = getattr(m, attr), getattr(layers[n], attr)
                    assert (a is None and b is None) or torch.equal(a, b)
        else:
            assert_same_layers(model, loaded)
        assert torch.equal(logits(loaded, ids), ref), (scheme, fmt)


def test_calibrated_model_roundtrips_with_auto_backend(tmp_path):
    ids = _ids()
    model = lowbit.quantize(tiny_llama(), "w8a8-int8", calibration=ids)
    ref = logits(model, ids)  # auto backend (cpu-int8 where registered)
    for fmt in ("lowbit", "compressed-tensors"):
        lowbit.save(model, tmp_path / fmt, format=fmt)
        loaded = lowbit.load(tmp_path / fmt)
        assert_same_layers(model, loaded)
        assert torch.equal(logits(loaded, ids), ref)


def test_bf16_model_lowbit_format_is_exact(tmp_path):
    ids = _ids()
    for scheme in ("nvfp4-e5m3", "w8a8-int8"):
        model = quantized_model(scheme, dtype=torch.bfloat16)
        lowbit.use_backend(model, "reference")
        lowbit.save(model, tmp_path / scheme)
        cfg = json.loads((tmp_path / scheme / "config.json").read_text())
        assert cfg["dtype"] == "bfloat16"
        loaded = lowbit.load(tmp_path / scheme, backend="reference")
        assert loaded.dtype == torch.bfloat16
        assert_same_layers(model, loaded)
        assert torch.equal(logits(loaded, ids), logits(model, ids))


def test_bf16_compressed_tensors_warns_about_rounded_scales(tmp_path):
    model = quantized_model("w8a8-fp8", dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="not exactly representable in bfloat16, the dtype the .compressed-tensors. format"):
        lowbit.save(model, tmp_path / "ct", format="compressed-tensors")
    f = SafetensorsFolder(tmp_path / "ct")
    assert f["model.layers.0.self_attn.q_proj.weight_scale"].dtype == torch.bfloat16
    loaded = lowbit.load(tmp_path / "ct")
    q = loaded.model.layers[0].self_attn.q_proj
    assert torch.equal(q.weight_scale, f["model.layers.0.self_attn.q_proj.weight_scale"].float())


def test_output_is_a_complete_hf_folder(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_text('{"fake": "tokenizer"}')
    (src / "tokenizer_config.json").write_text("{}")
    (src / "model.safetensors").write_text("not copied")
    model = quantized_model("w8a8-int8-dynamic")
    out = tmp_path / "out"
    lowbit.save(model, out, format="compressed-tensors", source_dir=src, max_shard_size=20_000)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.safetensors.index.json"} <= names
    assert (out / "tokenizer.json").read_text() == '{"fake": "tokenizer"}'
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(idx["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).exists() for s in shards)
    f = SafetensorsFolder(out)
    assert idx["metadata"]["total_size"] == sum(f.nbytes(k) for k in f)
    assert "lm_head.weight" not in f and "model.embed_tokens.weight" in f  # tied: written once
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    assert cfg["quantization_config"]["ignore"] == ["lm_head"]
    loaded = lowbit.load(out)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_plain_transformers_opens_fake_folder_as_float(tmp_path):
    from transformers import AutoModelForCausalLM

    ids = _ids()
    model = quantized_model("w8a16")  # weight-only: the float model computes the same thing
    lowbit.use_backend(model, "reference")
    lowbit.save(model, tmp_path / "fake", format="fake")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "fake")).eval()
    q = plain.model.layers[1].mlp.down_proj
    assert type(q) is torch.nn.Linear
    layer = quant_layers(model)["model.layers.1.mlp.down_proj"]
    assert torch.equal(q.weight, layer.dequantized_weight(torch.float32))
    torch.testing.assert_close(logits(plain, ids), logits(model, ids), rtol=1e-5, atol=1e-5)


def test_plain_transformers_refuses_lowbit_folder(tmp_path):
    """A stock loader must fail loudly on the lowbit format (it would otherwise only warn about the
    unknown quant_method and load uninitialised weights for every quantized Linear): the weights
    are under lowbit's own file names, so transformers finds none and raises."""
    from transformers import AutoModelForCausalLM

    model = quantized_model("w4a16")
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    lowbit.save(model, single, format="lowbit")
    lowbit.save(model, sharded, format="lowbit", max_shard_size=20_000)
    assert sorted(p.name for p in single.glob("*.safetensors*")) == ["lowbit-model.safetensors"]
    names = sorted(p.name for p in sharded.glob("*.safetensors*"))
    n = len(names) - 1
    assert n > 1 and names == [f"lowbit-model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)] + \
        ["lowbit-model.safetensors.index.json"]
    for out in (single, sharded):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(OSError, match="model.safetensors"):
                AutoModelForCausalLM.from_pretrained(str(out))
        assert_same_layers(model, lowbit.load(out))  # lowbit itself reads it
    # the formats stock loaders do read keep the standard names
    lowbit.save(model, tmp_path / "fake", format="fake")
    lowbit.save(quantized_model("w8a16"), tmp_path / "ct", format="compressed-tensors", max_shard_size=20_000)
    assert (tmp_path / "fake" / "model.safetensors").is_file()
    assert (tmp_path / "ct" / "model.safetensors.index.json").is_file()
    assert not list((tmp_path / "fake").glob("lowbit-model*")) and not list((tmp_path / "ct").glob("lowbit-model*"))


def test_lowbit_folder_with_standard_names_still_loads(tmp_path):
    """Folders written by earlier lowbit versions (lowbit format under model*.safetensors) load."""
    model = quantized_model("w8a8-int8")
    out = tmp_path / "old"
    lowbit.save(model, out, format="lowbit", max_shard_size=30_000)
    index = json.loads((out / "lowbit-model.safetensors.index.json").read_text())
    renames = {f: f.replace("lowbit-model", "model") for f in set(index["weight_map"].values())}
    for a, b in renames.items():
        (out / a).rename(out / b)
    index["weight_map"] = {k: renames[v] for k, v in index["weight_map"].items()}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "lowbit-model.safetensors.index.json").unlink()
    assert_same_layers(model, lowbit.load(out))
    (out / "lowbit-model.safetensors").write_bytes(b"stale")  # two namings in one folder: refused
    with pytest.raises(FormatError, match="two namings.*model.safetensors.index.json.*lowbit-model.safetensors"):
        lowbit.load(out)


# ---------------------------------------------------------------------------- bad input
@pytest.fixture
def saved(tmp_path):
    model = quantized_model("w8a8-int8")
    out = tmp_path / "ck"
    lowbit.save(model, out, format="lowbit", max_shard_size=30_000)
    return out


def _edit_config(path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_and_truncated_shards(saved):
    shards = sorted(p for p in saved.glob("*.safetensors"))
    raw = shards[1].read_bytes()
    shards[1].write_bytes(raw[: len(raw) // 2])
    with pytest.raises(FormatError, match=f"{shards[1].name}.*truncated"):
        lowbit.load(saved)
    shards[1].unlink()
    with pytest.raises(FormatError, match=f"shard '{shards[1].name}'.*missing"):
        lowbit.load(saved)


def test_corrupt_header(saved):
    shard = sorted(saved.glob("*.safetensors"))[0]
    raw = bytearray(shard.read_bytes())
    raw[8:12] = b"\xff\xfe\x00!"
    shard.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match=f"{shard.name}.*corrupt header"):
        lowbit.load(saved)


def test_config_shape_mismatch(saved):
    _edit_config(saved, lambda c: c.update(intermediate_size=96))
    with pytest.raises(FormatError, match=r"mlp.gate_proj.*shape"):
        lowbit.load(saved)


def test_config_scheme_mismatch(saved):
    def weights(**kw):
        return lambda c: c["quantization_config"]["config_groups"]["group_0"]["scheme"]["weights"].update(kw)
    raw = (saved / "config.json").read_text()
    _edit_config(saved, weights(format="e4m3"))  # int8 codes read as FP8 would be silently wrong
    with pytest.raises(FormatError, match=r"weight_codes.*has dtype torch\.int8, expected torch\.float8_e4m3fn"):
        lowbit.load(saved)
    (saved / "config.json").write_text(raw)
    _edit_config(saved, weights(granularity="group", group_size=16))
    with pytest.raises(FormatError, match=r"weight_scale.*shape \(64, 1\), expected \(64, 4\)"):
        lowbit.load(saved)


def test_missing_scale_and_wrong_dtype(tmp_path):
    from safetensors.torch import load_file, save_file

    model = quantized_model("w8a8-fp8")
    out = tmp_path / "ck"
    lowbit.save(model, out, format="compressed-tensors")
    t = load_file(str(out / "model.safetensors"))
    del t["model.layers.1.self_attn.o_proj.input_scale"]
    save_file(t, str(out / "model.safetensors"))
    with pytest.raises(FormatError, match="'model.layers.1.self_attn.o_proj.input_scale' is missing"):
        lowbit.load(out)
    t["model.layers.1.self_attn.o_proj.input_scale"] = torch.ones(1)
    t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"].view(torch.int8)
    save_file(t, str(out / "model.safetensors"))
    with pytest.raises(FormatError, match="model.layers.0.mlp.up_proj.weight.*dtype torch.int8"):
        lowbit.load(out)


def test_quantized_tensors_on_an_ignored_layer(saved):
    _edit_config(saved, lambda c: c["quantization_config"]["ignore"].append("model.layers.0.mlp.down_proj"))
    with pytest.raises(FormatError, match="down_proj.*leaves in float"):
        lowbit.load(saved)


def test_unknown_format_in_config(saved):
    _edit_config(saved, lambda c: c["quantization_config"].update(quant_method="exl2"))
    with pytest.raises(FormatError, match="unknown quant_method 'exl2'"):
        lowbit.load(saved)
    _edit_config(saved, lambda c: c["quantization_config"].update(quant_method="lowbit", format="int3-magic"))
    with pytest.raises(FormatError, match="unknown lowbit format 'int3-magic'"):
        lowbit.load(saved)


def test_failed_save_leaves_nothing(tmp_path, monkeypatch):
    import lowbit.files.writer as writer

    model = quantized_model("mxfp4")
    calls = {"n": 0}
    real = writer.write_safetensors_atomic

    def flaky(path, tensors, metadata=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        return real(path, tensors, metadata)

    monkeypatch.setattr(writer, "write_safetensors_atomic", flaky)
    with pytest.raises(OSError, match="disk full"):
        lowbit.save(model, tmp_path / "out", max_shard_size=10_000)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FormatError, match="format 'compressed-tensors' cannot hold scheme 'nvfp4-e5m3'"):
        lowbit.save(quantized_model("nvfp4-e5m3"), tmp_path / "ct", format="compressed-tensors")
    assert list(tmp_path.iterdir()) == []


def test_compressed_tensors_needs_shared_fused_scales(tmp_path):
    model = quantized_model("w8a8-fp8")
    quant_layers(model)["model.layers.1.self_attn.k_proj"].set_input_scales(input_scale=torch.tensor([0.7]))
    with pytest.raises(FormatError, match=r"self_attn.q_proj.*k_proj.*v_proj.*input_scale values differ"):
        lowbit.save(model, tmp_path / "ct", format="compressed-tensors")
    assert not (tmp_path / "ct").exists()
    lowbit.save(model, tmp_path / "lb", format="lowbit")  # lowbit's own format keeps them as they are
    assert_same_layers(model, lowbit.load(tmp_path / "lb"))
