"""The importance matrix (llama-imatrix's statistic): each linear's mean squared input per column,
checked against the inputs computed by hand, and usable as GGML's importance weights."""

from __future__ import annotations

import pytest
import torch

from helpers.models import tiny_llama
from lowbit.calibration.importance import importance_matrix
from lowbit.errors import QuantizationError


def _tokens(n=3, t=16, seed=0):
    return torch.randint(0, 256, (n, t), generator=torch.Generator().manual_seed(seed))


def test_mean_square_of_the_first_layers_inputs():
    model = tiny_llama()
    tokens = _tokens()
    imp = importance_matrix(model, tokens, batch_size=2)
    with torch.no_grad():
        x = model.model.layers[0].input_layernorm(model.model.embed_tokens(tokens)).reshape(-1, 64).double()
    expected = (x * x).mean(dim=0).float()
    for proj in ("q_proj", "k_proj", "v_proj"):
        torch.testing.assert_close(imp[f"model.layers.0.self_attn.{proj}"], expected, rtol=1e-5, atol=0)
    assert imp["lm_head"].shape == (64,) and imp["model.layers.1.mlp.down_proj"].shape == (128,)
    assert all(bool((v >= 0).all()) for v in imp.values())
    # batching does not change it
    again = importance_matrix(model, tokens, batch_size=3)
    torch.testing.assert_close(again["model.layers.1.mlp.down_proj"], imp["model.layers.1.mlp.down_proj"],
                               rtol=1e-6, atol=0)


def test_it_weights_ggml_encodings():
    from lowbit.numerics.ggml import GgmlType, decode, encode

    model = tiny_llama(hidden_size=256, intermediate_size=512)
    imp = importance_matrix(model, _tokens(), names=["model.layers.0.mlp.up_proj"])
    assert list(imp) == ["model.layers.0.mlp.up_proj"]
    w = model.model.layers[0].mlp.up_proj.weight.detach()
    weighted = encode(w, GgmlType.Q4_K, importance=imp["model.layers.0.mlp.up_proj"])
    plain = encode(w, GgmlType.Q4_K)
    assert not torch.equal(weighted, plain)
    # the weighted error, measured with the importance, is not worse than the plain one
    q = imp["model.layers.0.mlp.up_proj"]
    err_w = ((decode(weighted, GgmlType.Q4_K) - w) ** 2 * q).sum()
    err_p = ((decode(plain, GgmlType.Q4_K) - w) ** 2 * q).sum()
    assert float(err_w) <= float(err_p) * 1.02


def test_unknown_names_and_unreached_linears_are_errors():
    model = tiny_llama()
    with pytest.raises(QuantizationError, match="no nn.Linear named 'nope'"):
        importance_matrix(model, _tokens(), names=["nope"])
    model.unused = torch.nn.Linear(4, 4)
    with pytest.raises(QuantizationError, match="'unused' saw no calibration token"):
        importance_matrix(model, _tokens())


def test_an_unreached_linear_gets_llama_imatrix_ones_and_no_hessian_when_asked():
    from lowbit.calibration.importance import input_statistics

    model = tiny_llama()
    model.unused = torch.nn.Linear(4, 4)
    imp, hess = input_statistics(model, _tokens(), hessians=True, unseen=1.0)
    assert torch.equal(imp["unused"], torch.ones(4)) and "unused" not in hess
    assert "model.layers.0.mlp.up_proj" in hess and not torch.equal(imp["lm_head"], torch.ones(64))


def test_the_pass_stops_at_the_head_after_measuring_its_input():
    model = tiny_llama()
    tokens = _tokens()
    calls = []
    model.lm_head.register_forward_hook(lambda m, a, out: calls.append(out.shape))  # runs only if the head computes
    imp = importance_matrix(model, tokens, batch_size=2)
    assert calls == []
    with torch.no_grad():
        h = model.model(input_ids=tokens).last_hidden_state.reshape(-1, 64).double()
    torch.testing.assert_close(imp["lm_head"], (h * h).mean(dim=0).float(), rtol=1e-5, atol=0)
    assert len(imp) == len([m for m in model.modules() if isinstance(m, torch.nn.Linear)])
