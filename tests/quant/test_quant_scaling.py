"""Block scaling (lowbit.quant.qdq) against manual computations in the documented order."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lowbit.errors import QuantizationError
from lowbit.numerics import E2M1, E4M3, E8M0, INT4, INT8, UE4M3, UE5M3, FormatName as F
from lowbit.quant import (
    QuantizedTensor, allows_ragged, amax, check_finite, dequantize, effective_scale, fake_quantize,
    global_scale_from_amax, num_groups, quantize, scales_from_amax, static_scale_from_amax,
)
from lowbit.schemes import PRESETS, Dynamic, Granularity as G, WeightObserver, QuantSpec


def _max_rule(spec: QuantSpec) -> QuantSpec:
    """These tests check the max rule's scales (the mse observer: tests/quant/test_weight_search.py)."""
    return dataclasses.replace(spec, observer=WeightObserver.MAX)


NVFP4 = _max_rule(PRESETS["nvfp4"].weights)
NVFP4_ACT = PRESETS["nvfp4"].input_activations
E5M3 = _max_rule(PRESETS["nvfp4-e5m3"].weights)
MXFP4 = _max_rule(PRESETS["mxfp4"].weights)
MXFP8 = _max_rule(PRESETS["mxfp8"].weights)
INT8_CH = QuantSpec(F.INT8, G.CHANNEL)
INT4_CH = QuantSpec(F.INT4, G.CHANNEL)
FP8_CH = QuantSpec(F.E4M3, G.CHANNEL)
INT4_G128 = QuantSpec(F.INT4, G.GROUP, 128)
INT8_ASYM = QuantSpec(F.INT8, G.CHANNEL, symmetric=False)


