"""Mixed precision in memory and on disk: ``lowbit.quantize(model, recipe)`` gives every linear its
recipe's scheme (RTN and calibrated), a uniform recipe is the plain scheme bit for bit, and the three
formats round-trip a mixed model exactly; compressed-tensors writes the folder compressed-tensors'
own ModelCompressor writes for the same groups, which transformers loads."""

from __future__ import annotations

import json

import pytest
import torch

import lowbit
from helpers.ct_client import client_logits
from helpers.formats_support import logits
from helpers.models import tiny_llama
from helpers.moe_models import tiny_moe
from lowbit.checkpoint.inspect import inspect_checkpoint
from lowbit.errors import QuantizationError
from lowbit.files.folder import SafetensorsFolder
from lowbit.modules import QuantLinear
from lowbit.recipes import RecipeError
from lowbit.schemes import PRESETS

torch.set_grad_enabled(False)
CALIB = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(3))
IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
DIMS = {"hidden_size": 128, "intermediate_size": 256}
ATTN8 = {r"re:.*self_attn": "w8a8-int8-dynamic", "default": "w4a16"}
FP8_DOWN = {r"re:.*mlp\.down_proj": "w8a8-fp8", "default": "nvfp4"}


def _schemes(model) -> dict[str, str]:
    return {n: m.scheme.name for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def _same_codes(a, b) -> None:
    la = {n: m for n, m in a.named_modules() if isinstance(m, QuantLinear)}
    lb = {n: m for n, m in b.named_modules() if isinstance(m, QuantLinear)}
    assert la.keys() == lb.keys()
    for n in la:
        assert la[n].scheme == lb[n].scheme, n
        for attr in ("weight_codes", "weight_scale", "input_scale", "input_global_scale"):
            x, y = getattr(la[n], attr, None), getattr(lb[n], attr, None)
            assert (x is None and y is None) or torch.equal(x, y), (n, attr)


def test_rtn_recipe_gives_each_linear_its_scheme_and_the_codes_of_that_scheme_alone():
    q = lowbit.quantize(tiny_llama(**DIMS), ATTN8)
    got = _schemes(q)
    assert {s for n, s in got.items() if ".self_attn." in n} == {"w8a8-int8-dynamic"}
    assert {s for n, s in got.items() if ".mlp." in n} == {"w4a16"}
    whole_int8, whole_int4 = lowbit.quantize(tiny_llama(**DIMS), "w8a8-int8-dynamic"), lowbit.quantize(tiny_llama(**DIMS), "w4a16")
    for n, m in q.named_modules():
        if isinstance(m, QuantLinear):
            ref = (whole_int8 if ".self_attn." in n else whole_int4).get_submodule(n)
            assert torch.equal(m.weight_codes, ref.weight_codes) and torch.equal(m.weight_scale, ref.weight_scale), n
    assert q.lowbit_recipe.counts() == {"w8a8-int8-dynamic": 8, "w4a16": 6}


@pytest.mark.parametrize("recipe", [{"Linear": "nvfp4"}, {"default": "nvfp4"}])
def test_a_uniform_recipe_is_the_plain_scheme_bit_for_bit(recipe):
    a = lowbit.quantize(tiny_llama(num_hidden_layers=2), recipe, calibration=CALIB, num_samples=4, seq_len=32,
                        reconstruct_iters=4)
    b = lowbit.quantize(tiny_llama(num_hidden_layers=2), "nvfp4", calibration=CALIB, num_samples=4, seq_len=32,
                        reconstruct_iters=4)
    _same_codes(a, b)
    assert a.lowbit_recipe is None


@pytest.fixture(scope="module")
def calibrated():
    """nvfp4 with down_proj in static w8a8-fp8, calibrated by the defaults (GPTQ + reconstruction
    for the 4-bit linears, static FP8 input scales with SmoothQuant's FP8 alpha for down_proj)."""
    return lowbit.quantize(tiny_llama(num_hidden_layers=2), FP8_DOWN, calibration=CALIB, num_samples=4, seq_len=32)


def test_calibrated_recipe_runs_each_schemes_calibration(calibrated):
    q = calibrated
    rep = q.lowbit_calibration
    assert rep.scheme == "nvfp4+w8a8-fp8" and rep.weight_rounding == "gptq"
    down = q.get_submodule("model.layers.0.mlp.down_proj")
    assert down.scheme == PRESETS["w8a8-fp8"] and down.input_scale is not None  # a static FP8 input scale
    assert q.get_submodule("model.layers.0.self_attn.q_proj").input_global_scale is not None
    # reconstruction ran on the 4-bit linears with down_proj fixed, and lowered the layer's error
    for layer in ("model.layers.0", "model.layers.1"):
        r = rep.reconstruct[layer]
        assert r["check_end"] < r["check_start"] and r["weights"] == sum(
            m.weight_codes.numel() for n, m in q.named_modules()
            if isinstance(m, QuantLinear) and n.startswith(layer + ".") and m.scheme.name == "nvfp4")
    assert rep.smoothquant == {"nvfp4": None, "w8a8-fp8": 0.5}


def test_a_fixed_linear_passes_the_gradient_to_the_linears_before_it():
    """With o_proj in 8 bits and fixed, reconstruction still moves v_proj (whose only path to the
    loss goes through o_proj's input QDQ)."""
    recipe = {r"re:.*o_proj": "w8a8-int8-dynamic", "default": "nvfp4"}  # o_proj: RTN, no steps by default
    a = lowbit.quantize(tiny_llama(num_hidden_layers=1), recipe, calibration=CALIB, num_samples=4, seq_len=32)
    b = lowbit.quantize(tiny_llama(num_hidden_layers=1), recipe, calibration=CALIB, num_samples=4, seq_len=32,
                        reconstruct_iters=0)
    o, v = "model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.v_proj"
    assert torch.equal(a.get_submodule(o).weight_codes, b.get_submodule(o).weight_codes)  # fixed
    assert a.lowbit_calibration.reconstruct["model.layers.0"]["changed"] > 0
    assert not torch.equal(a.get_submodule(v).weight_codes, b.get_submodule(v).weight_codes)


@pytest.mark.parametrize("fmt", ["lowbit", "fake", "compressed-tensors"])
def test_mixed_models_round_trip_exactly(calibrated, fmt, tmp_path):
    out = lowbit.save(calibrated, tmp_path / "out", format=fmt)
    back = lowbit.load(out)
    assert _schemes(back) == _schemes(calibrated) if fmt != "fake" else True
    assert torch.equal(logits(back, IDS), logits(calibrated, IDS))
    r = inspect_checkpoint(out)
    assert not r["inconsistencies"]
    assert sorted((g["layers"], g["spec"]["weights"]["format"]) for g in r["groups"]) == [(2, "e4m3"), (12, "e2m1")]


def test_rtn_recipe_without_calibration_data_refuses_static_schemes():
    with pytest.raises(QuantizationError, match="scheme w8a8-fp8 has static activation scales"):
        lowbit.quantize(tiny_llama(), {r"re:.*mlp\.down_proj": "w8a8-fp8", "default": "w4a16"})


def test_recipe_errors_leave_the_model_float():
    m = tiny_llama()
    with pytest.raises(RecipeError, match="matches no quantizable linear"):
        lowbit.quantize(m, {"re:.*nope": "nvfp4"})
    assert not _schemes(m)


def test_moe_experts_in_4_bits_attention_in_8(tmp_path):
    q = lowbit.quantize(tiny_moe("qwen3_moe"), {r"re:.*experts": "w4a16", "default": "w8a8-int8"}, calibration=CALIB,
                        num_samples=4, seq_len=32)
    got = _schemes(q)
    assert {s for n, s in got.items() if ".experts." in n} == {"w4a16"}
    assert {s for n, s in got.items() if ".self_attn." in n} == {"w8a8-int8"}
    for fmt in ("lowbit", "compressed-tensors"):
        back = lowbit.load(lowbit.save(q, tmp_path / fmt, format=fmt))
        assert _schemes(back) == got and torch.equal(logits(back, IDS), logits(q, IDS))


def _ct_mixed_folder(out):
    """The same two groups quantized and compressed by compressed-tensors itself, given lowbit's scales."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme
    from lowbit.formats.lowbit_layout import file_scale
    from lowbit.quant import quantize

    model = tiny_llama(**DIMS)
    attn = [n for n, _ in model.named_modules() if ".self_attn." in n and n.endswith("_proj")]
    mlp = [n for n, _ in model.named_modules() if ".mlp." in n and n.endswith("_proj")]
    apply_quantization_config(model, QuantizationConfig(config_groups={
        "group_0": preset_name_to_scheme("W4A16", mlp), "group_1": preset_name_to_scheme("FP8_DYNAMIC", attn)},
        ignore=["lm_head"]))
    with torch.no_grad():
        for n, m in model.named_modules():
            if hasattr(m, "weight_scale"):
                spec = PRESETS["w4a16" if n in mlp else "w8a8-fp8-dynamic"].weights
                qt = quantize(m.weight.float(), spec)
                m.weight_scale.copy_(file_scale(qt.scale, spec).reshape(m.weight_scale.shape).to(m.weight_scale.dtype))
    comp = ModelCompressor.from_pretrained_model(model)
    comp.compress_model(model)
    model.save_pretrained(out)
    comp.update_config(out)
    return out


def test_compressed_tensors_mixed_folder_is_what_compressed_tensors_writes(tmp_path):
    pytest.importorskip("compressed_tensors")
    theirs = _ct_mixed_folder(tmp_path / "ct")
    ours = lowbit.save(lowbit.quantize(tiny_llama(**DIMS), {r"re:.*mlp": "w4a16", "default": "w8a8-fp8-dynamic"}),
                       tmp_path / "lb", format="compressed-tensors")
    a, b = SafetensorsFolder(theirs), SafetensorsFolder(ours)
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    ca = json.loads((theirs / "config.json").read_text())["quantization_config"]
    cb = json.loads((ours / "config.json").read_text())["quantization_config"]
    assert ca["format"] == cb["format"] == "mixed-precision"
    fields = ("num_bits", "type", "symmetric", "group_size", "strategy", "dynamic")
    def groups(c):
        return sorted((g["format"], tuple(sorted(g["targets"])), tuple(g["weights"][f] for f in fields),
                       None if g["input_activations"] is None else tuple(g["input_activations"][f] for f in fields))
                      for g in c["config_groups"].values())
    assert groups(ca) == groups(cb)
    # and lowbit reads theirs as it reads its own
    assert _schemes(lowbit.load(theirs)).keys() == _schemes(lowbit.load(ours)).keys()
    assert torch.equal(logits(lowbit.load(theirs), IDS), logits(lowbit.load(ours), IDS))


@pytest.mark.subprocess
def test_transformers_loads_a_mixed_compressed_tensors_folder(tmp_path):
    pytest.importorskip("compressed_tensors")
    # (the schemes whose arithmetic transformers reproduces exactly: static INT8 and FP8, INT4 weights)
    q = lowbit.quantize(tiny_llama(**DIMS), {r"re:.*self_attn": "w8a8-int8", r"re:.*down_proj": "w8a8-fp8",
                                             "default": "w4a16"}, calibration=CALIB, num_samples=4, seq_len=32)
    lowbit.use_backend(q, "reference")
    ref = logits(q, IDS).float()
    lowbit.save(q, tmp_path / "mixed", format="compressed-tensors")
    got = client_logits(tmp_path, IDS, {"mixed": (str(tmp_path / "mixed"), "float32")})["mixed"]
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_a_layer_without_reconstruction_still_advances_the_float_targets():
    """Layer 1 all in 8 bits (no reconstruction steps) between reconstructed 4-bit layers: layer 2's
    targets are the float model's outputs of layer 2, so its starting error is the uniform run's
    order, not that of a layer skipped (it once was: the float hidden states stood still)."""
    recipe = {r"re:model\.layers\.1\.": "w8a8-int8-dynamic", "default": "nvfp4"}
    mixed = lowbit.quantize(tiny_llama(num_hidden_layers=3), recipe, calibration=CALIB, num_samples=4, seq_len=32)
    uniform = lowbit.quantize(tiny_llama(num_hidden_layers=3), "nvfp4", calibration=CALIB, num_samples=4, seq_len=32)
    a, b = mixed.lowbit_calibration.reconstruct, uniform.lowbit_calibration.reconstruct
    assert "model.layers.1" not in a and "model.layers.2" in a
    assert a["model.layers.2"]["check_start"] < 2 * b["model.layers.2"]["check_start"]
