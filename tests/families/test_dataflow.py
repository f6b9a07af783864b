"""What lowbit reads from a model's forward: each layer's own call arguments, what each weight is
for (matmul operand, depthwise convolution, elementwise), linears read without being called, and
routers found by their top-k."""

from __future__ import annotations

import pytest
import torch

from helpers.families import tiny_model
from lowbit.calibration.capture import find_decoder_layers, run_layer
from lowbit.calibration.layer_calls import capture_calls
from lowbit.linearize import linearize
from lowbit.modules.qlinear import QuantLinear
from lowbit.param_uses import ParamKind
from lowbit.targets import quantizable_linears, survey_weights


def _replayed(model, tokens):
    """The last decoder layer's output, layer by layer on the captured calls (as calibration runs)."""
    path, layers = find_decoder_layers(model, quantizable_linears(model))
    calls = capture_calls(model, layers, tokens, 2)
    inputs = calls.first
    for i, layer in enumerate(layers):
        inputs = calls.for_layer(i, inputs)
        outs = run_layer(layer, inputs)
        inputs = [((o,) + tuple(c[0][1:]), c[1]) if c[0] else ((), {**c[1], "hidden_states": o})
                  for c, o in zip(inputs, outs)]
    return calls, torch.cat(outs)


def test_gemma4_layers_get_their_own_rope_and_replay_equals_the_forward():
    model = tiny_model("gemma4_text")
    tokens = torch.randint(3, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    calls, last = _replayed(model, tokens)
    assert calls.kinds == 2 and "position_embeddings" in calls.keys  # sliding and full attention
    widths = {calls.own[i][0]["position_embeddings"][0].shape[-1] for i in range(2)}
    assert len(widths) == 2
    with torch.no_grad():
        ref = model(input_ids=tokens, use_cache=False, output_hidden_states=True).hidden_states
    # hidden_states[-1] is after the final norm: compare the pre-norm stream through the norm
    assert torch.allclose(model.model.norm(last), ref[-1], atol=1e-5)


def test_a_uniform_model_replays_the_first_call_unchanged():
    calls, _ = _replayed(tiny_model("llama"), torch.randint(3, 256, (2, 8)))
    assert calls.keys == () and calls.kinds == 1


def test_mamba_weights_by_what_the_forward_does():
    s = survey_weights(tiny_model("mamba"))
    assert s.kinds["backbone.layers.0.mixer.A_log"] is ParamKind.ELEMENTWISE
    assert s.kinds["backbone.layers.0.mixer.conv1d.weight"] is ParamKind.DEPTHWISE_CONV
    assert s.read_directly == ["backbone.layers.0.mixer.dt_proj", "backbone.layers.1.mixer.dt_proj"]


def test_score_correction_bias_is_not_a_target_and_routers_are_found_by_topk():
    ernie = tiny_model("ernie4_5_moe")
    linearize(ernie)
    s = survey_weights(ernie)
    assert s.kinds == {"model.layers.1.mlp.gate.moe_statics.e_score_correction_bias": ParamKind.ELEMENTWISE}
    hy = tiny_model("hunyuan_v1_moe")
    linearize(hy)
    assert survey_weights(hy).routers == ["model.layers.0.mlp.gate.wg", "model.layers.1.mlp.gate.wg"]


def test_an_indexer_scoring_tokens_for_top_k_is_a_router_and_stays_float():
    # DeepSeek-V3.2-style sparse attention: the indexer's weights_proj [H -> heads] scales the heads'
    # q.k scores (a matmul of activations), then top-k picks the tokens; the model casts its input to
    # weights_proj.weight.dtype, which a quantized module would not have
    import lowbit

    model = tiny_model("axk2")
    linearize(model)
    assert survey_weights(model).routers == ["model.layers.0.self_attn.indexer.weights_proj",
                                             "model.layers.1.self_attn.indexer.weights_proj"]
    model = tiny_model("axk2")
    tokens = torch.randint(3, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=tokens, use_cache=False).logits
    q = lowbit.quantize(model, "nvfp4", calibration=tokens, progress=False)
    assert type(q.get_submodule("model.layers.1.self_attn.indexer.weights_proj")) is torch.nn.Linear
    assert type(q.get_submodule("model.layers.1.self_attn.indexer.wq_b")) is QuantLinear  # the rest is quantized
    with torch.no_grad():
        got = q(input_ids=tokens, use_cache=False).logits
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert 0.01 < err < 0.2, err  # measured 0.071


def test_a_matmul_weight_in_a_plain_parameter_is_a_target():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 8))
            self.scale = torch.nn.Parameter(torch.ones(8, 8))

        def forward(self, input_ids, use_cache=False):
            x = torch.nn.functional.one_hot(input_ids, 8).float()
            return torch.einsum("btd,de->bte", x, self.w * self.scale)  # a derived product is still the weight

    s = survey_weights(Odd())
    assert s.kinds == {"w": ParamKind.MATMUL, "scale": ParamKind.MATMUL}


