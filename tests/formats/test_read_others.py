"""Reading checkpoints made by other tools: llm-compressor (compressed-tensors 0.19 and 0.20 configs)
and auto-round. Fixtures are written by hand from the documented layouts (formats.md), with the
other tools' own arithmetic (int8 scales amax/127.5 with codes down to -128, bf16 NVFP4 global
scales), so nothing here needs those tools installed."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import lowbit
from helpers.models import tiny_llama
from lowbit.modules import FakeQuantLinear
from lowbit.errors import FormatError
from lowbit.formats import get_layout, parse_quantization_config
from lowbit.formats.autoround import fill_defaults
from lowbit.fusion import fused_groups
from lowbit.model_quant import every_linear, quantize_rtn
from lowbit.modules import QuantLinear
from lowbit.numerics import E4M3, INT8
from lowbit.quant import dequantize, pack_nibbles, quantize
from lowbit.schemes import PRESETS, WeightObserver, QuantSpec, Scheme
from helpers.formats_support import (
    assert_same_layers, float_tensors, llama_config, logits, quant_layers, quantized_model, write_folder,
)

LINEARS = [f"model.layers.{i}.{m}" for i in range(2) for m in
           ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")]


def _ids():
    return torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(3))


def _max_observer(spec: QuantSpec) -> QuantSpec:
    return dataclasses.replace(spec, observer=WeightObserver.MAX)


def _args(**kw):
    base = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "strategy": "tensor",
            "block_structure": None, "dynamic": False, "actorder": None, "observer": "minmax",
            "observer_kwargs": {}, "scale_dtype": None, "zp_dtype": None}
    base.update(kw)
    return base


def _ct_config(fmt, weights, acts, version):
    q = {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                       "output_activations": None, "format": fmt}},
         "ignore": ["lm_head"], "kv_cache_scheme": None, "global_compression_ratio": None,
         "sparsity_config": {}, "transform_config": {}, "version": version}
    if version.startswith("0.20"):  # 0.20 drops null fields and adds moe_sparsity_config
        q = copy.deepcopy(q)
        for g in q["config_groups"].values():
            for k in ("weights", "input_activations"):
                if g[k] is not None:
                    g[k] = {a: v for a, v in g[k].items() if v is not None and v != {}}
            g.pop("output_activations")
        q = {k: v for k, v in q.items() if v is not None}
        q["moe_sparsity_config"] = None
    return q


@pytest.mark.parametrize("version", ["0.19.0", "0.20.1"])
def test_llm_compressor_int8_w8a8(tmp_path, version):
    """bf16 model, scales amax/127.5 in bf16, codes in -128..127, shared q/k/v input scales."""
    model = tiny_llama().to(torch.bfloat16)
    tensors = float_tensors(model)
    expect = {}
    in_scales = {}
    for i, group in enumerate(fused_groups(LINEARS)):
        for n in group:
            in_scales[n] = torch.tensor([0.02 + 0.01 * i], dtype=torch.bfloat16)
    for n in LINEARS:
        w = tensors.pop(f"{n}.weight")
        scale = (w.abs().amax(dim=1, keepdim=True) / 127.5).to(torch.bfloat16)
        q = torch.clamp(torch.round(w.float() / scale.float()), -128, 127).to(torch.int8)
        tensors.update({f"{n}.weight": q, f"{n}.weight_scale": scale, f"{n}.input_scale": in_scales[n]})
        expect[n] = (q, scale)
    assert any(bool((q == -128).any()) for q, _ in expect.values())
    cfg = llama_config("bfloat16", quantization_config=_ct_config(
        "int-quantized", _args(strategy="channel"), _args(strategy="tensor"), version))
    folder = write_folder(tmp_path / "ct", cfg, tensors, shards=2)
    loaded = lowbit.load(folder, backend="reference")
    layers = quant_layers(loaded)
    assert list(layers) == LINEARS
    for n, (q, scale) in expect.items():
        m = layers[n]
        assert m.scheme is PRESETS["w8a8-int8"]
        assert torch.equal(INT8.codes_to_int(m.weight_codes), q.to(torch.int32))
        assert torch.equal(m.weight_scale, scale.float())  # the stored scale, exactly
        assert torch.equal(m.input_scale, in_scales[n].float())
        assert torch.equal(m.dequantized_weight(torch.bfloat16), (q.float() * scale.float()).to(torch.bfloat16))
    out = logits(loaded, _ids())
    assert out.dtype == torch.bfloat16 and bool(torch.isfinite(out).all())
    # what lowbit writes back is the same checkpoint, tensor for tensor
    lowbit.save(loaded, tmp_path / "again", format="compressed-tensors")
    again = lowbit.load(tmp_path / "again", backend="reference")
    assert_same_layers(loaded, again)


@pytest.mark.parametrize("version", ["0.19.0", "0.20.1"])
def test_llm_compressor_nvfp4(tmp_path, version):
    """NVFP4 with the bf16 weight global scale bf16(bf16(1/amax) * 2688), shared by q/k/v, gate/up."""
    model = tiny_llama().to(torch.bfloat16)
    tensors = float_tensors(model)
    spec = _max_observer(PRESETS["nvfp4"].weights)  # llm-compressor's minmax rule
    expect = {}
    for group in fused_groups(LINEARS):
        ws = {n: tensors.pop(f"{n}.weight") for n in group}
        amax = torch.stack([w.abs().amax() for w in ws.values()]).amax()
        g = ((torch.ones((), dtype=torch.bfloat16) / amax) * 2688).to(torch.bfloat16).float().reshape(1)
        for n, w in ws.items():
            qt = quantize(w, spec, global_scale=g)
            tensors.update({f"{n}.weight_packed": pack_nibbles(qt.codes),
                            f"{n}.weight_scale": qt.scale.to(torch.float8_e4m3fn),
                            f"{n}.weight_global_scale": g.clone(),
                            f"{n}.input_global_scale": torch.tensor([123.5])})
            expect[n] = qt
    nv = _args(num_bits=4, type="float", strategy="tensor_group", group_size=16, scale_dtype="torch.float8_e4m3fn",
               zp_dtype="torch.float8_e4m3fn")
    acts = dict(nv, dynamic="local", observer="static_minmax")
    cfg = llama_config("bfloat16", quantization_config=_ct_config("nvfp4-pack-quantized", nv, acts, version))
    loaded = lowbit.load(write_folder(tmp_path / "nv", cfg, tensors), backend="reference")
    for n, qt in expect.items():
        m = quant_layers(loaded)[n]
        # llm-compressor's "minmax" weight observer reads as "max": the nvfp4 preset's specs but
        # for the weight observer (the preset searches its weight scales), so not its name
        assert m.scheme == Scheme("ct-group_0", spec, PRESETS["nvfp4"].input_activations)
        assert m.weight_qtensor().equal(qt), n
        assert torch.equal(m.input_global_scale, torch.tensor([123.5]))
    assert bool(torch.isfinite(logits(loaded, _ids())).all())


def test_ct_unsupported_features_are_named(tmp_path):
    base = _ct_config("float-quantized", _args(type="float", strategy="channel"), None, "0.19.0")
    for edit, msg in [
        # the FP8 per-tensor static KV cache is read (tests/calibration/test_kv_cache.py); others are not
        (lambda q: q.update(kv_cache_scheme=_args(type="int")), "kv_cache_scheme"),
        (lambda q: q.update(kv_cache_scheme=_args(type="float", strategy="attn_head")), "kv_cache_scheme"),
        (lambda q: q.update(kv_cache_scheme=_args(type="float", dynamic=True)), "kv_cache_scheme"),
        (lambda q: q.update(kv_cache_scheme=_args(type="float", symmetric=False)), "kv_cache_scheme"),
        (lambda q: q["config_groups"]["group_0"]["weights"].update(strategy="block", block_structure=[128, 64]),
         "block_structure"),  # square blocks (FP8 block) are read; others are not
        (lambda q: q["config_groups"]["group_0"]["weights"].update(frobnicate=1), "frobnicate"),
        (lambda q: q["config_groups"]["group_0"].update(format="marlin-24"), "marlin-24"),
    ]:
        q = copy.deepcopy(base)
        edit(q)
        with pytest.raises(FormatError, match=msg):
            parse_quantization_config({"quantization_config": q})
    q = copy.deepcopy(base)
    q.update(kv_cache_scheme=_args(type="float"))
    assert parse_quantization_config({"quantization_config": q})[1].kv_cache == "fp8"


# ---------------------------------------------------------------------------- auto-round
def test_autoround_defaults_are_filled_explicitly():
    assert fill_defaults({}) == {"bits": 4, "group_size": 128, "sym": True, "data_type": "int", "act_bits": 16,
                                 "act_group_size": 128, "act_sym": True, "act_data_type": "float",
                                 "act_dynamic": True}
    d = fill_defaults({"bits": 4, "group_size": 16, "data_type": "nvfp4_v2", "act_bits": 4})
    assert (d["act_dynamic"], d["act_group_size"], d["act_data_type"]) == (True, 16, "nvfp4_v2")


def _autoround_cfg(packing, **fields):
    return llama_config(quantization_config={"quant_method": "auto-round", "packing_format": packing, **fields})


def test_autoround_nvfp4_e5m3_without_act_dynamic(tmp_path):
    """auto-round omits act_dynamic (default true); the folder must reload as lowbit's nvfp4-e5m3, bit for bit."""
    ids = _ids()
    ref = quantized_model("nvfp4-e5m3")
    lowbit.use_backend(ref, "reference")
    float_model = tiny_llama()
    tensors = float_tensors(float_model)
    for n, m in quant_layers(ref).items():
        del tensors[f"{n}.weight"]
        tensors[f"{n}.weight_packed"] = pack_nibbles(m.weight_codes)
        tensors[f"{n}.weight_scale"] = m.weight_qtensor().scale_codes()  # raw UE5M3 bytes
    cfg = _autoround_cfg("auto_round:llm_compressor_nvfp4_e5m3", bits=4, group_size=16, sym=True,
                         data_type="nvfp4_v2", act_bits=4, act_data_type="nvfp4_v2", act_group_size=16, act_sym=True,
                         extra_config={"lm_head": {"bits": 16, "data_type": "float", "act_bits": 16,
                                                   "act_data_type": "float"}})
    loaded = lowbit.load(write_folder(tmp_path / "ar", cfg, tensors), backend="reference")
    assert all(m.scheme is PRESETS["nvfp4-e5m3"] for m in quant_layers(loaded).values())
    assert quant_layers(loaded)["model.layers.0.mlp.down_proj"].scheme.input_activations.dynamic.value == "dynamic"
    assert_same_layers(ref, loaded)
    assert torch.equal(logits(loaded, ids), logits(ref, ids))


