"""Shared experts held as three 3-D parameters and weighted per token (Inkling's
``InklingSharedExperts``), split into one ``ExpertMLP`` per expert (lowbit.moe.weighted_shared)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import lowbit
from lowbit.errors import QuantizationError
from lowbit.moe import split_experts
from lowbit.moe.weighted_shared import Site, WeightedSharedExperts, is_weighted_shared, split_weighted_shared

torch.set_grad_enabled(False)


class _Transposed(nn.Module):
    """Another module of the kind: stored [E, in, out], named nothing like Inkling's, weights on the
    expert's input, summed in a plain loop."""

    def __init__(self, e: int = 3, h: int = 12, i: int = 20) -> None:
        super().__init__()
        self.count = e
        self.gate_proj = nn.Parameter(torch.randn(e, h, i))
        self.up_proj = nn.Parameter(torch.randn(e, h, i))
        self.down_proj = nn.Parameter(torch.randn(e, i, h))
        self.act_fn = nn.GELU()

    def forward(self, x, w):
        out = 0
        for k in range(self.count):
            xk = x * w[..., k, None]
            out = out + (self.act_fn(xk @ self.gate_proj[k]) * (xk @ self.up_proj[k])) @ self.down_proj[k]
        return out


class _Odd(_Transposed):
    def forward(self, x, w):  # the weights squared: no candidate computes it, refused rather than guessed
        return super().forward(x, w * w)


def _inkling():
    from helpers.families import tiny_model

    return tiny_model("inkling_text")


def _ids(rows=2, cols=16):
    return torch.randint(3, 256, (rows, cols), generator=torch.Generator().manual_seed(0))


def test_a_hand_made_module_is_split_in_the_layout_its_forward_computes():
    torch.manual_seed(0)
    m = _Transposed()
    assert is_weighted_shared(m)
    s = split_weighted_shared("blk", m)
    assert isinstance(s, WeightedSharedExperts) and len(s) == 3 and s.layout.transposed and s.layout.separate
    assert s.site is Site.INPUT and s.weights_arg == "w"
    assert s[2].gate_proj.weight.shape == (20, 12) and s[2].down_proj.weight.shape == (12, 20)
    x, w = torch.randn(2, 5, 12), torch.rand(2, 5, 3)
    ref = m(x, w)
    assert torch.allclose(s(x, w), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert torch.allclose(s(x, w=w), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    with pytest.raises(QuantizationError, match="'odd' .*cannot split"):
        split_weighted_shared("odd", _Odd())


def test_inkling_shared_experts_are_split_and_compute_the_same():
    model = _inkling()
    ids = _ids()
    ref = model(input_ids=ids, use_cache=False).logits
    mlp = model.get_submodule("model.layers.0.mlp")
    x, gammas = torch.randn(2, 5, 128), torch.rand(10, 2)
    want = mlp.shared_experts(x, gammas=gammas)
    names = split_experts(model)
    assert "model.layers.1.mlp.shared_experts" in names
    shared = mlp.shared_experts
    assert isinstance(shared, WeightedSharedExperts) and len(shared) == 2 and shared.site is Site.HIDDEN
    assert not shared.layout.transposed and shared.weights_arg == "gammas"
    assert type(shared[1].down_proj) is nn.Linear and shared[1].gate_proj.weight.shape == (128, 128)
    assert torch.allclose(shared(x, gammas=gammas), want, rtol=1e-5, atol=1e-6)
    assert torch.allclose(model(input_ids=ids, use_cache=False).logits, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", ["w8a8-int8", "w4a16"])
def test_inkling_quantizes_and_reloads_exactly(scheme, tmp_path):
    model = _inkling()
    ids = _ids()
    ref = model(input_ids=ids, use_cache=False).logits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q = lowbit.quantize(copy.deepcopy(model), scheme, calibration=ids, allow_unquantized=True)
    left = [str(w.message) for w in caught if "cannot be quantized" in str(w.message)]
    assert len(left) == 1 and left[0].startswith("lowbit: 2 weight matrices") and "rel_logits_proj.proj" in left[0]
    for n in ("model.layers.0.mlp.shared_experts.0.gate_proj", "model.layers.1.mlp.shared_experts.1.down_proj"):
        assert type(q.get_submodule(n)).__name__ == "QuantLinear", n
    got = q(input_ids=ids, use_cache=False).logits
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < 0.02, err  # 0.0057 (w8a8-int8), 0.0045 (w4a16)
    back = lowbit.load(lowbit.save(q, tmp_path / "q"))
    assert torch.equal(back(input_ids=ids, use_cache=False).logits, got)


def test_inkling_streamed_and_model_free_equal_in_memory(tmp_path):
    """The checkpoint holds each projection fused ([E, I, H]): the streamed skeleton and model-free
    quantization read expert e's linears out of it as the in-memory split holds them."""
    from helpers.folders import assert_same_tensors, folder_tensors
    from helpers.streamed import in_memory, write_folder
    from lowbit.modelfree import quantize_model_free

    ids = _ids()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        src = write_folder(_inkling(), tmp_path / "src")
        assert "model.layers.0.mlp.shared_experts.gate_proj" in folder_tensors(src)
        a = in_memory(src, tmp_path / "mem", "w8a8-int8", "lowbit", ids, allow_unquantized=True)
        b = lowbit.quantize_checkpoint(src, tmp_path / "str", "w8a8-int8", "lowbit", calibration=ids,
                                       allow_unquantized=True)
        assert_same_tensors(folder_tensors(a), folder_tensors(b))
        assert "model.layers.1.mlp.shared_experts.1.up_proj.weight_codes" in folder_tensors(b)
        src32 = write_folder(_inkling(), tmp_path / "src32", dtype=torch.float32)  # model-free keeps the dtype
        quantize_model_free(src32, tmp_path / "mf", "w8a16")
        c = in_memory(src32, tmp_path / "mem16", "w8a16", "lowbit", ids, allow_unquantized=True)
    assert_same_tensors(folder_tensors(c), folder_tensors(tmp_path / "mf"))
