"""Never silently skip: weight matrices a scheme targets that lowbit cannot quantize (fused MoE
experts) are an error, or with allow_unquantized a listed warning; the CLI says what it quantized."""

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


EXPERTS = [f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")]


def test_dense_models_have_none(llama):
    assert unquantizable_targets(llama) == []


def test_fused_experts_are_listed_routers_and_ignored_modules_are_not():
    moe = tiny_moe()
    found = unquantizable_targets(moe)
    assert [n for n, _ in found] == EXPERTS and found[0][1] == (4, 32, 32)
    assert unquantizable_targets(moe, ignore=[r".*\.experts"]) == []


def test_quantize_refuses_or_warns_and_lists():
    moe = tiny_moe()
    with pytest.raises(QuantizationError, match=r"4 weight matrices .* model\.layers\.0\.mlp\.experts\.gate_up_proj "
                                                r"\[4, 32, 32\].*allow_unquantized=True"):
        lowbit.quantize(copy.deepcopy(moe), "w8a16")
    with pytest.warns(UserWarning, match="4 weight matrices"):
        q = lowbit.quantize(copy.deepcopy(moe), "w8a16", allow_unquantized=True)
    assert q.lowbit_unquantized == EXPERTS
    assert sum(hasattr(m, "weight_codes") for m in q.modules()) == 8  # q/k/v/o of both layers


def test_cli_refuses_then_reports_what_it_quantized(capsys, tmp_path):
    src = tmp_path / "moe"
    tiny_moe().save_pretrained(src)
    byte_tokenizer().save_pretrained(src)
    capsys.readouterr()
    code, _, err = run(capsys, "quantize", src, "--scheme", "w8a16", "-o", tmp_path / "q")
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "--allow-unquantized" in errors[0] and "Traceback" not in err
    with pytest.warns(UserWarning, match="4 weight matrices"):
        code, out, _ = run(capsys, "quantize", src, "--scheme", "w8a16", "-o", tmp_path / "q", "--allow-unquantized")
    assert code == 0 and "quantized 8 linears" in out and "4 weight matrices lowbit cannot quantize" in out
