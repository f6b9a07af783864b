"""cpu-int8: exact int32 accumulators (equal to the reference codes multiplied in int64),
outputs equal to the reference backend within float32 rounding."""

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn

import lowbit
from lowbit.backends import REGISTRY, use_backend
from lowbit.backends.cpu_int8 import CHUNK, CpuInt8Backend, int_accumulate, quantize_input_values
from lowbit.backends.reference import ReferenceBackend
from lowbit.modules.inputs import quantize_input
from lowbit.errors import LowbitError, QuantizationError
from lowbit.modules import QuantLinear
from lowbit.numerics import INT8
from lowbit.quant import QuantizedTensor
from lowbit.schemes import WeightObserver, Scheme, get_scheme


def _int8_codes(vals: torch.Tensor) -> torch.Tensor:
    return INT8.encode(vals.to(torch.float32))


def _exact(a_vals: torch.Tensor, w_vals: torch.Tensor) -> torch.Tensor:
    return a_vals.to(torch.int64) @ w_vals.to(torch.int64).t()


def _module(w_vals: torch.Tensor, scheme: str, input_scale=None, bias=None) -> QuantLinear:
    s = get_scheme(scheme)
    qw = QuantizedTensor(_int8_codes(w_vals), torch.full((w_vals.shape[0], 1), 0.01), s.weights)
    return QuantLinear.from_quantized(qw, s, bias, input_scale=input_scale, name="t")


def test_chunk_bound_is_exact_limit():
    # the largest |product| of two int8 values is (-128)*(-128) = 2^14; 2^24 / 2^14 = 1024
    assert CHUNK * 128 * 128 == 2 ** 24
    assert CHUNK == 1024


@pytest.mark.parametrize("k", [1024, 1025, 3000])
def test_adversarial_accumulators_exact(k):
    # all-extreme values: every product is +-2^14 (or 127*128...), partial sums reach 2^24
    g = torch.Generator().manual_seed(k)
    a = torch.where(torch.rand(6, k, generator=g) < 0.5, -128.0, 127.0)
    a[0] = -128.0
    w = torch.where(torch.rand(5, k, generator=g) < 0.5, -128.0, 127.0)
    w[0] = -128.0
    w[1] = 127.0
    acc = int_accumulate(a, w)
    assert acc.dtype == torch.int32
    assert torch.equal(acc.to(torch.int64), _exact(a, w))
    assert int(acc[0, 0]) == k * 128 * 128


def test_unchunked_float_accumulation_is_not_exact():
    # the bound matters: one chunk of 2049 with an odd total above 2^24 loses the low bit
    k = 2049
    a = torch.full((1, k), 127.0)
    w = torch.full((1, k), 127.0)
    a[0, -1] = 1.0
    w[0, -1] = 1.0
    exact = _exact(a, w)
    assert int(exact) == 2048 * 127 * 127 + 1
    assert not torch.equal(int_accumulate(a, w, chunk=k).to(torch.int64), exact)
    assert torch.equal(int_accumulate(a, w).to(torch.int64), exact)


@pytest.mark.parametrize("scheme", ["w8a8-int8", "w8a8-int8-dynamic"])
@pytest.mark.parametrize("k", [64, 1536, 2500])
def test_module_accumulators_equal_reference_codes(scheme, k):
    g = torch.Generator().manual_seed(k)
    w = torch.randint(-128, 128, (48, k), generator=g).to(torch.float32)
    w[0, :] = -128.0
    scale = torch.tensor([0.02]) if scheme == "w8a8-int8" else None
    m = _module(w, scheme, input_scale=scale, bias=torch.randn(48, generator=g))
    x = torch.randn(2, 7, k, generator=g) * 2
    x[0, 0, :] = -100.0  # saturates to -128 under the static scale
    x[1, 3, :] = 0.0     # an all-zero token (dynamic: zero scale)
    qi = quantize_input(m, x)
    a_ref = INT8.codes_to_int(qi.codes).reshape(-1, k)
    acc = CpuInt8Backend().accumulators(m, x).reshape(-1, 48)
    assert torch.equal(acc.to(torch.int64), _exact(a_ref, w))
    if scheme == "w8a8-int8":
        assert int(a_ref.min()) == -128
    out = CpuInt8Backend().forward(m, x)
    ref = ReferenceBackend().forward(m, x)
    assert out.shape == ref.shape == (2, 7, 48)
    torch.testing.assert_close(out, ref, rtol=2e-6, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("scheme", ["w8a8-int8", "w8a8-int8-dynamic"])
def test_input_values_bit_identical_to_reference(scheme):
    torch.manual_seed(0)
    lin = nn.Linear(96, 32)
    m = QuantLinear.from_linear(lin, get_scheme(scheme), name="t",
                                input_scale=torch.tensor([0.013]) if scheme == "w8a8-int8" else None)
    x = torch.randn(40, 96) * torch.logspace(-3, 2, 96)
    x[5] = 0.0
    vals, _ = quantize_input_values(m, x)
    ref = INT8.codes_to_int(quantize_input(m, x).codes).to(torch.float32)
    assert torch.equal(vals, ref)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_is_an_error(bad):
    lin = nn.Linear(16, 8)
    m = QuantLinear.from_linear(lin, get_scheme("w8a8-int8"), name="layer.x", input_scale=torch.tensor([0.1]))
    x = torch.randn(3, 16)
    x[1, 2] = bad
    with pytest.raises(QuantizationError, match="layer.x.input"):
        CpuInt8Backend().forward(m, x)


def test_registry_selection():
    lin = nn.Linear(16, 8)
    int8 = QuantLinear.from_linear(lin, get_scheme("w8a8-int8-dynamic"), name="a")
    fp8 = QuantLinear.from_linear(lin, get_scheme("w8a8-fp8-dynamic"), name="b")
    assert REGISTRY.select(int8).name == "cpu-int8"
    assert REGISTRY.select(fp8).name == "weight-cache"
    model = nn.Sequential(fp8)
    with pytest.raises(LowbitError, match="cpu-int8"):
        use_backend(model, "cpu-int8")


def test_weight_cache_invalidated_on_new_weights():
    torch.manual_seed(1)
    lin = nn.Linear(32, 8)
    s = get_scheme("w8a8-int8-dynamic")
    # the max rule keeps codes in [-127, 127], so that negating them stays in int8
    s = Scheme(s.name, dataclasses.replace(s.weights, observer=WeightObserver.MAX), s.input_activations)
    m = QuantLinear.from_linear(lin, s, name="t")
    be = CpuInt8Backend()
    x = torch.randn(4, 32)
    y0 = be.forward(m, x)
    m.weight_codes.copy_(_int8_codes(-INT8.codes_to_int(m.weight_codes).to(torch.float32)))
    y1 = be.forward(m, x)
    torch.testing.assert_close(y1, -y0 + 2 * m.bias, rtol=1e-5, atol=1e-5)
    be.release(m)
    assert m not in be.cache and len(be.cache) == 0


@pytest.mark.parametrize("scheme", ["w8a8-int8", "w8a8-int8-dynamic"])
def test_model_cpu_int8_equals_reference(llama, token_ids, scheme):
    calib = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(2))
    q = lowbit.quantize(copy.deepcopy(llama), scheme, calib, smoothquant=0.5, num_samples=4, seq_len=32)
    assert use_backend(q, "reference") == {"reference": 14}
    ref = q(token_ids).logits
    assert use_backend(q, "auto") == {"cpu-int8": 14}
    out = q(token_ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
