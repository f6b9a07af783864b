"""Splitting transformers' fused experts: one linear per expert projection, the same outputs."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from helpers.moe_models import MOE_FAMILIES, tiny_moe
from lowbit.errors import QuantizationError
from lowbit.moe import SplitExperts, all_tokens, expert_blocks, router_names, split_experts
from lowbit.moe.experts import GateKind

torch.set_grad_enabled(False)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_split_computes_what_the_fused_module_computes(family):
    from lowbit.threads import one_thread

    model = tiny_moe(family)
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    # one thread: with two, torch's CPU matmuls of the fused and the split experts may split their
    # sums differently (2.7e-7 apart on qwen3_moe here), which says nothing about the split
    with one_thread():
        ref = model(input_ids=ids).logits
        split = copy.deepcopy(model)
        names = split_experts(split)
        assert names and all(isinstance(split.get_submodule(n), SplitExperts) for n in names)
        assert split_experts(split) == []  # idempotent
        got = split(input_ids=ids).logits
    tol = 1e-6 if family == "gpt_oss" else 0.0  # gpt-oss: x @ W + b against F.linear, one rounding apart
    assert (got - ref).abs().max().item() <= tol * ref.abs().max().item()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_each_expert_holds_exactly_its_rows_of_the_fused_tensors(family):
    model = tiny_moe(family)
    fused = model.model.layers[0].mlp.experts
    gu, down = fused.gate_up_proj.clone(), fused.down_proj.clone()
    split_experts(model)
    experts = model.model.layers[0].mlp.experts
    for e in (0, 5):
        ex = experts[e]
        if family == "gpt_oss":  # [E, H, 2I], gate/up interleaved, with biases
            assert torch.equal(ex.gate_proj.weight, gu[e][:, 0::2].t())
            assert torch.equal(ex.up_proj.weight, gu[e][:, 1::2].t())
            assert torch.equal(ex.down_proj.weight, down[e].t())
            assert ex.down_proj.bias is not None
        else:  # [E, 2I, H], gate rows then up rows
            half = gu.shape[1] // 2
            assert torch.equal(ex.gate_proj.weight, gu[e][:half])
            assert torch.equal(ex.up_proj.weight, gu[e][half:])
            assert torch.equal(ex.down_proj.weight, down[e])
        assert isinstance(ex.up_proj, nn.Linear) and ex.up_proj.weight.is_contiguous()


def test_all_tokens_runs_every_expert_on_every_token_and_keeps_the_routing():
    model = tiny_moe("qwen3_moe")
    split_experts(model)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    routed = model(input_ids=ids).logits
    seen: dict[str, int] = {}
    block = model.model.layers[1].mlp.experts
    hooks = [block[e].up_proj.register_forward_hook(
        lambda m, a, o, e=e: seen.__setitem__(e, seen.get(e, 0) + a[0].shape[0])) for e in range(len(block))]
    with all_tokens(model):
        everything = model(input_ids=ids).logits
    for h in hooks:
        h.remove()
    assert seen == {e: 32 for e in range(len(block))}  # 2 x 16 tokens, every expert
    assert not block.route_all_tokens  # restored
    torch.testing.assert_close(everything, routed, rtol=0, atol=1e-5)


def test_routers_are_found_and_the_blocks_listed():
    model = tiny_moe("qwen2_moe")
    split_experts(model)
    assert router_names(model) == [f"model.layers.{i}.mlp.{r}" for i in range(2) for r in ("gate", "shared_expert_gate")]
    assert list(expert_blocks(model)) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


def test_unknown_gating_is_left_fused_naming_the_module():
    model = tiny_moe("qwen3_moe")
    cls = type(model.model.layers[0].mlp.experts)
    custom = type("CustomGateExperts", (cls,), {"_apply_gate": lambda self, x: x})
    model.model.layers[0].mlp.experts.__class__ = custom
    with pytest.warns(UserWarning, match=r"model.layers.0.mlp.experts.*CustomGateExperts.*_apply_gate"):
        done = split_experts(model)
    # left fused (its weights: matmul weights lowbit cannot quantize, refused by name by quantize)
    assert "model.layers.0.mlp.experts" not in done and "model.layers.1.mlp.experts" in done
    assert type(model.model.layers[0].mlp.experts) is custom
    from lowbit.targets import unquantizable_targets

    assert [n for n, _ in unquantizable_targets(model)] == ["model.layers.0.mlp.experts.gate_up_proj",
                                                            "model.layers.0.mlp.experts.down_proj"]


def test_a_class_own_gating_is_kept_per_expert_and_checked():
    model = tiny_moe("qwen3_moe")
    cls = type(model.model.layers[0].mlp.experts)

    def clamped(self, gate_up):  # a clamped SwiGLU, as DeepSeek-V4's and Hunyuan-V4's experts gate
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate.clamp(max=0.05)) * up.clamp(-0.05, 0.05)

    for layer in model.model.layers:
        layer.mlp.experts.__class__ = type("ClampedExperts", (cls,), {"_apply_gate": clamped})
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    split_experts(model)
    assert model.model.layers[0].mlp.experts[1].gate.kind is GateKind.OWN
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, ref, atol=1e-6)


def test_fused_experts_without_layout_flags_are_not_guessed():
    """A fused module without transformers' layout flags (Llama 4's experts) is left alone, so that
    quantize lists it among the weights it cannot quantize rather than splitting it wrongly."""
    import lowbit
    from lowbit.targets import unquantizable_targets

    class Experts(nn.Module):  # Llama 4's layout: [E, H, 2I], no decorator
        def __init__(self):
            super().__init__()
            self.num_experts = 4
            self.gate_up_proj = nn.Parameter(torch.zeros(4, 64, 256))
            self.down_proj = nn.Parameter(torch.zeros(4, 128, 64))

    model = tiny_moe("qwen3_moe")
    model.model.layers[0].mlp.experts = Experts()
    assert split_experts(model) == ["model.layers.1.mlp.experts"]
    assert [n for n, _ in unquantizable_targets(model)] == ["model.layers.0.mlp.experts.gate_up_proj",
                                                            "model.layers.0.mlp.experts.down_proj"]
    with pytest.raises(QuantizationError, match="2 weight matrices .*model.layers.0.mlp.experts.gate_up_proj"):
        lowbit.quantize(model, "w8a16")
