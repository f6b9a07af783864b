"""Never silently skip: matmul weights a scheme targets that lowbit cannot quantize (RecurrentGemma's
block-diagonal gate weights) are an error, or with allow_unquantized a listed warning; fused MoE
experts are split and GPT-2's Conv1D projections made linears, and both quantized; the CLI says
what it quantized."""

from __future__ import annotations

import copy

import pytest
import torch

import lowbit
from helpers.cli import run
from helpers.eval_fixtures import byte_tokenizer
from lowbit.errors import QuantizationError
from lowbit.targets import unquantizable_targets


def tiny_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                         num_experts_per_tok=2, head_dim=8, max_position_embeddings=64)
    return Qwen3MoeForCausalLM(cfg).eval()


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=4)).eval()


EXPERTS = [f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")]
CONV1D = [f"transformer.h.{i}.{p}" for i in range(2) for p in ("attn.c_attn.weight", "attn.c_proj.weight",
                                                               "mlp.c_fc.weight", "mlp.c_proj.weight")]


def test_dense_models_have_none(llama):
    assert unquantizable_targets(llama) == []


def test_fused_experts_are_listed_routers_and_ignored_modules_are_not():
    moe = tiny_moe()
    found = unquantizable_targets(moe)
    assert [n for n, _ in found] == EXPERTS and found[0][1] == (4, 32, 32)
    assert unquantizable_targets(moe, ignore=[r".*\.experts"]) == []


def test_quantize_splits_and_quantizes_fused_experts():
    q = lowbit.quantize(tiny_moe(), "w8a16")
    assert q.lowbit_unquantized == [] and unquantizable_targets(q) == []
    assert sum(hasattr(m, "weight_codes") for m in q.modules()) == 8 + 2 * 4 * 3  # q/k/v/o + 4 experts x 3


def tiny_recurrent_gemma():
    from helpers.families import tiny_model

    return tiny_model("recurrent_gemma")


RG_LRU = [f"model.layers.{i}.temporal_block.rg_lru.{p}" for i in range(2)
          for p in ("input_gate_weight", "recurrent_gate_weight")]


def test_quantize_refuses_or_warns_and_lists():
    model = tiny_recurrent_gemma()
    with pytest.raises(QuantizationError, match=r"4 weight matrices .* model\.layers\.0\.temporal_block\.rg_lru\."
                                                r"input_gate_weight \[4, 32, 32\].*allow_unquantized=True"):
        lowbit.quantize(copy.deepcopy(model), "w8a16")
    with pytest.warns(UserWarning, match="4 weight matrices"):
        q = lowbit.quantize(copy.deepcopy(model), "w8a16", allow_unquantized=True)
    assert q.lowbit_unquantized == RG_LRU
    # the gate biases ride in baddbmm's added operand: not matmul weights, kept in float
    assert q.lowbit_float_weights["model.layers.0.temporal_block.rg_lru.input_gate_bias"] == "elementwise parameter"


def test_gpt2_conv1d_projections_are_quantized_as_linears():
    model = tiny_gpt2()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    q = lowbit.quantize(copy.deepcopy(model), "w8a16")
    assert q.lowbit_unquantized == [] and unquantizable_targets(q) == []
    names = [n for n, m in q.named_modules() if hasattr(m, "weight_codes")]
    assert names == [n.removesuffix(".weight") for n in CONV1D]
    assert q.get_submodule("transformer.h.0.attn.c_attn").weight_codes.shape == (96, 32)  # [out, in]
    with torch.no_grad():
        err = ((q(ids).logits - ref).norm() / ref.norm()).item()
    assert err < 0.01, err


def _folder(model, path, capsys):
    """``model`` saved with the byte tokenizer at ``path`` (captured output cleared)."""
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    capsys.readouterr()
    return path


def test_cli_refuses_then_reports_what_it_quantized(capsys, tmp_path):
    src = _folder(tiny_recurrent_gemma(), tmp_path / "rg", capsys)
    code, _, err = run(capsys, "quantize", src, "--scheme", "w8a16", "-o", tmp_path / "q")
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "--allow-unquantized" in errors[0] and "Traceback" not in err
    assert not (tmp_path / "q").exists()
    src = _folder(tiny_gpt2(), tmp_path / "gpt2", capsys)
    code, out, _ = run(capsys, "quantize", src, "--scheme", "w8a16", "-o", tmp_path / "q2")
    assert code == 0 and "quantized 8 linears" in out, out


def test_cli_reports_experts(capsys, tmp_path):
    src = _folder(tiny_moe(), tmp_path / "moe", capsys)
    code, out, _ = run(capsys, "quantize", src, "--scheme", "w8a16", "-o", tmp_path / "q")
    assert code == 0 and "quantized 32 linears, 24 of them in 8 experts of 2 MoE blocks" in out, out


def test_cli_reports_the_spread_of_per_expert_static_input_scales(capsys, tmp_path):
    import json

    src = _folder(tiny_moe(), tmp_path / "moe", capsys)
    code, out, _ = run(capsys, "quantize", src, "--scheme", "w8a8-int8", "-o", tmp_path / "q", "--calib-samples", "2",
                       "--calib-seq-len", "32", "--json")
    spread = json.loads(out)["quantized"]["expert_input_scale_spread"]
    assert code == 0 and set(spread) == {"gate_proj", "up_proj", "down_proj"}
    assert spread["gate_proj"] == spread["up_proj"] == 1.0  # every expert observed every token: one input
    assert spread["down_proj"] > 1.0  # each expert's own activations
