"""A quantized linear answers ``.weight`` as a float linear does (a model's forward may read it:
ERGO's layers read ``o_proj.weight.dtype``): the dequantized weight in the model's dtype, computed
at each access, never a parameter, buffer or state-dict entry."""

from __future__ import annotations

import torch

from lowbit import get_scheme
from lowbit.modules.qlinear import QuantLinear


def test_weight_is_the_dequantized_weight_in_the_model_dtype():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32).to(torch.bfloat16)
    q = QuantLinear.from_linear(lin, get_scheme("w4a16"), name="l")
    w = q.weight
    assert w.dtype == torch.bfloat16 and w.shape == (32, 64)
    assert torch.equal(w, q.dequantized_weight(torch.bfloat16))
    assert not torch.equal(w, lin.weight)  # rounded: 4-bit codes, not the float weight
    assert "weight" not in dict(q.named_parameters()) and "weight" not in dict(q.named_buffers())
    assert "weight" not in q.state_dict()
