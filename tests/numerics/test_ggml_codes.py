"""The codes and grids of GGML's affine types: read from encoded rows, values bit-identical to
``decode``, codes replaced under the same scales."""

import pytest
import torch

from lowbit.errors import QuantizationError
from lowbit.numerics.ggml import GEOMETRY, decode, encode
from lowbit.numerics.ggml_codes import AFFINE, codes_of, grid_of, with_codes


def _rows(kind, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 512, generator=g) * 0.05
    x[0, :32] = 0.0                                  # a zero block / sub-block
    x[1, 5] = 3.0                                    # an outlier
    x[2, :256] = -x[2, :256].abs()                   # a one-signed super-block
    x[3, 40:60] = 1e-6                               # tiny values
    return x


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("kind", AFFINE, ids=lambda k: k.value)
def test_codes_and_grid_give_decode_exactly(kind, weighted):
    x = _rows(kind)
    imp = torch.rand(512, generator=torch.Generator().manual_seed(1)) if weighted else None
    data = encode(x, kind, importance=imp)
    grid, codes = grid_of(data, kind), codes_of(data, kind)
    assert codes.shape == x.shape
    assert int(codes.min()) >= grid.cmin and int(codes.max()) <= grid.cmax
    assert torch.equal(grid.values(codes), decode(data, kind))
    assert torch.equal(with_codes(data, kind, codes), data)


@pytest.mark.parametrize("kind", AFFINE, ids=lambda k: k.value)
def test_other_codes_keep_the_scales(kind):
    x = _rows(kind)
    data = encode(x, kind)
    grid = grid_of(data, kind)
    other = torch.randint(grid.cmin, grid.cmax + 1, x.shape, generator=torch.Generator().manual_seed(2))
    moved = with_codes(data, kind, other)
    assert torch.equal(codes_of(moved, kind), other.to(torch.int32))
    assert torch.equal(decode(moved, kind), grid.values(other))
    after = grid_of(moved, kind)
    assert torch.equal(after.step, grid.step) and torch.equal(after.offset, grid.offset)
    assert moved.shape == data.shape and moved.shape[1] == 512 // GEOMETRY[kind][0] * GEOMETRY[kind][1]


def test_bad_codes_and_types_are_errors():
    from lowbit.numerics.ggml import GgmlType

    data = encode(_rows(GgmlType.Q4_K), GgmlType.Q4_K)
    with pytest.raises(QuantizationError, match=r"codes must lie in \[0, 15\]"):
        with_codes(data, GgmlType.Q4_K, torch.full((6, 512), 16))
    with pytest.raises(QuantizationError, match="do not match"):
        with_codes(data, GgmlType.Q4_K, torch.zeros(6, 256))
    with pytest.raises(QuantizationError, match="mxfp4 has no affine codes"):
        grid_of(data, GgmlType.MXFP4)
