"""Every expert quantized and calibrated: per-expert scales, never-routed experts, SmoothQuant
through the router, GPTQ per expert."""

from __future__ import annotations

import pytest
import torch

import lowbit
from helpers.moe_models import MOE_FAMILIES, tiny_moe
from lowbit.modules import QuantLinear
from lowbit.moe import SplitExperts

torch.set_grad_enabled(False)
CALIB = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(3))
IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(4))


def _experts(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, SplitExperts)]


def _never_route_to(model, expert: int) -> None:
    """Routers never pick ``expert`` (its slots go to the next expert, weights unchanged)."""
    def hook(_m, _a, out):
        logits, scores, idx = out
        return logits, scores, torch.where(idx == expert, (idx + 1) % model.config.num_experts, idx)
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(hook)


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("scheme", ["w8a8-int8", "nvfp4", "w4a16", "w8a8-fp8-dynamic"])
def test_every_expert_is_quantized(family, scheme):
    model = tiny_moe(family)
    ref = model(input_ids=IDS).logits
    q = lowbit.quantize(model, scheme, calibration=CALIB, num_samples=4, seq_len=32)
    assert q.lowbit_unquantized == []
    for name, block in _experts(q):
        for e in range(len(block)):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert isinstance(getattr(block[e], proj), QuantLinear), f"{name}.{e}.{proj}"
    routers = [n for n, m in q.named_modules() if n.rpartition(".")[2] in ("gate", "router", "shared_expert_gate")]
    assert routers and not any(isinstance(q.get_submodule(n), QuantLinear) for n in routers)
    err = ((q(input_ids=IDS).logits - ref).norm() / ref.norm()).item()
    assert err < (0.45 if scheme in ("nvfp4", "w4a16") else 0.12), err  # broken experts give ~1


def test_experts_have_their_own_weight_scales_and_share_them_only_between_gate_and_up():
    q = lowbit.quantize(tiny_moe("qwen3_moe"), "nvfp4", calibration=CALIB, num_samples=4, seq_len=32)
    block = q.model.layers[0].mlp.experts
    g = [block[e].gate_proj.weight_global_scale for e in range(len(block))]
    assert all(torch.equal(block[e].up_proj.weight_global_scale, g[e]) for e in range(len(block)))
    assert len({float(x) for x in g}) > 1  # per expert, not one for the block
    assert not torch.equal(block[0].down_proj.weight_global_scale, g[0])


def test_a_never_routed_expert_gets_finite_calibrated_scales():
    model = tiny_moe("qwen3_moe")
    _never_route_to(model, 7)
    q = lowbit.quantize(model, "w8a8-int8", calibration=CALIB, num_samples=4, seq_len=32, smoothquant="none")
    for layer in q.model.layers:
        ex = layer.mlp.experts
        for proj in ("gate_proj", "up_proj", "down_proj"):
            s = getattr(ex[7], proj).input_scale
            assert torch.isfinite(s).all() and (s > 0).all()
        # every expert saw the same gate/up input: the same static scale
        assert torch.equal(ex[7].gate_proj.input_scale, ex[0].gate_proj.input_scale)
        # down_proj inputs differ per expert
        assert len({float(ex[e].down_proj.input_scale) for e in range(len(ex))}) > 1
    report = q.lowbit_calibration
    assert "model.layers.0.mlp.experts.7.gate_proj" in report.groups


def _picks(model, family):
    """The experts each token of IDS is routed to in the last layer, as sets."""
    layer = model.model.layers[-1]
    router = layer.mlp.router if family == "gpt_oss" else layer.mlp.gate
    out = []
    h = router.register_forward_hook(lambda m, a, o: out.append(o[-1].reshape(-1, o[-1].shape[-1])))
    model(input_ids=IDS)
    h.remove()
    return [set(r.tolist()) for r in out[0]]


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_smoothquant_folds_through_the_router_and_keeps_the_routing(family):
    model = tiny_moe(family)
    before = _picks(model, family)
    layer = model.model.layers[-1]
    router = layer.mlp.router if family == "gpt_oss" else layer.mlp.gate
    w = router.weight.clone()
    q = lowbit.quantize(model, "w8a8-int8", calibration=CALIB, num_samples=4, seq_len=32, smoothquant=0.8)
    assert not torch.equal(router.weight, w)  # the smoothing is folded into the router too
    assert q.lowbit_calibration.groups["model.layers.1.mlp.experts.0.gate_proj"].alpha == 0.8
    after = _picks(q, family)
    same = sum(len(a & b) for a, b in zip(before, after)) / sum(len(a) for a in before)
    assert same > 0.85, same  # only W8A8 rounding moves a few near-tied picks


