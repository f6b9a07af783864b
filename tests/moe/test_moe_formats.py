"""MoE checkpoints: per-expert tensors under the family's names, routers in ``ignore``, exact
round trips through the three formats."""

from __future__ import annotations

import json

import pytest
import torch

import lowbit
from helpers.moe_models import tiny_moe
from lowbit.files.folder import SafetensorsFolder

torch.set_grad_enabled(False)
CALIB = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(3))
IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(4))


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe", "deepseek_v3", "mixtral", "gpt_oss"])
def quantized(request):
    return request.param, lowbit.quantize(tiny_moe(request.param), "w8a8-int8", calibration=CALIB,
                                          num_samples=4, seq_len=32)


@pytest.mark.parametrize("fmt", ["lowbit", "fake", "compressed-tensors"])
def test_round_trip_is_exact(quantized, fmt, tmp_path):
    family, q = quantized
    lowbit.save(q, tmp_path / "out", format=fmt)
    back = lowbit.load(tmp_path / "out")
    a, b = q.model.layers[1].mlp.experts[5].down_proj, back.model.layers[1].mlp.experts[5].down_proj
    assert torch.equal(a.input_scale.reshape(-1), b.input_scale.reshape(-1))
    if fmt == "fake":  # the dequantized weights, exactly (they run on the float path, not the integer one)
        assert torch.equal(b.weight, a.dequantized_weight(torch.float32))
    else:  # codes and scales back bit for bit, the same backend: the same logits
        assert torch.equal(a.weight_qtensor().codes, b.weight_qtensor().codes)
        assert torch.equal(back(input_ids=IDS).logits, q(input_ids=IDS).logits)


def test_compressed_tensors_uses_per_expert_checkpoint_names_and_ignores_routers(quantized, tmp_path):
    family, q = quantized
    out = lowbit.save(q, tmp_path / "ct", format="compressed-tensors")
    keys = set(SafetensorsFolder(out))
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    if family == "mixtral":  # Mixtral's own names: block_sparse_moe, w1 (gate) / w3 (up) / w2 (down)
        expert = "model.layers.1.block_sparse_moe.experts.7"
        assert {f"{expert}.w1.weight", f"{expert}.w3.weight", f"{expert}.w2.weight"} <= keys
        assert not any(".mlp." in k for k in keys)
        routers = {"model.layers.0.block_sparse_moe.gate", "model.layers.1.block_sparse_moe.gate"}
    else:
        expert = "model.layers.1.mlp.experts.7"
        assert {f"{expert}.gate_proj.weight", f"{expert}.up_proj.weight", f"{expert}.down_proj.weight",
                f"{expert}.down_proj.weight_scale", f"{expert}.down_proj.input_scale"} <= keys
        router = "router" if family == "gpt_oss" else "gate"
        routers = {f"model.layers.1.mlp.{router}"}
        if family == "qwen2_moe":
            routers.add("model.layers.1.mlp.shared_expert_gate")
    assert routers <= set(qcfg["ignore"])
    assert not any(k.endswith("gate_up_proj") for k in keys)
    assert torch.equal(SafetensorsFolder(out)[f"{expert}.{'w2' if family == 'mixtral' else 'down_proj'}.weight"],
                       q.model.layers[1].mlp.experts[7].down_proj.weight_qtensor().codes.view(torch.int8))