def randn(*shape, seed=0, scale_rows=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if scale_rows:  # rows with different magnitudes, as real weights have
        x = x * torch.exp(torch.randn(*shape[:-1], 1, generator=g))
    return x


# ---------------------------------------------------------------------------- per tensor / channel
def test_per_tensor_int8():
    x = randn(16, 64)
    spec = QuantSpec(F.INT8, G.TENSOR)
    q = quantize(x, spec)
    s = x.abs().max() / 127
    assert q.scale.shape == (1,) and q.scale.dtype == torch.float32
    assert torch.equal(q.scale, s.reshape(1))
    manual = torch.clamp(torch.round(x / s), -128, 127)
    assert torch.equal(INT8.codes_to_int(q.codes).float(), manual)
    assert int(manual.abs().max()) == 127
    assert torch.equal(dequantize(q), manual * s)
    assert torch.equal(fake_quantize(x, spec), manual * s)


@pytest.mark.parametrize("spec,fmt", [(INT8_CH, INT8), (INT4_CH, INT4), (FP8_CH, E4M3)], ids=["int8", "int4", "e4m3"])
def test_per_channel(spec, fmt):
    x = randn(32, 96, seed=1)
    q = quantize(x, spec)
    assert q.scale.shape == (32, 1)
    s = x.abs().amax(dim=1, keepdim=True) / fmt.max_finite
    assert torch.equal(q.scale, s)
    assert torch.equal(q.codes, fmt.encode(x / s))
    assert torch.equal(dequantize(q), fmt.decode(q.codes) * s)
    # every row reaches the format's extreme (its amax element maps to +-max)
    assert torch.equal(fmt.decode(q.codes).abs().amax(dim=1), torch.full((32,), fmt.max_finite))


def test_per_channel_error_bound_int8():
    x = randn(64, 128, seed=2)
    q = quantize(x, INT8_CH)
    err = (dequantize(q) - x).abs()
    assert bool((err <= q.scale / 2 * (1 + 1e-5)).all())


# ---------------------------------------------------------------------------- per group (ragged)
@pytest.mark.parametrize("fmt,spec", [(INT4, INT4_G128), (INT8, QuantSpec(F.INT8, G.GROUP, 128))], ids=["int4", "int8"])
def test_per_group_ragged_last_group(fmt, spec):
    x = randn(6, 576, seed=3)
    x[2, 512:] *= 50.0  # the ragged last group of one row has its own, larger amax
    assert allows_ragged(spec) and num_groups(576, spec) == 5
    q = quantize(x, spec)
    assert q.scale.shape == (6, 5) and q.codes.shape == (6, 576)
    for r in range(6):
        for gi in range(5):
            cols = slice(gi * 128, min((gi + 1) * 128, 576))
            blk = x[r, cols]
            s = blk.abs().max() / fmt.qmax
            assert q.scale[r, gi] == s, (r, gi)
            manual = torch.clamp(torch.round(blk / s), fmt.qmin, fmt.qmax)
            assert torch.equal(fmt.codes_to_int(q.codes[r, cols]).float(), manual), (r, gi)
            assert torch.equal(dequantize(q)[r, cols], manual * s)
    assert float(q.scale[2, 4]) > 10 * float(q.scale[2, 3])


def test_asymmetric_ragged_group():
    spec = QuantSpec(F.INT4, G.GROUP, 128, symmetric=False)
    x = randn(3, 576, seed=4) + 0.7
    q = quantize(x, spec)
    assert q.scale.shape == (3, 5) and q.zero_point.shape == (3, 5)
    for r in range(3):
        for gi in range(5):
            cols = slice(gi * 128, min((gi + 1) * 128, 576))
            blk = x[r, cols]
            lo, hi = torch.clamp(blk.min(), max=0.0), torch.clamp(blk.max(), min=0.0)
            s = (hi - lo) / 15.0
            zp = torch.clamp(torch.round(-8 - lo / s), -8, 7)
            assert q.scale[r, gi] == s and q.zero_point[r, gi] == zp
            manual = torch.clamp(torch.round(blk / s) + zp, -8, 7)
            assert torch.equal(INT4.codes_to_int(q.codes[r, cols]).float(), manual)


# ---------------------------------------------------------------------------- per token (3-D)
@pytest.mark.parametrize("preset,fmt", [("w8a8-int8-dynamic", INT8), ("w8a8-fp8-dynamic", E4M3)])
def test_per_token_3d(preset, fmt):
    spec = PRESETS[preset].input_activations
    assert spec.granularity is G.TOKEN and spec.dynamic is Dynamic.DYNAMIC
    x = randn(2, 5, 64, seed=5)
    x[1, 3] *= 100.0  # one loud token must not affect the others
    q = quantize(x, spec)
    assert q.scale.shape == (2, 5, 1)
    s = x.abs().amax(dim=-1, keepdim=True) / fmt.max_finite
    assert torch.equal(q.scale, s)
    assert torch.equal(q.codes, fmt.encode(x / s))
    assert torch.equal(dequantize(q), fmt.decode(q.codes) * s)
    assert torch.equal(q.scale[0], quantize(x[0], spec).scale)  # rows are independent


# ---------------------------------------------------------------------------- static per tensor
def test_static_per_tensor_activation_scale():
    spec = PRESETS["w8a8-int8"].input_activations
    s = static_scale_from_amax(torch.tensor(4.0), spec)
    assert s.shape == (1,) and torch.equal(s, torch.tensor([4.0]) / 127)
    x = torch.tensor([[0.0, 1.0, -2.0, 4.0, 8.0, -100.0]])
    q = quantize(x, spec, scale=s)
    assert torch.equal(q.scale, s)
    assert INT8.codes_to_int(q.codes).tolist() == [[0, 32, -64, 127, 127, -128]]  # saturates
    fp8 = PRESETS["w8a8-fp8"].input_activations
    assert torch.equal(static_scale_from_amax(torch.tensor([896.0]), fp8), torch.tensor([2.0]))
    # an uncalibrated (zero) amax gives a usable scale, not 0 or NaN
    assert torch.equal(static_scale_from_amax(torch.tensor([0.0]), spec), torch.tensor([1.0]) / 127)
    with pytest.raises(QuantizationError):
        static_scale_from_amax(torch.tensor(1.0), PRESETS["w8a8-int8-dynamic"].input_activations)


# ---------------------------------------------------------------------------- NVFP4
def test_nvfp4_global_and_block_scales():
    x = randn(8, 64, seed=6)
    x[3, 16:32] *= 1e-3  # a quiet block: small but normal-range UE4M3 scale
    q = quantize(x, NVFP4)
    t_amax = x.abs().max()
    g = torch.tensor(448.0 * 6.0) / t_amax
    assert q.global_scale.shape == (1,) and torch.equal(q.global_scale, g.reshape(1))
    assert float(q.global_scale) == pytest.approx(2688.0 / float(t_amax), rel=1e-7)
    assert q.scale.shape == (8, 4)
    amax_b = x.reshape(8, 4, 16).abs().amax(-1)
    s = UE4M3.qdq(amax_b / 6 * g)
    assert torch.equal(q.scale, s)
    assert float(q.scale.max()) == 448.0  # the block holding the tensor amax
    eff = s / g
    manual = E2M1.encode(x.reshape(8, 4, 16) / eff[..., None]).reshape(8, 64)
    assert torch.equal(q.codes, manual)
    assert torch.equal(effective_scale(q.scale, NVFP4, q.global_scale), eff)
    dq = dequantize(q)
    assert torch.equal(dq, (E2M1.decode(manual).reshape(8, 4, 16) * eff[..., None]).reshape(8, 64))
    # scale codes are UE4M3 codes that decode back to the scales
    assert torch.equal(UE4M3.decode(q.scale_codes()), q.scale)
    # error bounds: the block scale is within 1/16 of amax_b/6 (UE4M3 normal range), and the
    # largest E2M1 rounding error is half the widest gap (1, between 4 and 6) or the
    # saturation error (at most 6/15 of eff): |x - dq| <= eff per element, < amax_b * 0.18
    err = (dq - x).abs().reshape(8, 4, 16)
    assert bool((err <= eff[..., None] * (1 + 1e-6)).all())
    assert bool((err.amax(-1) <= amax_b * (1 / 6) * (17 / 16) * (1 + 1e-6)).all())
    rel_rmse = float(((dq - x) ** 2).mean().sqrt() / (x**2).mean().sqrt())
    assert rel_rmse < 0.15


def test_nvfp4_block_scale_subnormal_and_flushed():
    x = torch.zeros(1, 64)
    x[0, :16] = torch.linspace(-1000.0, 1000.0, 16)  # tensor amax 1000: g = 2.688
    x[0, 16:32] = torch.linspace(-5e-3, 5e-3, 16)  # 5e-3/6*g = 2.24e-3: UE4M3 subnormal 2^-9
    x[0, 32:48] = torch.linspace(-1e-3, 1e-3, 16)  # 4.5e-4 < 2^-10: block scale rounds to 0
    x[0, 48:] = torch.linspace(-7e-3, 7e-3, 16)  # 3.1e-3: subnormal 2 * 2^-9 (2^-8)
    q = quantize(x, NVFP4)
    assert q.scale[0].tolist() == [448.0, 2.0**-9, 0.0, 2.0**-8]
    assert UE4M3.encode(q.scale[0]).tolist() == [0x7E, 1, 0, 2]
    dq = dequantize(q)
    assert bool(torch.isfinite(dq).all())
    assert bool((dq[0, 32:48] == 0).all()) and bool((q.codes[0, 32:48] == 0).all())
    eff = 2.0**-9 / q.global_scale
    assert torch.equal(dq[0, 16:32], E2M1.qdq(x[0, 16:32] / eff) * eff)


def test_nvfp4_activation_with_given_global_scale():
    x = randn(3, 7, 32, seed=7, scale_rows=False)
    calib_amax = torch.tensor(10.0)
    g = global_scale_from_amax(calib_amax, NVFP4_ACT)
    assert torch.equal(g, torch.tensor([268.8]))
    q = quantize(x, NVFP4_ACT, global_scale=g)
    assert torch.equal(q.global_scale, g)
    amax_b = x.reshape(3, 7, 2, 16).abs().amax(-1)
    assert torch.equal(q.scale, UE4M3.qdq(amax_b / 6 * g))
    # a global scale computed from x instead differs
    assert not torch.equal(quantize(x, NVFP4_ACT).global_scale, g)


def test_global_scale_of_zero_tensor_and_required():
    assert torch.equal(global_scale_from_amax(torch.tensor(0.0), NVFP4), torch.tensor([1.0]))
    with pytest.raises(QuantizationError, match="global"):
        scales_from_amax(torch.ones(2, 2), NVFP4)


# ---------------------------------------------------------------------------- NVFP4-E5M3
def test_e5m3_block_scales_including_subnormal():
    x = randn(6, 64, seed=8, scale_rows=False)
    # amax/6 of these blocks: 3*2^-17 (subnormal code 3), 2^-15 (subnormal code 4),
    # 1.3*2^-17 (code 1), 0.4*2^-17 < 2^-18 (flushed to 0)
    sub_targets = {(1, 0): 3 * 2.0**-17, (1, 1): 2.0**-15, (1, 2): 1.3 * 2.0**-17, (1, 3): 0.4 * 2.0**-17}
    for (r, b), target in sub_targets.items():
        blk = x[r, b * 16:(b + 1) * 16]
        x[r, b * 16:(b + 1) * 16] = blk / blk.abs().max() * (6 * target)
    x[4] *= 1000.0  # large normal scales too
    q = quantize(x, E5M3)
    assert q.global_scale is None
    amax_b = x.reshape(6, 4, 16).abs().amax(-1)
    s = UE5M3.qdq(amax_b / 6)
    assert torch.equal(q.scale, s)
    codes = UE5M3.encode(q.scale)
    assert torch.equal(q.scale_codes(), codes)
    assert codes[1].tolist() == [3, 4, 1, 0]
    assert q.scale[1].tolist() == [3 * 2.0**-17, 2.0**-15, 2.0**-17, 0.0]
    assert bool((q.scale[1, :3] < UE5M3.min_normal).all())
    manual = E2M1.encode(x.reshape(6, 4, 16) / torch.where(s > 0, s, 1.0)[..., None])
    manual = torch.where((s > 0)[..., None], manual, torch.zeros_like(manual)).reshape(6, 64)
    assert torch.equal(q.codes, manual)
    dq = dequantize(q)
    assert torch.equal(dq, (E2M1.decode(manual).reshape(6, 4, 16) * s[..., None]).reshape(6, 64))
    assert bool((dq[1, 48:] == 0).all())  # the flushed block decodes to exact zeros
    # exactly representable blocks (amax/6 on a UE5M3 value, elements on the E2M1 grid) are exact
    assert torch.equal(dq[1, :16] / (3 * 2.0**-17), E2M1.qdq(x[1, :16] / (3 * 2.0**-17)))


# ---------------------------------------------------------------------------- MX
@pytest.mark.parametrize("spec,elem,emax", [(MXFP4, E2M1, 2), (MXFP8, E4M3, 8)], ids=["mxfp4", "mxfp8"])
def test_mx_scales(spec, elem, emax):
    x = randn(4, 128, seed=9)
    x[0, :32] = torch.linspace(-7.9, 7.9, 32)  # amax 7.9: floor(log2) = 2
    x[1, 32:64] *= 2.0**-60
    x[2, 64:96] = 0.0
    q = quantize(x, spec)
    assert q.scale.shape == (4, 4)
    blocks = x.reshape(4, 4, 32)
    for r in range(4):
        for b in range(4):
            a = float(blocks[r, b].abs().max())
            e = -127 if a == 0 else max(-127, min(127, math.frexp(a)[1] - 1 - emax))
            assert float(q.scale[r, b]) == 2.0**e, (r, b)
            assert int(q.scale_codes()[r, b]) == e + 127
    assert float(q.scale[0, 0]) == 2.0 ** (2 - emax)
    assert torch.equal(q.codes, elem.encode(blocks / q.scale[..., None]).reshape(4, 128))
    dq = dequantize(q)
    if spec is MXFP4:  # 7.9 / 2^0 saturates to 6 (the OCP MX rule)
        assert float(dq[0, 31]) == 6.0 and float(dq[0, 0]) == -6.0
    assert bool((dq[2, 64:96] == 0).all())
    assert torch.equal(E8M0.decode(q.scale_codes()), q.scale)


@pytest.mark.parametrize("spec,emax", [(MXFP4, 2), (MXFP8, 8)], ids=["mxfp4", "mxfp8"])
def test_mx_scale_codes_on_every_binade(spec, emax):
    """The MX scale codes read from the amax bits equal 2^(floor(log2 amax) - emax) clamped to
    2^-127..2^127 (frexp in float64, one amax at a time) for zero, the smallest and largest
    subnormals, every power of two and the float32 values on either side of it, and max finite."""
    from lowbit.quant.scale_rules import mx_scale_codes

    vals = [0.0, 2.0**-149, 2.0**-126 - 2.0**-149, float(torch.finfo(torch.float32).max)]
    for k in range(-126, 128):
        p = torch.tensor(2.0**k, dtype=torch.float32)
        vals += [float(torch.nextafter(p, torch.tensor(0.0))), float(p), float(torch.nextafter(p, torch.tensor(math.inf)))]
    a = torch.tensor(vals, dtype=torch.float32)
    got = mx_scale_codes(a, spec)
    want = [0 if v == 0 else max(-127, min(127, math.frexp(v)[1] - 1 - emax)) + 127 for v in a.tolist()]
    assert got.dtype == torch.uint8 and got.tolist() == want


# ---------------------------------------------------------------------------- INT asymmetric
def test_int_asymmetric_manual_and_zero_point():
    x = randn(16, 80, seed=10) + 0.5
    x[3] = x[3].abs() + 0.1  # all positive: zp = qmin
    x[5] = -x[5].abs() - 0.1  # all negative: zp = qmax
    x[7, ::3] = 0.0
    q = quantize(x, INT8_ASYM)
    lo = torch.clamp(x.amin(1, keepdim=True), max=0.0)
    hi = torch.clamp(x.amax(1, keepdim=True), min=0.0)
    s = (hi - lo) / 255.0
    zp = torch.clamp(torch.round(-128 - lo / s), -128, 127)
    assert torch.equal(q.scale, s)
    assert q.zero_point.dtype == torch.int8 and torch.equal(q.zero_point.float(), zp)
    assert int(q.zero_point[3]) == -128 and int(q.zero_point[5]) == 127
    manual = torch.clamp(torch.round(x / s) + zp, -128, 127)
    assert torch.equal(INT8.codes_to_int(q.codes).float(), manual)
    dq = dequantize(q)
    assert torch.equal(dq, (manual - zp) * s)
    # zero is exactly representable
    assert bool((dq[7, ::3] == 0).all())
    assert torch.equal(dequantize(quantize(torch.zeros(2, 8), INT8_ASYM)), torch.zeros(2, 8))
    assert bool(((dq - x).abs() <= s * (0.5 + 1e-4)).all())


def test_int_asymmetric_rounds_before_adding_zero_point():
    # scale = 255/255 = 1 and zp = -28; 1.4999999 must give round(1.4999999) - 28 = -27. Adding
    # the zero point before rounding would give round(-26.5) = -26 (float32 rounds the sum).
    just_below = float(torch.tensor(1.5).nextafter(torch.tensor(0.0)))
    x = torch.tensor([[-100.0, 155.0, just_below, 2.5, -0.5]])
    q = quantize(x, INT8_ASYM)
    assert float(q.scale) == 1.0 and int(q.zero_point) == -28
    assert INT8.codes_to_int(q.codes).tolist() == [[-128, 127, -27, -26, -28]]


# ---------------------------------------------------------------------------- zeros, errors
ALL_SPECS = {
    "int8-tensor": QuantSpec(F.INT8, G.TENSOR), "int8-channel": INT8_CH, "int4-g128": INT4_G128,
    "int8-asym": INT8_ASYM, "int4-g32-asym": QuantSpec(F.INT4, G.GROUP, 32, symmetric=False),
    "fp8-channel": FP8_CH, "fp8-token": PRESETS["w8a8-fp8-dynamic"].input_activations,
    "nvfp4": NVFP4, "nvfp4-act": NVFP4_ACT, "e5m3": E5M3, "mxfp4": MXFP4, "mxfp8": MXFP8,
    "e5m2-g32": QuantSpec(F.E5M2, G.GROUP, 32),
}


@pytest.mark.parametrize("name", list(ALL_SPECS))
def test_all_zero_blocks_decode_to_exact_zeros(name):
    spec = ALL_SPECS[name]
    x = randn(4, 128, seed=11)
    x[1] = 0.0
    x[2, 32:64] = 0.0
    for t in (x, torch.zeros(4, 128)):
        q = quantize(t, spec)
        assert bool(torch.isfinite(q.scale).all())
        dq = dequantize(q)
        assert bool(torch.isfinite(dq).all())
        assert bool((dq[1] == 0).all())
        if spec.granularity is G.GROUP:
            assert bool((dq[2, 32:64] == 0).all())
        assert not bool(torch.signbit(dq[t == 0]).any())  # +0.0, never -0.0 or NaN
    assert torch.equal(dequantize(quantize(torch.zeros(4, 128), spec)), torch.zeros(4, 128))


@pytest.mark.parametrize("spec,n", [(NVFP4, 40), (E5M3, 24), (MXFP4, 48), (MXFP8, 16)], ids=["nvfp4", "e5m3", "mxfp4", "mxfp8"])
def test_non_multiple_of_block_refused(spec, n):
    name = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(QuantizationError) as exc:
        quantize(torch.randn(4, n), spec, name=name)
    msg = str(exc.value)
    assert name in msg and "(4, " + str(n) + ")" in msg and str(spec.group_size) in msg
    assert not allows_ragged(spec)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("spec", [INT8_CH, NVFP4, E5M3, MXFP4, INT4_G128], ids=["int8", "nvfp4", "e5m3", "mxfp4", "int4"])
def test_nan_inf_refused_with_tensor_name(spec, bad):
    x = torch.randn(4, 64)
    x[2, 5] = bad
    with pytest.raises(QuantizationError) as exc:
        quantize(x, spec, name="model.layers.3.self_attn.q_proj.weight")
    assert "model.layers.3.self_attn.q_proj.weight" in str(exc.value)
    assert "(4, 64)" in str(exc.value)
    with pytest.raises(QuantizationError, match="act_in"):
        check_finite(x, "act_in")
    check_finite(torch.ones(3), "fine")


# ---------------------------------------------------------------------------- idempotence
@pytest.mark.parametrize("spec", [INT8_CH, INT4_CH, FP8_CH, E5M3, INT4_G128, MXFP4, MXFP8],
                         ids=["int8-ch", "int4-ch", "fp8-ch", "e5m3", "int4-g128", "mxfp4", "mxfp8"])
def test_quantize_dequantize_is_idempotent(spec):
    x = randn(128, 256, seed=12)
    q = quantize(x, spec)
    q2 = quantize(dequantize(q), spec)
    assert q2.equal(q)
    assert torch.equal(dequantize(q2), dequantize(q))


def test_asymmetric_requantize_keeps_codes():
    x = randn(64, 128, seed=13) + 0.3
    q = quantize(x, INT8_ASYM)
    q2 = quantize(dequantize(q), INT8_ASYM)
    assert torch.equal(q2.codes, q.codes) and torch.equal(q2.zero_point, q.zero_point)
    assert torch.allclose(q2.scale, q.scale, rtol=1e-5, atol=0)


# ---------------------------------------------------------------------------- helpers & QuantizedTensor
def test_amax_and_num_groups():
    x = randn(3, 64, seed=14)
    assert torch.equal(amax(x, NVFP4), x.reshape(3, 4, 16).abs().amax(-1))
    assert torch.equal(amax(x, INT8_CH), x.abs().amax(-1, keepdim=True))
    assert torch.equal(amax(x, QuantSpec(F.INT8, G.TENSOR)), x.abs().max().reshape(1))
    assert num_groups(64, NVFP4) == 4 and num_groups(64, INT8_CH) == 1 and num_groups(130, INT4_G128) == 2
    with pytest.raises(QuantizationError, match="w.q"):
        num_groups(65, MXFP4, "w.q", (2, 65))


def test_bfloat16_input_and_output_dtype():
    x = randn(4, 64, seed=15).to(torch.bfloat16)
    q = quantize(x, NVFP4)
    assert q.equal(quantize(x.float(), NVFP4))
    assert dequantize(q, torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(dequantize(q, torch.bfloat16), dequantize(q).to(torch.bfloat16))


def test_quantized_tensor_api():
    x = randn(4, 64, seed=16)
    q = quantize(x, E5M3)
    assert q.shape == (4, 64)
    assert torch.equal(q.values(), E2M1.decode(q.codes))
    assert q.equal(q.to("cpu")) and q.equal(quantize(x, E5M3))
    other = QuantizedTensor(q.codes.clone(), q.scale * 2, q.spec)
    assert not q.equal(other)
    assert not q.equal(quantize(x, NVFP4))
    with pytest.raises(ValueError):
        quantize(x, INT8_CH).scale_codes()
