"""lowbit's importance search for Q4_0 / Q5_0 (``ImportanceSearch.DIRECT``, lowbit.numerics.ggml_direct):
the type's layout, llama.cpp's decoder reads it, and on rows with uneven importance it lowers the
importance-weighted squared error against llama.cpp's search (the statistic that error is)."""

from __future__ import annotations

import pytest
import torch

from lowbit.numerics.ggml import GgmlType, ImportanceSearch, decode, encode
from lowbit.numerics.ggml_direct import STEPS, direct_symmetric_search


def _rows(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(48, 256, generator=g) * torch.rand(48, 1, generator=g)
    x[:, ::37] *= 8                                                     # outliers, as real weights have
    imp = torch.exp(2 * torch.randn(256, generator=g))                  # uneven, as activations' squares are
    return x, imp


def _err(x, imp, data, kind):
    return float((imp * (x - decode(data, kind)) ** 2).sum())


@pytest.mark.parametrize("kind", [GgmlType.Q4_0, GgmlType.Q5_0])
def test_direct_search_lowers_the_importance_weighted_error(kind):
    x, imp = _rows()
    ours = encode(x, kind, importance=imp, search=ImportanceSearch.DIRECT)
    theirs = encode(x, kind, importance=imp, search=ImportanceSearch.LLAMA_CPP)
    assert ours.shape == theirs.shape == encode(x, kind).shape and ours.dtype == torch.uint8
    assert _err(x, imp, ours, kind) < 0.85 * _err(x, imp, theirs, kind)  # 0.74 (Q4_0), 0.77 (Q5_0)


def test_the_search_is_the_least_error_candidate_with_its_least_squares_scale():
    """Per block: no candidate of the grid, with its own least-squares scale, has a smaller weighted
    error than the chosen one, and the scale is least-squares for the chosen codes."""
    x, imp = _rows(1)
    b, w = x.reshape(-1, 32)[:64], imp.reshape(1, -1).expand(48, -1).reshape(-1, 32)[:64]
    d, q = direct_symmetric_search(b, 16, w)
    l = q.to(torch.float32) - 16
    err = (w * (b - d[:, None] * l) ** 2).sum(1)
    ls = (w * b * l).sum(1) / (w * l * l).sum(1)
    torch.testing.assert_close(d, ls, rtol=1e-5, atol=0)
    v = b.gather(1, b.abs().argmax(1, keepdim=True)).squeeze(1)
    for i in range(-STEPS, STEPS + 1):
        li = torch.round(-(16 + 0.75 * 16 * i / STEPS) / v[:, None] * b).clamp(-16, 15)
        si = (w * b * li).sum(1) / (w * li * li).sum(1)
        assert bool(((w * (b - si[:, None] * li) ** 2).sum(1) >= err * (1 - 1e-5)).all()), i


def test_without_importance_or_for_other_types_it_is_llama_cpps_encoding():
    x, imp = _rows(2)
    assert torch.equal(encode(x, GgmlType.Q5_0, search=ImportanceSearch.DIRECT), encode(x, GgmlType.Q5_0))
    for kind in (GgmlType.Q4_K, GgmlType.Q6_K, GgmlType.Q5_1, GgmlType.Q8_0):
        assert torch.equal(encode(x, kind, importance=imp, search=ImportanceSearch.DIRECT),
                           encode(x, kind, importance=imp)), kind


def test_a_zero_block_is_zero_and_bad_input_is_named():
    x, imp = _rows(3)
    x[5, 64:96] = 0
    data = encode(x, GgmlType.Q5_0, importance=imp, search=ImportanceSearch.DIRECT)
    assert bool((decode(data, GgmlType.Q5_0)[5, 64:96] == 0).all())
    x[0, 0] = float("nan")
    with pytest.raises(Exception, match="w1"):
        encode(x, GgmlType.Q5_0, name="w1", importance=imp, search=ImportanceSearch.DIRECT)