def test_smoothing_the_router_does_not_change_its_logits():
    from lowbit.algorithms.smoothquant.fold import fold_smoothing
    from lowbit.algorithms.smoothquant.mappings import MAPPINGS, expand_for_layer
    from lowbit.moe import split_experts

    model = tiny_moe("qwen2_moe")
    split_experts(model)
    layer = model.model.layers[0]
    x = torch.randn(5, 128)
    normed = layer.post_attention_layernorm(x)
    logits = layer.mlp.gate(normed)[0]
    shared = layer.mlp.shared_expert_gate(normed)
    m = next(m for m in expand_for_layer(MAPPINGS["qwen2_moe"], layer) if m.source == "post_attention_layernorm")
    assert set(m.float_targets) == {"mlp.gate", "mlp.shared_expert_gate"}
    assert len(m.targets) == 2 * 8 + 2
    s = torch.rand(128) * 4 + 0.25
    fold_smoothing(layer, m, s)
    normed2 = layer.post_attention_layernorm(x)
    torch.testing.assert_close(layer.mlp.gate(normed2)[0], logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.mlp.shared_expert_gate(normed2), shared, rtol=1e-5, atol=1e-5)


def test_gptq_rounds_each_expert_on_its_own_hessian():
    model = tiny_moe("mixtral")
    rtn = lowbit.quantize(tiny_moe("mixtral"), "w4a16", calibration=CALIB, num_samples=4, seq_len=32,
                          weight_rounding="rtn")
    gptq = lowbit.quantize(model, "w4a16", calibration=CALIB, num_samples=4, seq_len=32, weight_rounding="gptq",
                           reconstruct_iters=0)
    a, b = rtn.model.layers[0].mlp.experts, gptq.model.layers[0].mlp.experts
    changed = [e for e in range(len(a)) if not torch.equal(a[e].down_proj.weight_qtensor().codes,
                                                           b[e].down_proj.weight_qtensor().codes)]
    assert changed == list(range(len(a)))  # every expert, never-routed or not, got GPTQ rounding
    ref = tiny_moe("mixtral")(input_ids=CALIB).logits  # GPTQ lowers the error on its calibration text
    err = lambda m: ((m(input_ids=CALIB).logits - ref).norm() / ref.norm()).item()  # noqa: E731
    assert err(gptq) < err(rtn)


def test_experts_of_a_block_share_one_input_statistic():
    from lowbit.moe import same_input_groups, split_experts

    model = tiny_moe("qwen2_moe")
    split_experts(model)
    layer = model.model.layers[0]
    groups = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]]
    groups += [[f"mlp.experts.{e}.gate_proj", f"mlp.experts.{e}.up_proj"] for e in range(8)]
    groups += [[f"mlp.experts.{e}.down_proj"] for e in range(8)] + [["mlp.shared_expert.gate_proj"]]
    keys = [g[0] for g in groups]
    rep = same_input_groups(layer, groups, keys)
    assert rep == {f"mlp.experts.{e}.gate_proj": "mlp.experts.0.gate_proj" for e in range(8)}


def test_gptq_batches_stay_within_their_budget_and_count_a_shared_hessian_once():
    from lowbit.algorithms.gptq import GPTQOptions, gptq_batches as _batches

    H, H2 = torch.eye(64), torch.eye(64)
    groups = [[torch.zeros(32, 64)] for _ in range(6)]
    one = 32 * 64 * 4
    fac = 64 * 64 * 4
    assert _batches(groups, [H] * 6, GPTQOptions()) == [[0, 1, 2, 3, 4, 5]]
    assert _batches(groups, [H] * 6, GPTQOptions(max_batch_bytes=fac + 2 * one)) == [[0, 1], [2, 3], [4, 5]]
    assert _batches(groups, [H, H2] * 3, GPTQOptions(max_batch_bytes=2 * fac + 2 * one)) == [[0, 1], [2, 3], [4, 5]]
    assert _batches(groups, [H] * 6, GPTQOptions(max_batch_bytes=1)) == [[k] for k in range(6)]  # one at least


def test_gptq_results_do_not_depend_on_the_batch_budget_beyond_float_rounding():
    from lowbit.algorithms import GPTQOptions, gptq_quantize_groups
    from lowbit.schemes import PRESETS

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=g)
    H = (x.T @ x).double()
    groups = [[torch.randn(64, 128, generator=g), torch.randn(64, 128, generator=g)] for _ in range(4)]
    spec = PRESETS["w4a16"].weights
    a = gptq_quantize_groups(groups, [H] * 4, spec)
    b = gptq_quantize_groups(groups, [H] * 4, spec, options=GPTQOptions(max_batch_bytes=1))
    for ga, gb in zip(a, b):
        for qa, qb in zip(ga, gb):
            assert (qa.codes.to(torch.int32) != qb.codes.to(torch.int32)).float().mean() < 0.01


def test_sink_positions_are_left_out_of_expert_statistics_too():
    """Experts see the flattened windows; the first ``sink_positions`` of every window still do not
    set static scales (as for every other linear)."""
    from lowbit.calibration.observers import MaxObserver
    from lowbit.calibration.stats import GroupStats as _GroupStats

    x = torch.ones(2, 8, 4)
    x[:, 0] = 100.0  # a sink token at the start of each window
    st = _GroupStats(MaxObserver(), 0)
    st.observe(x.reshape(16, 4), sinks=1, seq_len=8)
    assert st.scale_amax().item() == 1.0 and st.all_pos.amax().max().item() == 100.0
