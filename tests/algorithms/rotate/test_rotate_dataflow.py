"""The rotation's residual layout is read from the model's data flow (``lowbit.algorithms.rotate.stream``):
the same layout as the old family table where it had one, families it lacked rotated exactly, and
what a rotation cannot follow refused by the module that does it."""

from __future__ import annotations

import copy

import pytest
import torch

from helpers.families import tiny_model
from helpers.models import tiny_llama
from helpers.moe_models import tiny_moe
from lowbit.algorithms.rotate import Rotation, residual_layout, rotate_model
from lowbit.algorithms.smoothquant.mappings import SourceKind, expand_for_layer, mappings_for
from lowbit.errors import QuantizationError
from lowbit.moe import split_experts

IDS = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(5))


def _split_moe(family):
    model = tiny_moe(family)
    split_experts(model)
    return model


def _table_layout(model):
    """(norm -> (kind, readers), writers) by the family table, as the layout read it before."""
    norms, writers = {}, set()
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}."
        writers.add(p + "self_attn.o_proj")
        for m in expand_for_layer(mappings_for(model), layer):
            if m.kind is SourceKind.LINEAR:
                writers |= {p + t for t in m.targets}
            else:
                norms[p + m.source] = (m.kind, frozenset(p + t for t in m.targets + m.float_targets))
    norms["model.norm"] = (norms["model.layers.0.input_layernorm"][0], frozenset({"lm_head"}))
    return norms, writers


@pytest.mark.parametrize("build", [tiny_llama, lambda: _split_moe("qwen3_moe"), lambda: _split_moe("qwen2_moe"),
                                   lambda: _split_moe("mixtral")])
def test_the_data_flow_gives_the_tables_layout(build):
    model = build()
    layout = residual_layout(model)
    norms, writers = _table_layout(model)
    assert {n.norm: (n.kind, frozenset(n.readers)) for n in layout.norms} == norms
    assert set(layout.writers) == writers and layout.readers == ()
    assert [(p.v_proj, p.o_proj) for p in layout.pairs] == \
        [(f"model.layers.{i}.self_attn.v_proj", f"model.layers.{i}.self_attn.o_proj") for i in range(2)]
    assert layout.embeddings == ("model.embed_tokens",) and layout.head == "lm_head" and layout.layers == 2


def _rotated(model):
    with torch.no_grad():
        ref = model(input_ids=IDS, use_cache=False).logits
        report = rotate_model(model, Rotation.HADAMARD)
        got = model(input_ids=IDS, use_cache=False).logits
    return ((got - ref).abs().max() / ref.abs().max()).item(), report


# families the table lacked; R2 pairs: attention layers whose v -> o the flow found (Phi-3's fused
# qkv_proj, MLA's kv_b_proj and Qwen3-Next's gated attention output have none; Mamba has no attention)
@pytest.mark.parametrize("build, pairs, layers", [
    (lambda: tiny_model("granite"), 2, 2),          # residual and embedding multipliers (scalars)
    (lambda: tiny_model("phi3"), 0, 2),
    (lambda: tiny_model("hunyuan_v1_moe"), 2, 2),   # a router called as a linear, shared MLP
    (lambda: tiny_model("qwen3_next"), 0, 2),       # Gated DeltaNet + gated attention, Gemma-style (1 + w) norms
    (lambda: tiny_model("nemotron_h"), 1, 4),       # hybrid: Mamba, attention and MLP layers
    (lambda: tiny_model("mamba"), 0, 2),
    (lambda: _split_moe("gpt_oss"), 2, 2),       # clamped SwiGLU experts with biases, attention sinks
    (lambda: _split_moe("deepseek_v3"), 0, 2),   # MLA, shared experts, a router read by F.linear
])
def test_families_the_table_lacked_rotate_exactly(build, pairs, layers):
    model = build()
    err, report = _rotated(model)
    assert err < 1e-5, err  # measured 4e-7 .. 1.1e-6 in float32
    assert (report.r2_pairs, report.layers) == (pairs, layers)
    assert report.r1_block == report.hidden == 128


def test_hybrid_report_says_where_r2_applies():
    _, report = _rotated(tiny_model("nemotron_h"))
    assert report.describe() == "rotated (hadamard): residual stream R1 128, per-head R2 32 on 1 attention layer, " \
                                "4 layers"


@pytest.mark.parametrize("family, names", [
    ("cohere", ["CohereForCausalLM", "model.layers.0.input_layernorm", "does not commute"]),  # LayerNorm, no bias
    ("minimax", ["MiniMaxForCausalLM", "model.layers.0.input_layernorm", "also feeds add"]),   # normed residual
    ("olmo", ["OlmoForCausalLM", "model.layers.0.input_layernorm", "uses the residual stream in layer_norm"]),
    ("olmo2", ["Olmo2ForCausalLM", "model.layers.0.post_attention_layernorm", "cannot be rotated by fusion"]),
])
def test_what_touches_the_stream_otherwise_is_refused_naming_the_module(family, names):
    model = tiny_model(family)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(QuantizationError) as e:
        rotate_model(model, "hadamard")
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in names), msg
    after = model.state_dict()  # split experts are named per expert now; the rest is unchanged
    assert all(torch.equal(v, after[k]) for k, v in before.items() if k in after)