def test_mixtral_legacy_float_checkpoint_names_load(tmp_path):
    """A Mixtral folder in the legacy layout (what the hub holds) loads through lowbit's names."""
    q = lowbit.quantize(tiny_moe("mixtral"), "w4a16", ignore=[r".*experts\.[0-3]\..*"])
    out = lowbit.save(q, tmp_path / "mx", format="lowbit")
    keys = set(SafetensorsFolder(out))
    assert "model.layers.0.block_sparse_moe.experts.0.w1.weight" in keys  # float experts, legacy names
    back = lowbit.load(out, backend="reference")
    assert torch.equal(back.model.layers[0].mlp.experts[0].gate_proj.weight,
                       q.model.layers[0].mlp.experts[0].gate_proj.weight)
    torch.testing.assert_close(back(input_ids=IDS).logits, q(input_ids=IDS).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("fmt", ["fake", "compressed-tensors"])
def test_inspect_reads_folders_as_load_does(quantized, fmt, tmp_path):
    """inspect and load read through one view (moe split, legacy names, static scales renamed): a
    Mixtral fake folder keeps its static scales under the checkpoint's own names."""
    from lowbit.checkpoint.inspect import inspect_checkpoint

    family, q = quantized
    out = lowbit.save(q, tmp_path / fmt, format=fmt)
    assert inspect_checkpoint(out)["inconsistencies"] == []


def test_inspect_reports_experts_per_block(quantized, tmp_path, capsys):
    from helpers.cli import run

    family, q = quantized
    out = lowbit.save(q, tmp_path / "ct", format="compressed-tensors")
    from lowbit.checkpoint.inspect import inspect_checkpoint

    r = inspect_checkpoint(out)
    assert r["inconsistencies"] == []
    blocks = 1 if family == "deepseek_v3" else 2  # DeepSeek-V3's first layer is dense
    assert r["experts"] == {f"model.layers.{i}.mlp.experts": {"experts": 8, "quantized": 8}
                            for i in range(2 - blocks, 2)}
    code, text, _ = run(capsys, "inspect", out)
    assert code == 0 and f"MoE: {blocks} expert blocks of 8 experts; {8 * blocks} of {8 * blocks} experts quantized" in text


@pytest.mark.subprocess
def test_stock_transformers_loads_moe_compressed_tensors_output(tmp_path):
    """transformers + compressed-tensors alone read the per-expert w4a16 output (Qwen3-MoE names,
    Mixtral's legacy ones) to the same logits. (Int8 and NVFP4 MoE folders transformers 5.24 does
    not load: its expert merging rejects them; FP8-dynamic loads, with float expert activations.)"""
    import subprocess
    import sys

    from safetensors.torch import load_file, save_file

    from helpers.ct_client import CLIENT

    pytest.importorskip("compressed_tensors")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))
    refs, folders = {}, {}
    for family in ("qwen3_moe", "mixtral"):
        q = lowbit.quantize(tiny_moe(family), "w4a16")
        lowbit.use_backend(q, "reference")
        refs[family] = q(input_ids=ids).logits
        lowbit.save(q, tmp_path / family, format="compressed-tensors")
        folders[family] = (str(tmp_path / family), "float32")
    save_file({"ids": ids}, str(tmp_path / "ids.safetensors"))
    jobs = {"ids": str(tmp_path / "ids.safetensors"), "out": str(tmp_path / "logits.safetensors"), "folders": folders}
    p = subprocess.run([sys.executable, "-c", CLIENT, json.dumps(jobs)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = load_file(str(tmp_path / "logits.safetensors"))
    for family, ref in refs.items():
        assert (got[family] - ref).abs().max().item() <= 1e-5 * ref.abs().max().item(), family


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "mixtral"])
@pytest.mark.parametrize("scheme", ["w8a8-fp8-dynamic", "nvfp4", "w4a16"])
@pytest.mark.parametrize("fmt", ["lowbit", "compressed-tensors"])
def test_round_trip_dynamic_fp4_and_weight_only_schemes(family, scheme, fmt, tmp_path):
    q = lowbit.quantize(tiny_moe(family), scheme, calibration=CALIB, num_samples=4, seq_len=32)
    out = lowbit.save(q, tmp_path / "out", format=fmt)
    back = lowbit.load(out)
    for e in (0, 7):
        a, b = q.model.layers[1].mlp.experts[e].gate_proj, back.model.layers[1].mlp.experts[e].gate_proj
        assert torch.equal(a.weight_qtensor().codes, b.weight_qtensor().codes)
        assert torch.equal(a.weight_qtensor().scale.float(), b.weight_qtensor().scale.float())
    assert torch.equal(back(input_ids=IDS).logits, q(input_ids=IDS).logits)