def test_llama4_batched_experts_are_split_and_compute_the_same():
    from lowbit.moe.batched import BatchedExperts

    model = tiny_model("llama4_text")
    tokens = torch.randint(3, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=tokens, use_cache=False).logits
    linearize(model)
    block = model.get_submodule("model.layers.0.feed_forward.experts")
    assert isinstance(block, BatchedExperts) and len(block) == 4
    assert block[0].gate_proj.weight.shape == (256, 128) and block[0].down_proj.weight.shape == (128, 256)
    with torch.no_grad():
        got = model(input_ids=tokens, use_cache=False).logits
    assert torch.allclose(got, ref, atol=1e-5)
    assert "model.layers.1.feed_forward.experts.3.down_proj" in quantizable_linears(model)


def _flow_maps(model_type):
    from lowbit.algorithms.smoothquant.dataflow import layer_mappings
    from lowbit.algorithms.smoothquant.mappings import expand_for_layer, mappings_for
    from lowbit.moe import all_tokens

    model = tiny_model(model_type)
    linearize(model)
    names = quantizable_linears(model)
    path, layers = find_decoder_layers(model, names)
    calls = capture_calls(model, layers, torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0)), 2)
    out = []
    for i, layer in enumerate(layers):
        rel = [n[len(f"{path}.{i}."):] for n in names if n.startswith(f"{path}.{i}.")]
        with all_tokens(layer):
            maps, skipped = layer_mappings(layer, calls.for_layer(i, calls.first)[0], rel)
        table = mappings_for(model)
        if table is not None:
            mods = dict(layer.named_modules())
            table = tuple(m for m in expand_for_layer(table, layer) if m.source in mods and set(m.targets) <= set(rel))
        out.append((maps, skipped, table))
    return out


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "qwen3_moe", "qwen2_moe", "mixtral", "opt", "gpt_oss"])
def test_data_flow_finds_the_tables_mappings_folded_in_a_valid_order(model_type):
    def key(m):
        return m.source, frozenset(m.targets), m.kind, frozenset(m.float_targets)

    for maps, skipped, table in _flow_maps(model_type):
        assert skipped == {} and len(maps) == len(table)
        assert {key(m) for m in maps} == {key(m) for m in table}
        # a mapping whose targets hold another mapping's source is folded first (its scales
        # are computed from those weights before they change), as in the table
        at = {m.source: i for i, m in enumerate(maps)}
        for i, m in enumerate(maps):
            assert all(at[t] > i for t in m.targets if t in at)


def test_families_without_a_table_are_smoothed_and_unfoldable_sources_are_said():
    from lowbit.algorithms.smoothquant.mappings import SourceKind

    (maps, skipped, _), _ = _flow_maps("qwen3_next")  # Gated DeltaNet layer, then attention
    assert ("input_layernorm", SourceKind.RMS_ONE_PLUS) in [(m.source, m.kind) for m in maps]
    assert skipped == {"linear_attn.norm": "no fold of its weight divides its output by s"}  # norm(x) * silu(z)
    (maps, _, _), _ = _flow_maps("falcon")  # parallel attention and MLP read one LayerNorm
    assert maps[0].source == "input_layernorm" and maps[0].kind is SourceKind.LAYERNORM and len(maps[0].targets) == 2
    (_, skipped, _), _ = _flow_maps("gpt2")  # GELU between c_fc and c_proj: not folded, said
    assert skipped == {"mlp.c_fc": "its output also feeds pow"}


def test_a_window_cut_of_a_call_cuts_alibi_rows_by_window():
    from lowbit.calls import slice_call

    h = torch.randn(4, 8, 16)
    alibi = torch.arange(4 * 2 * 8, dtype=torch.float32).reshape(8, 1, 8)  # [batch * heads, 1, T]
    rope = torch.randn(8, 4)  # [T, D]: shared, whatever its first dimension
    args, kw = slice_call(((h,), {"alibi": alibi, "rope": rope}), 4, 1, 3)
    assert torch.equal(args[0], h[1:3]) and torch.equal(kw["alibi"], alibi[2:6]) and kw["rope"] is rope


