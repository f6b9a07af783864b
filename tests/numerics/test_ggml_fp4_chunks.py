"""GGML's FP4 encoders work through large tensors in chunks of groups (``ggml_fp4.CHUNK``): the
bytes of a tensor with more groups than a chunk equal those of its rows encoded in parts."""

from __future__ import annotations

import pytest
import torch

from lowbit.numerics.ggml import GgmlType, encode
from lowbit.numerics.ggml_fp4 import CHUNK


@pytest.mark.parametrize("kind,group", [(GgmlType.MXFP4, 32), (GgmlType.NVFP4, 16)])
def test_more_groups_than_a_chunk_encode_as_their_parts(kind, group):
    rows = CHUNK * group // 64 + 37                   # rows of 64 weights: more groups than one chunk
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-4, 2, rows)[:, None]
    whole = encode(x, kind)
    assert x.numel() // group > CHUNK
    cut = rows // 3
    assert torch.equal(whole, torch.cat([encode(x[:cut], kind), encode(x[cut:], kind)]))
