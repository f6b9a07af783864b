"""Peers' checkpoints lowbit reads: auto-round ``auto_round:fake`` FP8_STATIC folders (weights
QDQ'd, ``act_max_scale`` tensors, no input scales) and compressed-tensors folders in auto-round's
``nvfp4-e5m3-pack-quantized`` format. Folders are written here exactly as auto-round 0.16.1
writes them (config keys, tensor names, dtypes); the reference numbers are auto-round's own
arithmetic, re-implemented in the test."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import lowbit
from helpers.models import tiny_llama
from lowbit.modules import FakeQuantLinear
from lowbit.errors import FormatError, SchemeError
from lowbit.files.folder import read_config
from lowbit.formats.autoround_fake import FP8_DYNAMIC_SCALE_FLOOR
from lowbit.numerics import FormatName
from lowbit.quant import fake_quantize, pack_nibbles, quantize
from lowbit.kernels import Implementation, using
from lowbit.schemes import PRESETS, Dynamic, Granularity, QuantSpec, Scheme
from helpers.formats_support import assert_same_layers, float_tensors, llama_config, logits, quant_layers, \
    quantized_model, write_folder

LINEARS = [f"model.layers.{i}.{m}" for i in range(2) for m in
           ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")]
DYN_TENSOR_FP8 = QuantSpec(FormatName.E4M3, Granularity.TENSOR, dynamic=Dynamic.DYNAMIC,
                           scale_floor=1.0 / (448 * 512))


def _with(impl):
    def qdq(x, spec, **kw):
        with using(impl):
            return fake_quantize(x, spec, **kw)
    return qdq


IMPLEMENTATIONS = (_with(Implementation.REFERENCE), _with(Implementation.TORCH))


def _ids():
    return torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(3))


def ar_fp8_qdq(x: torch.Tensor, per_row: bool) -> torch.Tensor:
    """auto-round's quant_fp8_sym (data_type/fp8.py) with max_scale 1: scale = max|x| / 448 per
    row (group_size -1) or over the whole tensor (group_size 0), at least 1 / (448 * 512)."""
    t = x.reshape(-1, x.shape[-1]) if per_row else x.reshape(1, -1)
    scale = torch.abs(t).max(dim=-1)[0].to(torch.float32) / torch.finfo(torch.float8_e4m3fn).max
    scale = torch.clip(scale, min=float(1.0 / (448.0 * 512.0))).unsqueeze(-1)
    q = torch.clip(t / scale, -448.0, 448.0).to(torch.float8_e4m3fn).to(t.dtype) * scale
    return q.reshape(x.shape).to(x.dtype)


# ---------------------------------------------------------------------------- the numerics
def test_dynamic_per_tensor_fp8_with_floor_is_auto_rounds_rule():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=g) * torch.logspace(-2, 2, 64)
    for spec_fn in IMPLEMENTATIONS:
        assert torch.equal(spec_fn(x, DYN_TENSOR_FP8), ar_fp8_qdq(x, per_row=False))
    tiny = torch.tensor([[1e-7, -3e-7, 0.0, 2e-6]])  # amax / 448 is far below the floor
    qt = quantize(tiny, DYN_TENSOR_FP8)
    assert float(qt.scale.reshape(-1)[0]) == pytest.approx(1.0 / (448 * 512), rel=1e-7)
    for spec_fn in IMPLEMENTATIONS:
        out = spec_fn(tiny, DYN_TENSOR_FP8)
        assert torch.equal(out, ar_fp8_qdq(tiny, per_row=False))
        assert not torch.equal(out, fake_quantize(tiny, QuantSpec("e4m3", "tensor", dynamic="dynamic")))
        assert torch.equal(spec_fn(torch.zeros(2, 8), DYN_TENSOR_FP8), torch.zeros(2, 8))


def test_scale_floor_is_data_of_the_spec():
    d = DYN_TENSOR_FP8.to_dict()
    assert d["scale_floor"] == 1.0 / (448 * 512) and QuantSpec.from_dict(d) == DYN_TENSOR_FP8
    assert "scales >= " in DYN_TENSOR_FP8.describe()
    plain = QuantSpec("e4m3", "tensor", dynamic="dynamic")
    old = {k: v for k, v in plain.to_dict().items() if k != "scale_floor"}  # written before the field
    assert QuantSpec.from_dict(old) == plain and plain.scale_floor is None
    for bad in (0.0, -1.0, float("inf"), True, "1e-6"):
        with pytest.raises(SchemeError, match="scale_floor"):
            QuantSpec("e4m3", "tensor", dynamic="dynamic", scale_floor=bad)
    with pytest.raises(SchemeError, match="scale_floor"):
        QuantSpec("e2m1", "group", 16, scale_format="ue5m3", scale_floor=1e-6)
    from lowbit.formats.ct_args import ct_format_of
    with pytest.raises(FormatError, match="scale floor .* has no compressed-tensors field"):
        ct_format_of(Scheme("fp8-floored", PRESETS["w8a8-fp8"].weights, DYN_TENSOR_FP8))


# ---------------------------------------------------------------------------- auto-round fake FP8_STATIC
def _autoround_fake_fp8_folder(path, with_input_scales: bool = False):
    """auto-round 0.16.1, scheme FP8_STATIC, iters 0, format "fake": save_pretrained of the model
    with QDQ'd weights and each WrapperLinear's tunable act_max_scale (float32 [1], 1.0 after
    RTN); the quantization_config after filter_quantization_config (defaults and nulls dropped)."""
    model = tiny_llama()
    tensors = float_tensors(model)
    for n in LINEARS:
        tensors[f"{n}.weight"] = ar_fp8_qdq(tensors[f"{n}.weight"], per_row=True)
        tensors[f"{n}.act_max_scale"] = torch.ones(1, dtype=torch.float32)
        if with_input_scales:
            tensors[f"{n}.input_scale"] = torch.tensor([0.02])
    qcfg = {"bits": 8, "group_size": -1, "sym": True, "data_type": "fp", "act_bits": 8, "act_group_size": 0,
            "act_sym": True, "act_data_type": "fp", "act_dynamic": False, "iters": 0, "autoround_version": "0.16.1",
            "quant_method": "auto-round", "packing_format": "auto_round:fake",
            "block_name_to_quantize": "model.layers"}
    return write_folder(path, llama_config(quantization_config=qcfg), tensors), tensors


def _auto_round_reference(tensors):
    """tiny_llama with the stored weights, each quantized Linear's input QDQ'd as auto-round's
    FakeActQuantLinear does (dynamic per tensor, whatever act_dynamic says)."""
    ref = tiny_llama()
    ref.load_state_dict({k: v for k, v in tensors.items() if not k.endswith("act_max_scale")}, strict=False)
    for n in LINEARS:
        lin = ref.get_submodule(n)
        lin.forward = (lambda m: lambda x: F.linear(ar_fp8_qdq(x, per_row=False), m.weight, m.bias))(lin)
    return ref


def test_autoround_fake_fp8_static_without_input_scales_runs_as_auto_round_does(tmp_path):
    folder, tensors = _autoround_fake_fp8_folder(tmp_path / "ar")
    with pytest.warns(UserWarning, match="static FP8 input scales were not exported") as rec:
        loaded = lowbit.load(folder, backend="reference")
    assert sum("not exported" in str(w.message) for w in rec) == 1  # once per folder, not per layer
    fakes = {n: m for n, m in loaded.named_modules() if isinstance(m, FakeQuantLinear)}
    assert sorted(fakes) == sorted(LINEARS)
    for m in fakes.values():
        assert m.scheme.input_activations == DYN_TENSOR_FP8 and m.input_scale is None
        assert m.scheme.input_activations.scale_floor == FP8_DYNAMIC_SCALE_FLOOR
        assert m.scheme.weights == PRESETS["w8a8-fp8"].weights
    assert not isinstance(loaded.lm_head, FakeQuantLinear)
    ids = _ids()
    with torch.no_grad():
        want = _auto_round_reference(tensors)(ids).logits
    assert torch.equal(logits(loaded, ids), want)


def test_autoround_fake_fp8_with_input_scales_keeps_them_static(tmp_path):
    folder, _ = _autoround_fake_fp8_folder(tmp_path / "ar", with_input_scales=True)
    loaded = lowbit.load(folder, backend="reference")  # act_max_scale read (checked), scales static
    v = loaded.model.layers[0].self_attn.v_proj
    assert v.scheme is PRESETS["w8a8-fp8"] and float(v.input_scale) == pytest.approx(0.02)


@pytest.mark.filterwarnings("ignore:auto-round fake checkpoint")
def test_autoround_fake_bad_act_max_scale_is_named(tmp_path):
    folder, tensors = _autoround_fake_fp8_folder(tmp_path / "ar")
    tensors["model.layers.1.mlp.up_proj.act_max_scale"] = torch.ones(2)
    write_folder(folder, read_config(folder), tensors)
    with pytest.raises(FormatError, match="model.layers.1.mlp.up_proj.act_max_scale.*one finite float"):
        lowbit.load(folder)


# ---------------------------------------------------------------------------- nvfp4-e5m3-pack-quantized
def _e5m3_ct_config():
    """auto-round's export_to_llmcompressor for data_type nvfp4_v2 (initialize_nvfp4_e5m3_quantization)."""
    def args(dynamic):
        return {"actorder": None, "block_structure": None, "dynamic": dynamic, "group_size": 16, "num_bits": 4,
                "observer": "minmax", "observer_kwargs": {}, "strategy": "tensor_group", "symmetric": True,
                "type": "float"}
    return {"config_groups": {"group_0": {"input_activations": args("local"), "output_activations": None,
                                          "targets": ["Linear"], "weights": args(False)}},
            "format": "nvfp4-e5m3-pack-quantized", "global_compression_ratio": None, "ignore": ["lm_head"],
            "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "provider": "auto-round"}


def test_ct_nvfp4_e5m3_pack_quantized_reads_as_lowbits_nvfp4_e5m3(tmp_path):
    ref = quantized_model("nvfp4-e5m3")
    lowbit.use_backend(ref, "reference")
    tensors = float_tensors(tiny_llama())
    for n, m in quant_layers(ref).items():
        del tensors[f"{n}.weight"]
        tensors[f"{n}.weight_packed"] = pack_nibbles(m.weight_codes)          # uint8 [out, in/2], low nibble first
        tensors[f"{n}.weight_scale"] = m.weight_qtensor().scale_codes()       # uint8 UE5M3 codes [out, in/16]
        assert tensors[f"{n}.weight_scale"].dtype == torch.uint8
    folder = write_folder(tmp_path / "ct", llama_config(quantization_config=_e5m3_ct_config()), tensors)
    loaded = lowbit.load(folder, backend="reference")
    layers = quant_layers(loaded)
    assert sorted(layers) == sorted(LINEARS)
    assert all(m.scheme is PRESETS["nvfp4-e5m3"] for m in layers.values())
    assert loaded.lowbit_source == "compressed-tensors (auto-round)"
    assert_same_layers(ref, loaded)
    assert torch.equal(logits(loaded, _ids()), logits(ref, _ids()))
    bad = _e5m3_ct_config()
    bad["config_groups"]["group_0"]["weights"]["group_size"] = 32
    write_folder(tmp_path / "bad", llama_config(quantization_config=bad), tensors)
    with pytest.raises(FormatError, match="nvfp4-e5m3-pack-quantized needs strategy tensor_group, group_size 16"):
        lowbit.load(tmp_path / "bad")


def test_writing_nvfp4_e5m3_as_compressed_tensors_is_refused_with_the_reason(tmp_path):
    model = quantized_model("nvfp4-e5m3")
    with pytest.raises(FormatError, match=r"stock transformers \+ compressed-tensors read .*'nvfp4-e5m3-pack-"
                                          r"quantized' as standard NVFP4 .*without an error.*format.{0,3}lowbit"):
        lowbit.save(model, tmp_path / "out", format="compressed-tensors")