def test_autoround_fp8_static(tmp_path):
    ref = quantized_model("w8a8-fp8")
    lowbit.use_backend(ref, "reference")
    tensors = float_tensors(tiny_llama())
    for n, m in quant_layers(ref).items():
        del tensors[f"{n}.weight"]
        tensors[f"{n}.weight"] = m.weight_codes.view(torch.float8_e4m3fn)
        tensors[f"{n}.weight_scale"] = m.weight_scale.reshape(-1)  # auto-round stores [out]
        tensors[f"{n}.input_scale"] = m.input_scale.clone()
    cfg = _autoround_cfg("auto_round:fp8_static", bits=8, group_size=-1, data_type="fp", act_bits=8,
                         act_group_size=0, act_data_type="fp", act_dynamic=False, act_sym=True, fmt="e4m3",
                         activation_scheme="static", block_name_to_quantize="model.layers")
    loaded = lowbit.load(write_folder(tmp_path / "ar", cfg, tensors), backend="reference")
    assert all(m.scheme is PRESETS["w8a8-fp8"] for m in quant_layers(loaded).values())
    assert_same_layers(ref, loaded)
    assert not isinstance(loaded.lm_head, QuantLinear)  # outside block_name_to_quantize
    assert torch.equal(logits(loaded, _ids()), logits(ref, _ids()))


