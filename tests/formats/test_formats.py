"""Per-layer layouts (no model), config round trips, the folder reader and the atomic writer."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from lowbit.errors import FormatError, LowbitError
from lowbit.files.folder import SafetensorsFolder, read_header
from lowbit.files.writer import CheckpointWriter
from lowbit.formats import LAYOUTS, Format, get_layout, parse_quantization_config
from lowbit.numerics import E2M1, INT4
from lowbit.quant import dequantize, quantize
from lowbit.schemes import PRESETS, Dynamic

CT = Format.COMPRESSED_TENSORS
NO_CT = {"nvfp4-e5m3", "mxfp6-e3m2"}  # no standard compressed-tensors layout (UE5M3 scales; FP6 E3M2)
CT_SCHEMES = [n for n in PRESETS if n not in NO_CT]


def _weight(out_f=48, in_f=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g)
    w[3, 5] = 9.0  # an outlier
    w[7, :32] = 0.0  # an all-zero block
    return w


def _layer(name, dtype=torch.float32):
    s = PRESETS[name]
    qw = quantize(_weight().to(dtype), s.weights, name="w")
    a = s.input_activations
    isc = torch.tensor([0.0123]) if a is not None and a.dynamic is Dynamic.STATIC else None
    igs = torch.tensor([301.5]) if a is not None and a.global_scale else None
    bias = torch.linspace(-1, 1, 48).to(dtype)
    return s, qw, bias, isc, igs


@pytest.mark.parametrize("fmt", [layout.format for layout in LAYOUTS])
@pytest.mark.parametrize("name", list(PRESETS))
def test_layout_roundtrip_is_bit_exact(name, fmt):
    s, qw, bias, isc, igs = _layer(name)
    layout = get_layout(fmt)
    if fmt is CT and name in NO_CT:
        with pytest.raises(FormatError, match=f"{name}.*format='lowbit'"):
            layout.check_scheme(s)
        return
    layout.check_scheme(s)
    t = layout.linear_tensors("m.l", qw, s, bias=bias, input_scale=isc, input_global_scale=igs, dtype=torch.float32)
    assert all(k.startswith("m.l.") for k in t)
    static = {"m.l": {"input_scale": None if isc is None else float(isc), "input_global_scale":
                      None if igs is None else float(igs)}}
    qcfg = json.loads(json.dumps(layout.quantization_config(s, ignore=["lm_head"], static_scales=static)))
    fmt2, parsed = parse_quantization_config({"quantization_config": qcfg})
    assert fmt2 is fmt
    scheme = parsed.scheme_for("m.l")
    assert scheme == s and scheme.name == name
    assert parsed.scheme_for("lm_head") is None
    r = layout.read_linear("m.l", t, scheme, torch.float32, config=parsed)
    if fmt is Format.FAKE:
        assert torch.equal(r.weight, dequantize(qw, torch.float32))
    else:
        assert r.qweight.equal(qw)
    assert torch.equal(r.bias, bias)
    for got, want in ((r.input_scale, isc), (r.input_global_scale, igs)):
        assert (got is None) == (want is None)
        if want is not None:
            assert got.dtype == torch.float32 and torch.equal(got, want)


def test_lowbit_layout_packs_low_bit_codes_and_scale_codes():
    layout = get_layout("lowbit")
    s, qw, *_ = _layer("nvfp4-e5m3")
    t = layout.linear_tensors("p", qw, s)
    assert set(t) == {"p.weight_packed", "p.weight_scale"}
    assert t["p.weight_packed"].dtype == torch.uint8 and t["p.weight_packed"].shape == (48, 128)
    assert t["p.weight_scale"].dtype == torch.uint8 and t["p.weight_scale"].shape == (48, 16)  # UE5M3 codes
    assert int(t["p.weight_packed"][0, 0]) == int(qw.codes[0, 0]) | (int(qw.codes[0, 1]) << 4)
    s, qw, *_ = _layer("w8a8-int8")
    t = layout.linear_tensors("p", qw, s, input_scale=torch.tensor([0.5]))
    assert t["p.weight_codes"].dtype == torch.int8 and t["p.weight_scale"].dtype == torch.float32  # typed codes
    assert torch.equal(t["p.weight_codes"].view(torch.uint8), qw.codes)
    assert t["p.input_scale"].dtype == torch.float32


def test_lowbit_config_writes_every_spec_field():
    qcfg = get_layout("lowbit").quantization_config(PRESETS["nvfp4"], ignore=["lm_head"])
    g = qcfg["config_groups"]["group_0"]
    assert g["targets"] == ["Linear"] and qcfg["ignore"] == ["lm_head"]
    assert set(g["scheme"]["weights"]) == {"format", "granularity", "group_size", "symmetric", "dynamic",
                                           "scale_format", "global_scale", "observer", "scale_floor"}
    assert g["scheme"]["input_activations"]["dynamic"] == "local"
    assert g["scheme"]["input_activations"]["observer"] == "max"
    bad = json.loads(json.dumps(qcfg))
    del bad["config_groups"]["group_0"]["scheme"]["weights"]["scale_format"]
    with pytest.raises(FormatError, match="scale_format"):
        parse_quantization_config({"quantization_config": bad})


def test_ct_tensor_table_matches_reference_layouts():
    """Names, dtypes and shapes from shared/reference/formats.md, bf16 model."""
    layout = get_layout(CT)
    bf = torch.bfloat16
    want = {
        "w8a8-int8": {"weight": (torch.int8, (48, 256)), "weight_scale": (bf, (48, 1)), "input_scale": (bf, (1,))},
        "w8a8-fp8": {"weight": (torch.float8_e4m3fn, (48, 256)), "weight_scale": (bf, (48, 1)),
                     "input_scale": (bf, (1,))},
        "w8a8-fp8-dynamic": {"weight": (torch.float8_e4m3fn, (48, 256)), "weight_scale": (bf, (48, 1))},
        "nvfp4": {"weight_packed": (torch.uint8, (48, 128)), "weight_scale": (torch.float8_e4m3fn, (48, 16)),
                  "weight_global_scale": (torch.float32, (1,)), "input_global_scale": (torch.float32, (1,))},
        "mxfp4": {"weight_packed": (torch.uint8, (48, 128)), "weight_scale": (torch.uint8, (48, 8))},
        "w4a16": {"weight_packed": (torch.int32, (48, 32)), "weight_shape": (torch.int64, (2,)),
                  "weight_scale": (bf, (48, 2))},
    }
    for name, table in want.items():
        s, qw, _, isc, igs = _layer(name, bf)
        t = layout.linear_tensors("p", qw, s, input_scale=isc, input_global_scale=igs, dtype=bf)
        got = {k[2:]: (v.dtype, tuple(v.shape)) for k, v in t.items()}
        assert got == table, name
    # int4 pack-quantized: 8 nibbles per int32, low nibble first, +8 offset
    s, qw, *_ = _layer("w4a16")
    words = layout.linear_tensors("p", qw, s)["p.weight_packed"]
    vals = INT4.codes_to_int(qw.codes[0, :8]) + 8
    assert int(words[0, 0]) & 0xFFFFFFFF == sum(int(v) << (4 * i) for i, v in enumerate(vals))
    # nvfp4: element 2i in the low nibble, codes are E2M1 sign<<3 | index
    s, qw, *_ = _layer("nvfp4")
    packed = layout.linear_tensors("p", qw, s)["p.weight_packed"]
    assert int(packed[3, 2]) == int(qw.codes[3, 4]) | (int(qw.codes[3, 5]) << 4)
    assert torch.equal(E2M1.decode(qw.codes[3, :2]), E2M1.decode(torch.tensor([int(packed[3, 0]) & 15,
                                                                                 int(packed[3, 0]) >> 4],
                                                                                dtype=torch.uint8)))


def test_ct_config_formats_and_args():
    layout = get_layout(CT)
    fmts = {"w8a8-int8": "int-quantized", "w8a8-int8-dynamic": "int-quantized", "w8a8-fp8": "float-quantized",
            "w8a8-fp8-dynamic": "float-quantized", "nvfp4": "nvfp4-pack-quantized",
            "nvfp4a16": "nvfp4-pack-quantized", "mxfp4": "mxfp4-pack-quantized", "w4a16": "pack-quantized"}
    for name, f in fmts.items():
        q = layout.quantization_config(PRESETS[name], ignore=["lm_head"])
        assert q["format"] == f and q["config_groups"]["group_0"]["format"] == f
        assert q["quant_method"] == "compressed-tensors" and q["quantization_status"] == "compressed"
        assert q["ignore"] == ["lm_head"]
    g = layout.quantization_config(PRESETS["nvfp4"])["config_groups"]["group_0"]
    assert (g["weights"]["strategy"], g["weights"]["group_size"], g["weights"]["scale_dtype"]) == \
        ("tensor_group", 16, "torch.float8_e4m3fn")
    assert g["input_activations"]["dynamic"] == "local"
    g = layout.quantization_config(PRESETS["w8a8-int8"])["config_groups"]["group_0"]
    assert (g["weights"]["type"], g["weights"]["strategy"], g["input_activations"]["strategy"],
            g["input_activations"]["dynamic"]) == ("int", "channel", "tensor", False)
    assert layout.quantization_config(PRESETS["w4a16"])["config_groups"]["group_0"]["input_activations"] is None


def test_ct_config_passes_compressed_tensors_schema():
    ct = pytest.importorskip("compressed_tensors.quantization")
    layout = get_layout(CT)
    for name in CT_SCHEMES:
        q = layout.quantization_config(PRESETS[name], ignore=["lm_head"])
        cfg = ct.QuantizationConfig.model_validate(q)  # the schema forbids unknown keys
        assert cfg.format == q["format"]
        # and what compressed-tensors itself would write reads back to the same scheme
        dumped = cfg.model_dump()
        _, parsed = parse_quantization_config({"quantization_config": dumped})
        assert parsed.scheme_for("x") == PRESETS[name], name


def test_ct_refuses_ragged_groups_and_e5m3_clearly():
    layout = get_layout(CT)
    s = PRESETS["w4a16"]
    qw = quantize(torch.randn(8, 192), s.weights)
    with pytest.raises(FormatError, match="multiple of the group size 128"):
        layout.linear_tensors("a.b", qw, s)
    with pytest.raises(FormatError, match="UE5M3"):
        layout.quantization_config(PRESETS["nvfp4-e5m3"])


def test_unknown_format_and_quant_method():
    with pytest.raises(FormatError, match="unknown checkpoint format 'ggml'"):
        get_layout("ggml")
    with pytest.raises(FormatError, match="'gguf' is one file written whole, not a folder"):
        get_layout("gguf")  # a registered format, but no per-linear layout (tests/formats/gguf/test_gguf_format.py)
    with pytest.raises(FormatError, match="unknown quant_method 'awq'"):
        parse_quantization_config({"quantization_config": {"quant_method": "awq"}})
    with pytest.raises(FormatError, match="no quantization_config"):
        parse_quantization_config({})


def test_read_linear_reports_missing_and_mismatched_tensors():
    layout = get_layout(CT)
    s, qw, _, isc, _ = _layer("w8a8-int8")
    t = layout.linear_tensors("p", qw, s, input_scale=isc)
    missing = dict(t)
    del missing["p.input_scale"]
    with pytest.raises(FormatError, match="'p.input_scale' is missing"):
        layout.read_linear("p", missing, s)
    wrong = dict(t)
    wrong["p.weight_scale"] = torch.ones(47, 1)
    with pytest.raises(FormatError, match=r"p.weight_scale.*shape \(47, 1\), expected \(48, 1\)"):
        layout.read_linear("p", wrong, s)
    wrong = dict(t)
    wrong["p.weight"] = wrong["p.weight"].to(torch.float16)
    with pytest.raises(FormatError, match="p.weight.*dtype torch.float16"):
        layout.read_linear("p", wrong, s)


# ---------------------------------------------------------------------------- folder & writer
def test_writer_shards_index_and_atomic_rename(tmp_path):
    out = tmp_path / "out"
    tensors = {f"t{i}": torch.full((100,), float(i)) for i in range(5)}  # 400 bytes each
    with CheckpointWriter(out, max_shard_bytes=900) as w:
        w.add_tensors(tensors)
        w.write_json("config.json", {"a": 1})
        assert not out.exists()
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    assert idx["metadata"]["total_size"] == 5 * 400
    assert sorted(set(idx["weight_map"].values())) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    f = SafetensorsFolder(out)
    assert torch.equal(f["t3"], tensors["t3"]) and len(f) == 5
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())
    with pytest.raises(FormatError, match="already exists"):
        CheckpointWriter(out)


def test_writer_failure_leaves_nothing(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with CheckpointWriter(out) as w:
            w.add_tensors({"a": torch.ones(3)})
            w.write_json("config.json", {})
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_writer_explicit_shards_and_resume(tmp_path):
    out = tmp_path / "out"
    w = CheckpointWriter(out, resume=True)
    w.write_shard({"a": torch.ones(2)}, "model-00001-of-00002.safetensors")
    del w  # killed here: the finished shard stays in the temporary folder
    w = CheckpointWriter(out, resume=True)
    assert w.has_shard("model-00001-of-00002.safetensors")
    w.write_shard(None, "model-00001-of-00002.safetensors")
    w.write_shard({"b": torch.zeros(3, dtype=torch.int32)}, "model-00002-of-00002.safetensors")
    w.write_json("config.json", {})
    w.close()
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    assert idx["metadata"]["total_size"] == 8 + 12
    assert idx["weight_map"] == {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}


def test_writer_weights_stem(tmp_path):
    """The lowbit format's weight files have their own names (stock loaders must not find them);
    the reader finds either naming."""
    stem = get_layout(Format.LOWBIT).weights_stem
    assert stem == "lowbit-model"
    assert get_layout(Format.FAKE).weights_stem == get_layout(CT).weights_stem == "model"
    tensors = {f"t{i}": torch.full((100,), float(i)) for i in range(3)}
    with CheckpointWriter(tmp_path / "one", weights_stem=stem) as w:
        w.add_tensors(tensors)
        w.write_json("config.json", {})
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["config.json", "lowbit-model.safetensors"]
    with CheckpointWriter(tmp_path / "many", weights_stem=stem, max_shard_bytes=500) as w:
        w.add_tensors(tensors)
        w.write_json("config.json", {})
    idx = json.loads((tmp_path / "many" / "lowbit-model.safetensors.index.json").read_text())
    assert sorted(set(idx["weight_map"].values())) == [f"lowbit-model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert not list((tmp_path / "many").glob("model*"))
    for d in ("one", "many"):
        f = SafetensorsFolder(tmp_path / d)
        assert f.files.stem == stem and len(f) == 3 and torch.equal(f["t2"], tensors["t2"])
    # explicit shards must carry the stem; an unknown stem is refused
    w = CheckpointWriter(tmp_path / "bad", weights_stem=stem)
    with pytest.raises(FormatError, match="invalid shard file name 'model-00001-of-00001.safetensors'"):
        w.write_shard({"a": torch.ones(2)}, "model-00001-of-00001.safetensors")
    # a standard-named weights file left in the temporary folder is never published
    (w.tmp / "model.safetensors").write_bytes(b"stale")
    w.write_shard({"a": torch.ones(2)}, "lowbit-model-00001-of-00001.safetensors")
    w.write_json("config.json", {})
    with pytest.raises(FormatError, match="model.safetensors.*does not belong"):
        w.close()
    assert not (tmp_path / "bad").exists()
    w.abort()
    with pytest.raises(FormatError, match="unknown weights file stem 'weights'"):
        CheckpointWriter(tmp_path / "x", weights_stem="weights")


def test_folder_reports_damaged_files(tmp_path):
    d = tmp_path / "f"
    d.mkdir()
    save_file({"x": torch.arange(100, dtype=torch.float32)}, str(d / "model.safetensors"))
    raw = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(raw[:-10])
    with pytest.raises(FormatError, match="model.safetensors.*truncated"):
        SafetensorsFolder(d)
    (d / "model.safetensors").write_bytes(raw[:8] + b"{not json" + raw[17:])
    with pytest.raises(FormatError, match="model.safetensors.*corrupt header"):
        SafetensorsFolder(d)
    (d / "model.safetensors").write_bytes(b"\x00\x01")
    with pytest.raises(FormatError, match="truncated"):
        read_header(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00001-of-00001.safetensors"}}))
    with pytest.raises(FormatError, match="shard 'model-00001-of-00001.safetensors'.*missing"):
        SafetensorsFolder(d)
    assert issubclass(FormatError, LowbitError)


def test_ct_regex_targets_and_ignore():
    q = get_layout(CT).quantization_config(PRESETS["w8a8-fp8-dynamic"], ignore=["lm_head", "re:.*mlp\\.down_proj$"],
                                          targets=["re:.*_proj$"])
    _, parsed = parse_quantization_config({"quantization_config": q})
    assert parsed.scheme_for("model.layers.3.self_attn.o_proj") is PRESETS["w8a8-fp8-dynamic"]
    assert parsed.scheme_for("model.layers.3.mlp.down_proj") is None
    assert parsed.scheme_for("lm_head") is None
    assert parsed.scheme_for("model.layers.3.mlp.router") is None  # not targeted
