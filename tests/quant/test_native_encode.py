"""The native (C) path of quantize equals the torch path bit for bit: codes, scales, global scale,
errors; for every scheme model-free quantization supports (those routed to torch included), on
adversarial inputs (ties at every code boundary, binade edges, subnormal and underflowing block
scales, max finite, +-0, all-zero groups and rows, ragged groups, NaN/Inf), from bfloat16,
float16 and float32. Build, cache and fallback: tests/kernels/test_native_build.py."""

from __future__ import annotations

import pytest
import torch

from lowbit.errors import QuantizationError
from lowbit.formats import get_layout
from lowbit.modelfree.worker import quantize_rows
from lowbit.kernels import Implementation, native, using
from lowbit.kernels import codes as kcodes
from lowbit.kernels.native import build
from lowbit.kernels.native.constants import STEPS
from lowbit.numerics import E2M1, E4M3, E5M2, E8M0, INT2, INT4, INT8, UE4M3, UE5M3
from lowbit.numerics import FormatName as F
from lowbit.quant import PackedQuantizedTensor, QuantizedTensor, native_quant, nibbles, pack_nibbles, quantize
from lowbit.schemes import Granularity as G, WeightObserver, QuantSpec, get_scheme

pytestmark = pytest.mark.skipif(build.library() is None,
                                reason=f"native kernels unavailable: {build.unavailable_reason()}")

SCHEMES = ["w4a16", "w8a16", "nvfp4a16", "w8a8-int8-dynamic", "w8a8-fp8-dynamic", "nvfp4-e5m3", "mxfp4", "mxfp8"]
NATIVE = {"w4a16", "w8a16", "w8a8-int8-dynamic", "w8a8-fp8-dynamic", "nvfp4-e5m3", "mxfp4", "mxfp8"}
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def torch_path():
    return using(Implementation.TORCH)


def both(x, spec, **kw):
    """(native result, torch result) of quantize; an exception counts as its type and message."""
    def run():
        try:
            return quantize(x, spec, **kw)
        except Exception as e:  # noqa: BLE001 - compared between the two paths
            return f"{type(e).__name__}: {e}"
    a = run()
    with torch_path():
        b = run()
    return a, b


def assert_same(x, spec, **kw):
    a, b = both(x, spec, **kw)
    if isinstance(a, str) or isinstance(b, str):
        assert a == b
        return a
    assert a.equal(b), (spec.describe(), x.dtype, tuple(x.shape))
    return a


# ----------------------------------------------------------------------------- inputs
def neighbours(t: torch.Tensor) -> torch.Tensor:
    """t and the next representable values below and above (in t's dtype, by their bits)."""
    b = t.view(INT_VIEW[t.dtype])
    n = torch.cat([t, (b + 1).view(t.dtype), (b - 1).view(t.dtype)])
    return n[torch.isfinite(n.float())]  # the bits below +0.0 are a NaN


def boundary_points(spec) -> tuple[float, torch.Tensor]:
    """(anchor, points): a group whose extreme is ``anchor * 2^k`` gets the scale 2^k exactly
    under ``spec``'s rule, so ``points * 2^k`` divide to every grid value and every midpoint
    between neighbours (the ties), both signs."""
    fmt = spec.format
    if spec.is_integer:
        q = INT4 if fmt is F.INT4 else INT8
        vals = torch.arange(q.qmin - 1, q.qmax + 2, dtype=torch.float32)
        anchor = {WeightObserver.FULL_RANGE: float(q.qmin), WeightObserver.HALF_STEP: q.qmax + 0.5}.get(
            spec.observer, float(q.qmax))
        return anchor, torch.cat([vals, vals + 0.5])
    e = E2M1 if fmt is F.E2M1 else E4M3
    v = e.values()
    pts = torch.cat([v, (v[1:] + v[:-1]) / 2, torch.tensor([e.max_finite * 1.5])])
    return e.max_finite, torch.cat([pts, -pts])


