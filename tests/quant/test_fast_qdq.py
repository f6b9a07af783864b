"""The code-free QDQ paths equal decode(encode(.)) and dequantize(quantize(.)) bit for bit."""

import pytest
import torch

from lowbit.numerics import E2M1, E4M3, E5M2, UE4M3, UE5M3
from lowbit.quant import dequantize, fake_quantize, global_scale_from_amax, quantize
from lowbit.schemes import PRESETS


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _all_half_patterns() -> torch.Tensor:
    codes = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    return torch.cat([codes.view(torch.float16).float(), codes.view(torch.bfloat16).float()])


@pytest.mark.parametrize("fmt", [E2M1, E4M3, E5M2, UE4M3, UE5M3], ids=lambda f: f.name)
def test_minifloat_qdq_equals_decode_encode(fmt):
    g = torch.Generator().manual_seed(7)
    x = torch.cat([
        _all_half_patterns(),
        torch.ldexp(torch.rand(200_000, generator=g) + 0.5, torch.randint(-40, 30, (200_000,), generator=g).float())
        * torch.where(torch.rand(200_000, generator=g) < 0.5, -1.0, 1.0),
        torch.tensor([0.0, -0.0, float("inf"), float("-inf"), fmt.max_finite, fmt.min_subnormal / 2,
                      fmt.min_subnormal * 1.5, fmt.min_normal * 1.9375]),
    ])
    if fmt.nan_code is None:
        x = x[~torch.isnan(x)]
    if not fmt.signed:
        x = x[~(x < 0)].abs()  # -0.0 becomes +0.0, as the unsigned encoders require
    ref = fmt.decode(fmt.encode(x))
    got = fmt.qdq(x)
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(_bits(got)[~nan], _bits(ref)[~nan])


@pytest.mark.parametrize("name", [n for n, s in PRESETS.items()])
def test_fake_quantize_equals_dequantize_quantize(name):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, 256, generator=g) * torch.logspace(-6, 3, 256)
    x[0, 0, :32] = 0.0                  # all-zero blocks
    x[0, 1, :16] = -0.0
    x[1, 2, 3] = 1e-30                  # a block whose scale underflows
    for spec in (PRESETS[name].weights, PRESETS[name].input_activations):
        if spec is None:
            continue
        kw = {}
        if spec.global_scale:
            kw["global_scale"] = global_scale_from_amax(x.abs().amax(), spec)
        if spec.dynamic.value == "static" and spec.granularity.value == "tensor":
            kw["scale"] = x.abs().amax().reshape(1) / 100.0   # static scale: many values saturate
        ref = dequantize(quantize(x, spec, **kw))
        got = fake_quantize(x, spec, **kw)
        assert torch.equal(_bits(got), _bits(ref)), name
