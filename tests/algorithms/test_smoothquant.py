"""SmoothQuant: mappings per family, exact folding, alpha search, unknown architectures."""

import copy
import warnings

import pytest
import torch

import lowbit
from lowbit.algorithms.smoothquant import (
    MAPPINGS, SourceKind, fold_smoothing, mappings_for, search_alpha, smooth_scales, smoothing_error,
)
from lowbit.modules import QuantLinear
from lowbit.schemes import get_scheme


def tiny_gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           max_position_embeddings=128, sliding_window=16)
    m = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("layernorm.weight"):
                p.copy_(torch.rand_like(p) * 2 - 0.5)  # (1 + w) in [0.5, 2.5]
    return m


def tiny_opt():
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    cfg = OPTConfig(vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=128, word_embed_proj_dim=64)
    m = OPTForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "layer_norm" in n:
                p.add_(torch.rand_like(p))
    return m


def _fold_all(model, gen):
    for layer in model.model.layers if hasattr(model.model, "layers") else model.model.decoder.layers:
        for m in mappings_for(model):
            n = layer.get_submodule(m.targets[0]).in_features
            fold_smoothing(layer, m, torch.rand(n, generator=gen) * 4 + 0.25)


@pytest.mark.parametrize("build", ["llama", "gemma3", "opt"])
def test_folding_is_exact_in_float(build, llama, token_ids):
    model = {"llama": lambda: llama, "gemma3": tiny_gemma3, "opt": tiny_opt}[build]()
    kinds = {m.kind for m in mappings_for(model)}
    expected = {"llama": {SourceKind.RMS, SourceKind.LINEAR}, "gemma3": {SourceKind.RMS_ONE_PLUS, SourceKind.LINEAR},
                "opt": {SourceKind.LAYERNORM, SourceKind.LINEAR}}[build]
    assert kinds == expected
    with torch.no_grad():
        ref = model(token_ids).logits
        smoothed = copy.deepcopy(model)
        _fold_all(smoothed, torch.Generator().manual_seed(0))
        out = smoothed(token_ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    # and the weights really changed
    w0 = dict(model.named_parameters())
    changed = [n for n, p in smoothed.named_parameters() if not torch.equal(p, w0[n])]
    assert any("q_proj" in n for n in changed) and any("norm" in n for n in changed)


def test_gemma3_mapping_uses_pre_feedforward_norm():
    names = {m.source for m in MAPPINGS["gemma3_text"]}
    assert "pre_feedforward_layernorm" in names and "post_attention_layernorm" not in names
    assert MAPPINGS["qwen2"] == MAPPINGS["llama"] == MAPPINGS["mistral"] == MAPPINGS["qwen3"]


def test_smooth_scales_formula():
    act = torch.tensor([8.0, 1.0, 0.0, 4.0])
    w1 = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    w2 = torch.tensor([[-1.0, 4.0, 1.0, 0.0]])
    s = smooth_scales(act, [w1, w2], 0.5)
    # channel 0: sqrt(8)/sqrt(2) = 2; channel 1: 1/sqrt(4) = 0.5; zero act or weight -> 1
    torch.testing.assert_close(s, torch.tensor([2.0, 0.5, 1.0, 1.0]))
    with pytest.raises(ValueError, match="alpha"):
        smooth_scales(act, [w1], 1.5)


def test_search_alpha_picks_the_smallest_error():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=g)
    x[:, 3] *= 40.0
    ws = [torch.randn(16, 32, generator=g), torch.randn(8, 32, generator=g)]
    act = x.abs().amax(0)
    scheme = get_scheme("w8a8-int8")
    best, errs = search_alpha(x, act, act, ws, scheme, (0.3, 0.5, 0.8))
    assert set(errs) == {None, 0.3, 0.5, 0.8}
    assert errs[best] == min(errs.values())
    assert best is not None and errs[best] < errs[None] / 2
    assert errs[0.5] == pytest.approx(smoothing_error(x, ws, scheme, smooth_scales(act, ws, 0.5), act))


def _rel(q, ref, ids):
    with torch.no_grad():
        out = q(ids).logits
    return float((out - ref).norm() / ref.norm())


def test_smoothquant_lowers_error(llama, token_ids):
    calib = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = llama(token_ids).logits
    errs = {}
    for sq in (None, 0.5, "auto"):
        q = lowbit.quantize(copy.deepcopy(llama), "w8a8-int8", calib, smoothquant=sq, num_samples=8, seq_len=32)
        errs[sq] = _rel(q, ref, token_ids)
    # measured: 0.070 unsmoothed, 0.024 (0.5), 0.023 (auto)
    assert errs[0.5] < 0.6 * errs[None]
    assert errs["auto"] < 0.6 * errs[None]
    groups = q.lowbit_calibration.groups
    assert groups["model.layers.0.self_attn.q_proj"].alpha_errors is not None


@pytest.mark.parametrize("build", ["gemma3", "opt"])
def test_other_families_quantize_with_smoothing(build, token_ids):
    model = {"gemma3": tiny_gemma3, "opt": tiny_opt}[build]()
    calib = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(token_ids).logits
    plain = lowbit.quantize(copy.deepcopy(model), "w8a8-int8", calib, smoothquant="none", num_samples=4, seq_len=32)
    sq = lowbit.quantize(copy.deepcopy(model), "w8a8-int8", calib, smoothquant=0.5, num_samples=4, seq_len=32)
    assert sq.lowbit_calibration.smoothing_family == model.config.model_type
    assert sum(isinstance(m, QuantLinear) for m in sq.modules()) == 2 * (7 if build == "gemma3" else 6)
    e_plain, e_sq = _rel(plain, ref, token_ids), _rel(sq, ref, token_ids)
    assert e_sq < 0.1 and e_plain < 0.1


def test_an_unknown_model_type_is_smoothed_from_its_data_flow_as_the_table_would(llama, token_ids):
    calib = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(3))
    known = lowbit.quantize(copy.deepcopy(llama), "w8a8-int8", calib, smoothquant=0.5, num_samples=4, seq_len=32)
    llama.config.model_type = "mystery"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no mapping" warning: the mappings come from the layer
        q = lowbit.quantize(llama, "w8a8-int8", calib, smoothquant=0.5, num_samples=4, seq_len=32)
    assert q.lowbit_calibration.smoothing_family == "mystery" and q.lowbit_calibration.unsmoothed == {}
    assert sum(isinstance(m, QuantLinear) for m in q.modules()) == 14
    for (n, a), (_, b) in zip(q.state_dict().items(), known.state_dict().items()):
        assert torch.equal(a, b), n
    assert q.lowbit_calibration.groups["model.layers.0.self_attn.q_proj"].alpha == 0.5