def tie_weight(spec, dtype, ks=(-20, -9, -3, 0, 2, 5)) -> torch.Tensor:
    """Rows of groups [anchor, points...] * 2^k (and the points' neighbours in ``dtype``)."""
    anchor, pts = boundary_points(spec)
    g = spec.group_size or 256
    rows = []
    for k in ks:
        p = neighbours((pts * 2.0**k).to(dtype)).to(torch.float32)
        per = g - 1
        n_groups = -(-p.numel() // per)
        row = torch.zeros(n_groups, g)
        row[:, 0] = anchor * 2.0**k
        flat = torch.zeros(n_groups * per)
        flat[:p.numel()] = p
        row[:, 1:] = flat.reshape(n_groups, per)
        rows.append(row.reshape(-1))
    width = max(r.numel() for r in rows)
    w = torch.stack([torch.nn.functional.pad(r, (0, width - r.numel())) for r in rows])
    w = w.to(dtype)
    return w[:, :width - width % (spec.group_size or 1)] if spec.group_size else w


def adversarial_weight(dtype, cols=256, seed=3) -> torch.Tensor:
    """Random rows and rows of special values, clamped to ``dtype``'s finite range."""
    gen = torch.Generator().manual_seed(seed)
    fi = torch.finfo(dtype)
    w = torch.randn(24, max(cols, 64), generator=gen)
    w[0] = 0.0                                             # all-zero row
    w[1, :16] = 0.0                                        # an all-zero group
    w[2] = torch.randn(w.shape[1], generator=gen) * 1e-30  # block scales that underflow
    w[3, :32] = torch.tensor([6.0, -6.0, 3.0, 0.5] * 8)    # the extreme is a grid point
    w[4] = w[4] * 1e4
    w[5, ::2] = -0.0
    w[6, :16] = torch.tensor([2.0**-149, -(2.0**-149)] * 8)  # float32 subnormals
    w[7, :8] = torch.tensor([fi.max, -fi.max, fi.tiny, -fi.tiny] * 2)  # the source's max finite, min normal
    w[8] = fi.tiny * torch.randn(w.shape[1], generator=gen) / 4  # the source's subnormals
    w[9, :64] = 2.0 ** torch.arange(-32, 32, dtype=torch.float32)  # binade edges
    w[10, :64] = torch.nextafter(w[9, :64], torch.zeros(64))
    w[11] = -w[11].abs()                                   # negative extremes (full-range: positive scales)
    w[12, 0] = -w[12].abs().max()                          # a +a / -a tie of the signed extremes
    w[12, 1] = -w[12, 0]
    w[13, 2:] = w[13, 2:] * 1e-3                           # the extreme alone at the front
    return w[:, :cols].clamp(-fi.max, fi.max).to(dtype)


# ----------------------------------------------------------------------------- quantize
@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_native_equals_torch_on_ties_and_adversarial_values(name, dtype):
    spec = get_scheme(name).weights
    assert native_quant.supports(torch.zeros(2, 32, dtype=dtype), spec) == (name in NATIVE)
    for w in (tie_weight(spec, dtype), adversarial_weight(dtype)):
        assert torch.isfinite(w.float()).all()
        qt = assert_same(w, spec)
        assert not isinstance(qt, str)
        if name in NATIVE:
            assert native_quant.quantize_native(w, spec) is not None  # the native path ran


def test_ties_round_to_even_on_the_native_path():
    spec = get_scheme("nvfp4-e5m3").weights
    # scale 1: 6 is the extreme; 0.25 -> 0, 0.75 -> 1.0 (code 2), 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5 -> 4.0
    x = torch.tensor([[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0, 0.0, -0.0, 0.0, 0.0, 0.0]])
    qt = native_quant.quantize_native(x.to(torch.bfloat16), spec)
    assert qt.codes.tolist() == [[7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 14, 0, 8, 0, 0, 0]]
    assert qt.scale.tolist() == [[1.0]]
    w4 = get_scheme("w4a16").weights                          # full range: scale = -8 / -8 = 1
    y = torch.tensor([[-8.0, 0.5, 1.5, 2.5, -0.5, -1.5, 7.5, -7.5] + [0.0] * 120])
    qt = native_quant.quantize_native(y, w4)
    assert qt.codes[0, :8].tolist() == [c & 0xF for c in [-8, 0, 2, 2, 0, -2, 7, -8]]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", [
    QuantSpec(F.INT4, G.GROUP, 128, observer=WeightObserver.FULL_RANGE),   # w4a16, ragged last group
    QuantSpec(F.INT8, G.GROUP, 128),
    QuantSpec(F.E4M3, G.GROUP, 100),
    QuantSpec(F.INT8, G.CHANNEL),
    QuantSpec(F.INT4, G.CHANNEL, observer=WeightObserver.FULL_RANGE),
    QuantSpec(F.INT4, G.GROUP, 128, observer=WeightObserver.HALF_STEP),
], ids=lambda s: s.describe())
def test_ragged_groups_match_zero_padding(dtype, spec):
    for cols in (576, 200, 33, 1):
        w = adversarial_weight(dtype, cols=cols, seed=cols)
        qt = assert_same(w, spec)
        assert qt.scale.shape == (24, -(-cols // (spec.group_size or cols)))


def test_ragged_microscaled_is_the_same_error():
    w = torch.randn(4, 48)
    msg = assert_same(w, get_scheme("mxfp4").weights)
    assert msg.startswith("QuantizationError") and "'tensor'" in msg and "multiple of the block size 32" in msg


@pytest.mark.parametrize("spec", [
    get_scheme("w8a8-int8-dynamic").input_activations,     # per token on [batch, seq, in]
    get_scheme("w8a8-fp8-dynamic").input_activations,
    get_scheme("nvfp4-e5m3").input_activations,
    get_scheme("mxfp8").input_activations,
    QuantSpec(F.E4M3, G.TENSOR),
    QuantSpec(F.INT8, G.TENSOR),
    QuantSpec(F.E5M2, G.CHANNEL),
    QuantSpec(F.INT2, G.GROUP, 8, observer=WeightObserver.FULL_RANGE),
    QuantSpec(F.INT4, G.TENSOR, observer=WeightObserver.FULL_RANGE),
    QuantSpec(F.INT8, G.TENSOR, observer=WeightObserver.HALF_STEP),
], ids=lambda s: s.describe())
def test_other_granularities_and_leading_dims(spec):
    for dtype in DTYPES:
        x = adversarial_weight(dtype, cols=64).reshape(2, 12, 64)
        assert_same(x, spec)
        assert_same(x[0, 0], spec)  # 1-D


def test_global_scale_given_and_computed():
    spec = QuantSpec(F.E2M1, G.GROUP, 16, scale_format=F.UE4M3, global_scale=True)  # nvfp4, max observer
    for dtype in DTYPES:
        w = adversarial_weight(dtype)
        qt = assert_same(w, spec)
        assert qt.global_scale is not None and qt.global_scale.shape == (1,)
        assert_same(w, spec, global_scale=torch.tensor([3.0e3]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["nvfp4-e5m3", "w4a16", "w8a8-int8-dynamic", "mxfp8"])
def test_nan_inf_same_error_naming_the_tensor(dtype, name):
    spec = get_scheme(name).weights
    for bad in (float("nan"), float("inf"), -float("inf")):
        for pos in ((0, 0), (5, 100), (23, 255)):
            w = adversarial_weight(dtype)
            w[pos] = bad
            a, b = both(w, spec, name="model.layers.0.mlp.up_proj.weight")
            assert a == b and a.startswith("QuantizationError") and "'model.layers.0.mlp.up_proj.weight'" in a
            assert "1 NaN/Inf values" in a
            with pytest.raises(QuantizationError, match="up_proj"):
                native_quant.quantize_native(w, spec, name="up_proj")


# ----------------------------------------------------------------------------- kernels
def every_key_value() -> torch.Tensor:
    hi = torch.arange(1 << 16, dtype=torch.int64) << 16
    low = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF])
    return ((hi[:, None] + low[None, :]).reshape(-1) & 0xFFFFFFFF).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("fmt", [E2M1, E4M3, E5M2, UE4M3, UE5M3, E8M0, INT2, INT4, INT8], ids=lambda f: f.name)
def test_kernel_encode_equals_reference_on_every_key(fmt):
    x = every_key_value()
    x = x[~torch.isnan(x)]
    if fmt in (UE4M3, UE5M3, E8M0):  # unsigned
        x = x[~(x < 0)]
    got = native.encode_format(fmt, x)
    assert got is not None and torch.equal(got, fmt.encode(x))
    if fmt.bits == 4:
        xs = x[: x.numel() // 2 * 2].reshape(1, -1).contiguous()
        packed = native.encode(xs, 0, None, fmt, pack=True)
        with torch_path():
            assert torch.equal(packed, pack_nibbles(fmt.encode(xs)))


def test_kernel_refuses_what_the_reference_refuses():
    nan = torch.tensor([1.0, float("nan")])
    assert native.encode_format(E2M1, nan) is None and native.encode_format(INT4, nan) is None
    assert native.encode_format(UE5M3, torch.tensor([1.0, -2.0])) is None
    assert native.encode_format(UE5M3, torch.tensor([1.0, -0.0])).tolist() == [UE5M3.encode(torch.tensor(1.0)).item(), 0]
    with pytest.raises(ValueError, match="e2m1 has no NaN"):
        kcodes.encode(E2M1, nan)
    with pytest.raises(ValueError, match="unsigned"):
        kcodes.encode(E8M0, torch.tensor([-1.0]))
    assert kcodes.encode(E4M3, torch.tensor([float("nan"), -float("nan")])).tolist() == [0x7F, 0x7F]


@pytest.mark.parametrize("fmt", [UE4M3, UE5M3, E4M3, E2M1], ids=lambda f: f.name)
def test_fast_qdq_equals_qdq(fmt):
    x = every_key_value()
    x = x[~torch.isnan(x)] if fmt.nan_code is None else x
    x = x if fmt.signed else x[~(x < 0)]
    a, b = kcodes.qdq(fmt, x), fmt.qdq(x)
    assert torch.equal(a.view(torch.int32)[~torch.isnan(b)], b.view(torch.int32)[~torch.isnan(b)])
    assert torch.equal(torch.isnan(a), torch.isnan(b))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_group_extremes(dtype):
    w = adversarial_weight(dtype, cols=200)
    amax, bad = native.group_amax(w.contiguous(), 64)
    ref = torch.nn.functional.pad(w.float(), (0, 56)).reshape(24, 4, 64)
    assert not bad and torch.equal(amax, ref.abs().amax(-1))
    lo, hi, bad = native.group_minmax(w.contiguous(), 64)
    assert not bad and torch.equal(lo, ref.amin(-1)) and torch.equal(hi, ref.amax(-1))
    w[3, 7] = float("inf")
    assert native.group_amax(w.contiguous(), 64)[1] and native.group_minmax(w.contiguous(), 64)[2]


def test_pack_nibbles_native_equals_torch_and_refuses_wide_codes():
    codes = torch.randint(0, 16, (7, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    a = pack_nibbles(codes)
    with torch_path():
        assert torch.equal(a, pack_nibbles(codes))
    codes[3, 5] = 16
    with pytest.raises(QuantizationError, match="'w'.*above 15"):
        pack_nibbles(codes, "w")


# ----------------------------------------------------------------------------- model-free
@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("fmt", ["lowbit", "compressed-tensors"])
def test_model_free_bands_and_layout_equal_the_torch_path(name, fmt):
    scheme = get_scheme(name)
    spec = scheme.weights
    layout = get_layout(fmt)
    try:
        layout.check_scheme(scheme)
    except Exception:  # noqa: BLE001 - a scheme this format does not hold
        pytest.skip(f"{fmt} does not hold {name}")
    w = adversarial_weight(torch.bfloat16, cols=256).repeat(5, 1)  # 120 rows: bands of 16 rows
    gs = None
    if spec.global_scale:
        from lowbit.quant import global_scale_from_amax
        gs = global_scale_from_amax(w.float().abs().amax(), spec)
    pack = layout.nibble_packed(scheme, w.shape[-1])
    assert pack == (spec.bits == 4 and (fmt == "lowbit" or not spec.is_integer))
    qa = quantize_rows(w, spec, gs, "w", band_elems=16 * 256, pack=pack)
    assert isinstance(qa, PackedQuantizedTensor) == (pack and name in NATIVE)
    a = layout.linear_tensors("p", qa, scheme, dtype=w.dtype)
    with torch_path():
        qb = quantize_rows(w, spec, gs, "w", band_elems=16 * 256, pack=pack)
        assert type(qb) is QuantizedTensor
        b = layout.linear_tensors("p", qb, scheme, dtype=w.dtype)
        c = layout.linear_tensors("p", quantize(w, spec, global_scale=gs), scheme, dtype=w.dtype)
    assert qa.equal(qb) and qa.shape == qb.shape == w.shape
    assert a.keys() == b.keys() == c.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]), k


def test_packed_quantized_tensor_reads_as_its_codes():
    spec = get_scheme("nvfp4-e5m3").weights
    w = adversarial_weight(torch.float32, cols=64)
    packed = native_quant.quantize_native(w, spec, pack=True)
    plain = native_quant.quantize_native(w, spec)
    assert isinstance(packed, PackedQuantizedTensor) and packed.packed.shape == (24, 32)
    assert packed.shape == (24, 64) and torch.equal(packed.codes, plain.codes) and packed.equal(plain)
    assert torch.equal(nibbles(packed), packed.packed) and torch.equal(nibbles(plain), packed.packed)
    assert torch.equal(packed.to("cpu").codes, plain.codes)


# ----------------------------------------------------------------------------- steps (E2M1)
def test_steps_are_derived_for_e2m1_only():
    st = native.steps(E2M1)
    assert st is not None and st.dtype == torch.uint16 and st.numel() == STEPS + 1
    assert int(st[-1]) == int(E2M1.encode(torch.tensor([-0.0]))[0])  # the sign's code bits
    for fmt in (E4M3, E5M2, UE4M3, UE5M3, INT4, E8M0):  # more than 8 magnitude codes, or no table
        assert native.steps(fmt) is None


@pytest.mark.parametrize("simd", [1, 0], ids=["simd", "scalar"])
@pytest.mark.parametrize("pack", [0, 1], ids=["codes", "packed"])
def test_step_codes_equal_the_table_on_every_key(simd, pack):
    table = E2M1.key_table
    keys = torch.arange(1 << 16, dtype=torch.int32)
    keys = keys[(keys & 0x7FFF) <= 0x7F80]  # NaN keys are refused before any lookup
    keys = keys[: keys.numel() // 32 * 32 + 6]  # a tail the vector loop leaves to the scalar one
    k16 = keys.to(torch.uint16).contiguous()
    out = torch.empty(keys.numel() // 2 if pack else keys.numel(), dtype=torch.uint8)
    build.library().lb_step_codes(native.steps(E2M1).data_ptr(), k16.data_ptr(), keys.numel(),
                                  pack, simd, out.data_ptr())
    want = table[keys.long()]
    assert torch.equal(out, pack_nibbles(want) if pack else want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("g", [16, 32, 64])
@pytest.mark.parametrize("pack", [False, True])
def test_e2m1_fused_encode_equals_reference(dtype, g, pack):
    """The one-loop E2M1 encode (groups and rows a multiple of 16): x / eff through the reference
    encoder, on every key value of ``dtype`` divided by awkward scales, zero-scale groups giving 0."""
    gen = torch.Generator().manual_seed(5)
    x = every_key_value().to(dtype)
    x = x[torch.isfinite(x.float())]
    x = torch.cat([x, torch.randn(4096, generator=gen).to(dtype)])
    cols = 128
    x = x[: x.numel() // cols * cols].reshape(-1, cols).contiguous()
    eff = torch.tensor([1.0, 0.375, 3.0e-3, 2.0**-130, 6.0, 1.5e30,  # and powers of two (multiplied by
                        2.0**-126, 2.0**126, 2.0**127, 2.0**-127, 0.5, 2.0**-20],  # their reciprocal where normal)
                       dtype=torch.float32)
    eff = eff[torch.randint(0, eff.numel(), (x.shape[0], cols // g), generator=gen)]
    eff[::7, 0] = 0.0
    zero = (eff == 0).repeat_interleave(g, dim=1)
    want = E2M1.encode(x.float() / torch.where(eff == 0, 1.0, eff).repeat_interleave(g, dim=1))
    want[zero] = 0
    got = native.encode(x, g, eff.contiguous(), E2M1, pack=pack)
    assert got is not None and torch.equal(got, pack_nibbles(want) if pack else want)
    x[3, 5] = float("nan")
    assert native.encode(x, g, eff.contiguous(), E2M1, pack=pack) is None  # the reference's error decides


@pytest.mark.parametrize("fmt", [E2M1, E4M3, E5M2, UE4M3, UE5M3, E8M0], ids=lambda f: f.name)
def test_native_decode_equals_decode_on_every_code(fmt):
    c = torch.arange(256, dtype=torch.uint8).repeat(3).reshape(3, 256)
    got, want = kcodes.decode(fmt, c), fmt.decode(c)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32)[~want.isnan()], want.view(torch.int32)[~want.isnan()])
    assert torch.equal(got.isnan(), want.isnan())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("g", [16, 32, 48, 576])
def test_vector_group_amax_equals_torch(dtype, g):
    """Groups of a multiple of 16 (the vector loop): every finite value of ``dtype`` at random
    places, the ragged last group, the NaN/Inf flag."""
    gen = torch.Generator().manual_seed(11)
    x = every_key_value().to(dtype)
    x = x[torch.isfinite(x.float())]
    x = x[torch.randperm(x.numel(), generator=gen)][: 40 * 576].reshape(40, 576).contiguous()
    x[5, :48] = 0.0
    x[6, :] = -0.0
    G = -(-576 // g)
    amax, bad = native.group_amax(x, g)
    ref = torch.nn.functional.pad(x.float().abs(), (0, G * g - 576)).reshape(40, G, g).amax(-1)
    assert not bad and torch.equal(amax, ref)
    for special in (float("inf"), float("nan")):
        y = x.clone()
        y[39, 575] = special
        assert native.group_amax(y, g)[1]


@pytest.mark.parametrize("name", ["nvfp4-e5m3", "mxfp4", "mxfp8", "w8a8-fp8-dynamic"])
def test_scale_codes_found_on_the_way_equal_encoding_the_scales(name):
    spec = get_scheme(name).weights
    w = adversarial_weight(torch.bfloat16, cols=256)
    gs = quantize(w, spec).global_scale if spec.global_scale else None
    qt = native_quant.quantize_native(w, spec, gs)
    assert qt is not None
    if spec.scale_format is F.FP32:
        assert qt.known_scale_codes is None
        return
    from lowbit.numerics import get_format
    assert torch.equal(qt.known_scale_codes, get_format(spec.scale_format).encode(qt.scale))
    assert qt.scale_codes() is qt.known_scale_codes


def test_global_scale_on_ties_of_the_scale_and_of_the_elements():
    """NVFP4 with a given global scale gs: block amaxes whose raw scale amax / 6 * gs lands on
    every midpoint of the scale format (gs = 1, 2: exact), and blocks whose scale is exactly v
    (gs = 3) holding +-0.25 * fl(v / gs): an element tie exactly when eff = v / gs is divided as
    the torch path divides it (not multiplied by a reciprocal)."""
    spec = QuantSpec(F.E2M1, G.GROUP, 16, scale_format=F.UE4M3, global_scale=True)
    v = UE4M3.values()
    v = v[torch.isfinite(v) & (v > 0)]
    mids = (v[1:] + v[:-1]) / 2
    for gs in (1.0, 2.0):
        w = torch.zeros(mids.numel(), 16)
        w[:, 0] = mids * 6 / gs
        w[:, 1] = -mids * 3 / gs
        assert_same(w, spec, global_scale=torch.tensor([gs]))
    gs = torch.tensor([3.0])
    eff = v / gs
    w = torch.zeros(v.numel(), 16)
    w[:, 0] = 2 * v  # raw scale = 2v / 6 * 3 = v exactly
    w[:, 1], w[:, 2], w[:, 3] = 0.25 * eff, -0.25 * eff, 0.75 * eff
    ties = (w[:, 1] / eff == 0.25).sum()
    assert ties == v.numel()
    assert_same(w, spec, global_scale=gs)


@pytest.mark.parametrize("name", sorted(NATIVE))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bands_longer_than_one_row_block(name, dtype):
    """lb_quantize works through ~16 KB of rows at a time: a band of several blocks and a short
    last one equals the torch path, and a NaN in a later block is still the reference's error."""
    spec = get_scheme(name).weights
    gen = torch.Generator().manual_seed(7)
    w = (torch.randn(301, 96, generator=gen) * torch.logspace(-3, 3, 301)[:, None]).to(dtype)
    w[150:160] = adversarial_weight(dtype, cols=96)[:10]
    assert_same(w, spec)
    w[290, 5] = float("nan")
    a, b = both(w, spec)
    assert isinstance(a, str) and a == b and "QuantizationError" in a


@pytest.mark.parametrize("name", ["nvfp4-e5m3", "mxfp4", "w8a8-fp8-dynamic"])
def test_rows_of_more_scale_groups_than_one_key_chunk(name):
    """Rows of 5000+ groups (the scale keys are looked up 4096 at a time)."""
    gen = torch.Generator().manual_seed(9)
    w = (torch.randn(3, 16 * 5003, generator=gen) * torch.logspace(-4, 4, 16 * 5003)).to(torch.bfloat16)
    assert_same(w, get_scheme(name).weights)


@pytest.mark.parametrize("fmt,pack", [(INT2, False), (INT4, False), (INT4, True), (INT8, False)],
                         ids=["int2", "int4", "int4-packed", "int8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int_vector_encode_equals_reference_beyond_the_bounds(fmt, pack, dtype):
    """The INT encode of the kernels: every finite value of ``dtype`` divided by awkward scales, far
    beyond both bounds (the clamps), and halves at every code (ties to even)."""
    gen = torch.Generator().manual_seed(6)
    x = every_key_value().to(dtype)
    x = x[torch.isfinite(x.float())]
    halves = torch.arange(fmt.qmin - 3, fmt.qmax + 3, 0.5)
    x = torch.cat([x, halves.to(dtype), torch.randn(4096, generator=gen).to(dtype)])
    cols, g = 128, 32
    x = x[: x.numel() // cols * cols].reshape(-1, cols).contiguous()
    for eff in (None, torch.tensor([1.0, 0.375, 3.0e-3, 6.0, 2.0**-20, 1.5e30])[
            torch.randint(0, 6, (x.shape[0], cols // g), generator=gen)].contiguous()):
        q = x.float() if eff is None else x.float() / eff.repeat_interleave(g, dim=1)
        want = fmt.encode(q)
        got = native.encode(x, g, eff, fmt, pack=pack)
        assert got is not None and torch.equal(got, pack_nibbles(want) if pack else want)