def test_a_weight_mixing_residual_streams_is_a_coefficient_not_a_target():
    """DeepSeek-V4's hyper-connections: ``sigmoid(F.linear(streams, fn))`` weights each stream:
    ``fn`` decides how much of each hidden vector passes, as a router does, and stays in float."""
    import torch.nn.functional as F

    class Streams(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)
            self.proj = torch.nn.Linear(8, 8)
            self.fn = torch.nn.Parameter(torch.randn(2, 16))
            self.w = torch.nn.Parameter(torch.randn(8, 8))

        def get_input_embeddings(self):
            return self.emb

        def forward(self, input_ids, use_cache=False):
            h = self.emb(input_ids)
            streams = torch.stack([h, self.proj(h)], dim=2)                    # [B, T, 2, H]
            coef = torch.sigmoid(F.linear(streams.flatten(2), self.fn))        # [B, T, 2]
            return (coef.unsqueeze(-1) * streams).sum(2) @ self.w             # w: an ordinary matmul weight

    s = survey_weights(Streams())
    assert s.kinds == {"fn": ParamKind.COEFFICIENT, "w": ParamKind.MATMUL}


def test_a_linear_subclass_with_another_forward_is_not_taken_for_a_linear():
    """A ``nn.Linear`` whose forward multiplies each head group by its own block of rows
    (DeepSeek-V4's ``o_a_proj``) is not x W^T: quantizing it as one would compute something else.
    ``linearize`` splits it into one linear per group (found from its forward, not its name) that
    computes the same; a subclass with a computation of another kind stays a matmul weight outside
    a linear, refused by name; a subclass that keeps the linear's computation stays a linear."""
    from lowbit.linearize import linearize
    from lowbit.moe.row_groups import RowGroupLinears, row_groups
    from lowbit.targets import is_plain_linear, unquantizable_targets

    class Grouped(torch.nn.Linear):
        def forward(self, x):  # x [..., 2, 4] -> [..., 2, 4]: group g through rows 4g..4g+3
            return torch.einsum("...gi,goi->...go", x, self.weight.view(2, 4, 4))

    class Crossed(torch.nn.Linear):
        def forward(self, x):  # x [..., 2, 4]: group g through the rows of the other group
            return torch.einsum("...gi,goi->...go", x, self.weight.view(2, 4, 4).flip(0))

    class Logged(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x)

    class Model(torch.nn.Module):
        def __init__(self, kind):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)
            self.grouped = kind(4, 8, bias=False)
            self.logged = Logged(8, 8)

        def forward(self, input_ids, use_cache=False):
            h = self.emb(input_ids)
            return self.logged(self.grouped(h.unflatten(-1, (2, 4))).flatten(-2))

    m = Model(Grouped)
    assert not is_plain_linear(m.grouped) and is_plain_linear(m.logged)
    assert quantizable_linears(m) == ["logged"]
    assert unquantizable_targets(m) == [("grouped.weight", (8, 4))]
    ids = torch.arange(10).reshape(2, 5)
    with torch.no_grad():
        ref = m(ids)
    w = m.grouped.weight.detach().clone()
    assert linearize(m) == ["grouped"]
    assert isinstance(m.grouped, RowGroupLinears) and len(m.grouped) == 2
    assert torch.equal(m.grouped[1].weight, w[4:])
    assert quantizable_linears(m) == ["grouped.0", "grouped.1", "logged"] and unquantizable_targets(m) == []
    with torch.no_grad():
        torch.testing.assert_close(m(ids), ref, rtol=1e-5, atol=1e-6)
    crossed = Model(Crossed)
    assert row_groups(crossed.grouped) == 0 and linearize(crossed) == []
    assert unquantizable_targets(crossed) == [("grouped.weight", (8, 4))]


def test_a_loop_that_takes_more_than_hidden_states_from_a_layer_gets_the_real_outputs():
    """Hunyuan-V4's loop is ``h, prev = layer(h, prev=prev)``: a stand-in's tensor would be
    unpacked along its batch axis (a batch of two passes, wrongly). The capture runs the real
    layers instead, and each layer's ``prev`` is the one the model gives it."""

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, h, prev=None):
            out = self.lin(h) if prev is None else self.lin(h) + prev.unsqueeze(-1)
            return out, out.sum(-1)

    class Loop(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)
            self.layers = torch.nn.ModuleList(Layer() for _ in range(3))

        def forward(self, input_ids, use_cache=False):
            h, prev = self.emb(input_ids), None
            for layer in self.layers:
                h, prev = layer(h, prev=prev)
            return h

    torch.manual_seed(0)
    m = Loop().eval()
    tokens = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(1))
    calls = capture_calls(m, m.layers, tokens, 2)
    assert calls.keys == ("prev",)
    with torch.no_grad():
        h0, p0 = m.layers[0](m.emb(tokens[:2]))
        _, p1 = m.layers[1](h0, prev=p0)
    assert calls.own[0][0]["prev"] is None
    assert torch.equal(calls.own[1][0]["prev"], p0) and torch.equal(calls.own[2][0]["prev"], p1)