def test_autoround_llm_compressor_nvfp4(tmp_path):
    # auto-round records no observer: its weights read with "max" (not the nvfp4 preset's "mse")
    nv = PRESETS["nvfp4"]
    ref = quantized_model(Scheme("auto-round-nv_fp-w4", _max_observer(nv.weights), nv.input_activations))
    lowbit.use_backend(ref, "reference")
    tensors = float_tensors(tiny_llama())
    ct = get_layout("compressed-tensors")
    for n, m in quant_layers(ref).items():
        del tensors[f"{n}.weight"]
        tensors.update(ct.linear_tensors(n, m.weight_qtensor(), m.scheme, input_global_scale=m.input_global_scale,
                                         dtype=torch.float32))
    cfg = _autoround_cfg("auto_round:llm_compressor", bits=4, group_size=16, data_type="nv_fp", act_bits=4,
                         act_data_type="nv_fp4_with_static_gs", act_group_size=16, act_sym=True, act_dynamic=False)
    loaded = lowbit.load(write_folder(tmp_path / "ar", cfg, tensors), backend="reference")
    assert_same_layers(ref, loaded)
    assert torch.equal(logits(loaded, _ids()), logits(ref, _ids()))


def test_autoround_fake_weight_only(tmp_path):
    scheme = Scheme("int4-g32", QuantSpec("int4", "group", 32), None)
    ref = tiny_llama()
    quantize_rtn(ref, every_linear(ref, scheme))
    lowbit.use_backend(ref, "reference")
    tensors = float_tensors(tiny_llama())
    for n, m in quant_layers(ref).items():
        tensors[f"{n}.weight"] = dequantize(m.weight_qtensor(), torch.float32)
    cfg = _autoround_cfg("auto_round:fake", bits=4, group_size=32, sym=True, data_type="int")
    loaded = lowbit.load(write_folder(tmp_path / "ar", cfg, tensors), backend="reference")
    fakes = [m for m in loaded.modules() if isinstance(m, FakeQuantLinear)]
    assert len(fakes) == 14 and fakes[0].scheme.weights == scheme.weights and fakes[0].scheme.weight_only
    assert torch.equal(logits(loaded, _ids()), logits(ref, _ids()))


