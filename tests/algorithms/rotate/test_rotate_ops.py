"""The rotation algebra on tensors: what each function keeps invariant, and its shape errors."""

from __future__ import annotations

import pytest
import torch

from lowbit.algorithms.rotate.hadamard import hadamard
from lowbit.algorithms.rotate.ops import (
    fold_gain, rotate_bias, rotate_head_bias, rotate_head_inputs, rotate_head_outputs, rotate_inputs, rotate_outputs,
)
from lowbit.errors import QuantizationError

G = torch.Generator().manual_seed(0)


def _r(*shape):
    return torch.randn(*shape, generator=G, dtype=torch.float64)


def test_reader_writer_pair_is_unchanged_and_the_stream_is_rotated():
    q = hadamard(12)
    x, w_in, w_out, b = _r(5, 12), _r(7, 12), _r(12, 7), _r(12)
    # a reader of the rotated stream x Q computes what it computed on x
    assert torch.allclose((x @ q) @ rotate_inputs(w_in, q).t(), x @ w_in.t(), atol=1e-12)
    # a writer writes (z W^T + b) Q
    z = _r(5, 7)
    assert torch.allclose(z @ rotate_outputs(w_out, q).t() + rotate_bias(b, q), (z @ w_out.t() + b) @ q, atol=1e-12)


def test_fold_gain_and_dtype_kept():
    w, g = _r(3, 4).float(), torch.tensor([1.0, 2.0, 0.5, -1.0])
    out = fold_gain(w, g)
    assert out.dtype == torch.float32 and torch.allclose(out, w * g, atol=0)


def test_per_head_rotation_of_v_and_o_cancels_within_each_head():
    h, heads, d = hadamard(4), 3, 4
    w_v, b_v, w_o = _r(heads * d, 10), _r(heads * d), _r(10, heads * d)
    x = _r(6, 10)
    v = x @ w_v.t() + b_v
    v_rot = x @ rotate_head_outputs(w_v, h).t() + rotate_head_bias(b_v, h)
    assert torch.allclose(v_rot.reshape(6, heads, d), v.reshape(6, heads, d) @ h, atol=1e-12)  # each head: v H
    assert torch.allclose(v_rot @ rotate_head_inputs(w_o, h).t(), v @ w_o.t(), atol=1e-12)


def test_shape_errors_name_the_mismatch():
    with pytest.raises(QuantizationError, match="gain of shape \\(3,\\) does not match a weight of 4 input columns"):
        fold_gain(_r(2, 4), _r(3))
    with pytest.raises(QuantizationError, match="rows: 10 is not a whole number of heads of size 4"):
        rotate_head_outputs(_r(10, 3), hadamard(4))
