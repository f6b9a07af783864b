"""Hadamard matrices: orthonormal, +-1/sqrt(n) entries, the documented constructions and blocks."""

from __future__ import annotations

import math

import pytest
import torch

from lowbit.algorithms.rotate.hadamard import block_hadamard, block_size, hadamard, hadamard_order, orders_of
from lowbit.errors import QuantizationError


@pytest.mark.parametrize("n, split", [(12, (12, 1)), (36, (36, 1)), (64, (1, 64)), (576, (36, 16)),
                                      (1536, (12, 128)), (20, (20, 1)), (28, (28, 1)), (2, (1, 2))])
def test_orthonormal_with_equal_magnitude_entries(n, split):
    h = hadamard(n)
    assert orders_of(n) == split and h.dtype == torch.float64 and h.shape == (n, n)
    assert (h @ h.t() - torch.eye(n, dtype=torch.float64)).abs().max().item() < 1e-12
    assert torch.allclose(h.abs(), torch.full_like(h, 1 / math.sqrt(n)), rtol=0, atol=1e-15)
    assert torch.equal(hadamard(n), h)  # deterministic


def test_cast_after_building():
    h32 = hadamard(576, torch.float32)
    assert h32.dtype == torch.float32 and torch.equal(h32, hadamard(576).float())
    assert (h32.double() @ h32.double().t() - torch.eye(576, dtype=torch.float64)).abs().max().item() < 1e-5


def test_block_diagonal_where_no_order_is_constructible():
    # 92 = 4 * 23: 91 and 45 are not prime, 46 is not a multiple of 4; the largest constructible divisor is 4
    assert not hadamard_order(92) and block_size(92) == 4
    with pytest.raises(QuantizationError, match="order 92"):
        hadamard(92)
    b = block_hadamard(92)
    assert (b @ b.t() - torch.eye(92, dtype=torch.float64)).abs().max().item() < 1e-12
    assert torch.equal(b[:4, :4], hadamard(4)) and torch.equal(b[88:, 88:], hadamard(4))
    assert b[:4, 4:].abs().max().item() == 0.0 and torch.count_nonzero(b).item() == 23 * 16


def test_constructible_orders_are_used_whole_and_odd_widths_get_blocks_of_one():
    assert block_size(576) == 576 and torch.equal(block_hadamard(576), hadamard(576))
    assert block_size(15) == 1 and torch.equal(block_hadamard(15), torch.eye(15, dtype=torch.float64))