def test_autoround_unsupported_packing_and_types_are_named():
    for fields, msg in [
        ({"packing_format": "auto_round:auto_awq"}, "packing_format 'auto_round:auto_awq'"),
        ({"packing_format": "auto_round:llm_compressor", "data_type": "mx_int"}, "data_type 'mx_int'"),
        ({"packing_format": "auto_round:llm_compressor", "bits": 4, "group_size": 16, "data_type": "nv_fp",
          "act_bits": 4, "act_data_type": "nv_fp", "act_dynamic": True}, "dynamic global scale"),
        ({"packing_format": "auto_round:fp8_static", "group_size": [128, 128]}, "block-wise"),
    ]:
        with pytest.raises(FormatError, match=msg):
            parse_quantization_config({"quantization_config": {"quant_method": "auto-round", **fields}})
    _, parsed = parse_quantization_config({"quantization_config": {
        "quant_method": "auto-round", "packing_format": "auto_round:llm_compressor", "bits": 4, "group_size": 32,
        "data_type": "mx_fp", "act_bits": 4, "act_data_type": "mx_fp", "act_group_size": 32}})
    assert parsed.scheme_for("model.layers.0.mlp.up_proj") is PRESETS["mxfp4"]
    assert parsed.scheme_for("lm_head", is_output_embedding=True) is None
    assert E4M3.max_finite == 448.0


def test_autoround_fake_static_fp8_keeps_input_scales(tmp_path):
    ref = quantized_model("w8a8-fp8")
    lowbit.use_backend(ref, "reference")
    tensors = float_tensors(tiny_llama())
    for n, m in quant_layers(ref).items():
        tensors[f"{n}.weight"] = m.dequantized_weight(torch.float32)
        tensors[f"{n}.input_scale"] = m.input_scale.clone()
    cfg = _autoround_cfg("auto_round:fake", bits=8, group_size=-1, data_type="fp", act_bits=8, act_group_size=0,
                         act_data_type="fp", act_dynamic=False)
    loaded = lowbit.load(write_folder(tmp_path / "ar", cfg, tensors), backend="reference")
    fake = loaded.model.layers[0].self_attn.v_proj
    assert isinstance(fake, FakeQuantLinear) and fake.scheme is PRESETS["w8a8-fp8"]
    assert torch.equal(fake.input_scale, quant_layers(ref)["model.layers.0.self_attn.v_proj"].input_scale)
    assert torch.equal(logits(loaded, _ids()), logits(ref, _ids()))
    del tensors["model.layers.0.self_attn.v_proj.input_scale"]
    with pytest.raises(FormatError, match="v_proj.input_scale.*missing"):
        lowbit.load(write_folder(tmp_path / "ar2", cfg, tensors))
