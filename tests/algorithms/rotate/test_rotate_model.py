"""The fused rotation keeps a float model's logits, unties lm_head, and refuses what it cannot fuse."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers.models import tiny_llama
from helpers.moe_models import tiny_moe
from lowbit.algorithms.rotate import Rotation, rotate_model
from lowbit.algorithms.rotate.hadamard import hadamard
from lowbit.errors import QuantizationError
from lowbit.moe import split_experts

IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(5))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _rotated_error(model) -> tuple[float, object, torch.nn.Module]:
    with torch.no_grad():
        ref = model(IDS).logits
        rot = copy.deepcopy(model)
        report = rotate_model(rot, Rotation.HADAMARD)
        return _rel(rot(IDS).logits, ref), report, rot


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-5), (torch.float32, 1e-4)])
def test_tiny_llama_logits_unchanged(dtype, tol):
    # measured: 8e-8 in float64 (Llama's RMSNorm computes in float32), 2e-7 in float32
    model = tiny_llama().to(dtype)
    err, report, rot = _rotated_error(model)
    assert err < tol
    assert (report.hidden, report.r1_block, report.head_dim, report.r2_block, report.layers) == (64, 64, 16, 16, 2)
    # it did rotate: embeddings are E Q, norms are folded to 1, the tied head has its own weight now
    q = hadamard(64, dtype)
    assert torch.allclose(rot.model.embed_tokens.weight, model.model.embed_tokens.weight @ q, atol=1e-6)
    assert (rot.model.embed_tokens.weight - model.model.embed_tokens.weight).abs().max() > 0.1
    assert all(torch.equal(m.weight, torch.ones_like(m.weight)) for n, m in rot.named_modules() if n.endswith("norm"))
    assert report.untied and rot.config.tie_word_embeddings is False
    assert rot.lm_head.weight.data_ptr() != rot.model.embed_tokens.weight.data_ptr()
    assert "lm_head.weight" in rot.state_dict() and model.config.tie_word_embeddings is True


def test_untied_model_and_blocks_of_r1():
    # hidden 184 = 8 * 23 is no constructible order (183 = 3 * 61 and 91 = 7 * 13 are not prime): blocks of 8
    err, report, _ = _rotated_error(tiny_llama(hidden_size=184, intermediate_size=128, num_attention_heads=4,
                                               num_key_value_heads=2, tie_word_embeddings=False))
    assert err < 1e-4 and report.r1_block == 8 and report.hidden == 184 and not report.untied
    assert report.r2_block == 2  # head_dim 46 = 2 * 23


def test_qwen2_with_biases_and_qwen3_with_qk_norms():
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    qwen2 = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True)).eval()
    with torch.no_grad():
        for layer in qwen2.model.layers:  # random biases and norm gains, not the defaults
            for p in (layer.self_attn.q_proj.bias, layer.self_attn.v_proj.bias):
                p.normal_()
            layer.input_layernorm.weight.uniform_(0.5, 2.0)
    assert _rotated_error(qwen2)[0] < 1e-4
    qwen3 = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16, tie_word_embeddings=False)).eval()
    assert _rotated_error(qwen3)[0] < 1e-4


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_experts_routers_and_shared_experts(family):
    model = tiny_moe(family)
    split_experts(model)
    err, report, rot = _rotated_error(model)
    assert err < 1e-4  # measured 6-8e-7
    gate = rot.model.layers[0].mlp.gate
    assert (gate.weight - model.model.layers[0].mlp.gate.weight).abs().max() > 1e-3  # the router was rotated


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return Gemma3ForCausalLM(cfg).eval()


def _opt():
    from transformers import OPTConfig, OPTForCausalLM

    return OPTForCausalLM(OPTConfig(vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                    num_attention_heads=4, word_embed_proj_dim=64)).eval()


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4)).eval()


@pytest.mark.parametrize("build, names", [
    (_gemma3, ["Gemma3ForCausalLM", "model.layers.0.post_attention_layernorm", "cannot be rotated by fusion"]),
    (_opt, ["OPTForCausalLM", "model.decoder.layers.0.self_attn_layer_norm", "layernorm", "does not commute"]),
    (_gpt2, ["GPT2LMHeadModel", "transformer.h.0.ln_1", "does not commute"]),
    (lambda: tiny_llama(hidden_size=63, head_dim=16, num_attention_heads=1, num_key_value_heads=1, outliers=False),
     ["LlamaForCausalLM", "width 63 is odd"]),
])
def test_what_cannot_be_fused_is_a_one_line_error_and_nothing_changes(build, names):
    torch.manual_seed(0)
    model = build()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(QuantizationError) as e:
        rotate_model(model, "hadamard")
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in names), msg
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if k in after)


def test_none_is_a_no_op_and_unknown_names_are_refused():
    model = tiny_llama()
    before = copy.deepcopy(model.state_dict())
    assert rotate_model(model, "none") is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(QuantizationError, match="unknown rotation 'walsh'; known: none, hadamard"):
        rotate_model(model, "walsh")
