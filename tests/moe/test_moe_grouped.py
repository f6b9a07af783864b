"""Per-expert matrices held as one 3-D weight and called on rows grouped by expert (JetMoE's
``JetMoeParallelExperts``), split into one linear per expert (lowbit.moe.grouped)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import lowbit
from lowbit.errors import QuantizationError
from lowbit.linearize import linearize
from lowbit.moe.grouped import GroupedLinears, is_grouped_linears, split_grouped
from lowbit.targets import quantizable_linears


class _InOut(nn.Module):
    """Another module of the kind, stored [E, in, out] and named nothing like JetMoE's."""

    def __init__(self, e: int, i: int, o: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(e, i, o))
        self.num_experts = e

    def forward(self, rows, counts):
        return torch.cat([p @ self.w[k] for k, p in enumerate(rows.split(list(counts)))])


class _Odd(_InOut):
    def forward(self, rows, counts):  # not a grouped product: refused, never guessed
        return torch.cat([(p @ self.w[k]).relu() for k, p in enumerate(rows.split(list(counts)))])


def test_a_grouped_module_is_split_in_the_layout_its_forward_computes():
    torch.manual_seed(0)
    m = _InOut(3, 8, 5)
    assert is_grouped_linears(m)
    g = split_grouped("x", m)
    assert isinstance(g, GroupedLinears) and g.transposed and g[1].weight.shape == (5, 8)
    x, counts = torch.randn(6, 8), [2, 0, 4]
    assert torch.allclose(g(x, counts), m(x, counts), atol=1e-6)
    with pytest.raises(QuantizationError, match="'y' .*cannot split"):
        split_grouped("y", _Odd(3, 8, 5))


def _jetmoe():
    from helpers.families import tiny_model

    return tiny_model("jetmoe")


def test_jetmoe_experts_are_split_and_compute_the_same():
    model = _jetmoe()
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
    linearize(model)
    mlp = model.get_submodule("model.layers.0.mlp.input_linear")
    assert isinstance(mlp, GroupedLinears) and not mlp.transposed and len(mlp) == 4
    assert mlp[0].weight.shape == (512, 128)  # [E, 2I, H]: gate and up rows of expert 0
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False).logits
    assert torch.allclose(got, ref, atol=1e-5)
    names = quantizable_linears(model)
    assert "model.layers.1.mlp.output_linear.3" in names and "model.layers.1.self_attention.experts.input_linear.2" in names


def test_jetmoe_quantizes_by_default_and_reloads_exactly(tmp_path):
    model = _jetmoe()
    ids = torch.randint(3, 256, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = lowbit.quantize(copy.deepcopy(model), "nvfp4", calibration=ids, batch_size=2)
    assert type(q.get_submodule("model.layers.0.mlp.input_linear.1")).__name__ == "QuantLinear"
    assert type(q.get_submodule("model.layers.0.mlp.router.layer")) is nn.Linear  # routes by top-k: float
    with torch.no_grad():
        got = q(input_ids=ids, use_cache=False).logits
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < 0.5, err
    back = lowbit.load(lowbit.save(q, tmp_path / "q"))
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids, use_cache=False).logits, got)
