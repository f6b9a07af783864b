"""The torch encoders (lowbit.kernels.torch_ops) equal the reference encoders bit for bit, and
quantize (which uses them) equals the reference pipeline, on adversarial values."""

import pytest
import torch

from lowbit.errors import QuantizationError
from types import SimpleNamespace

from lowbit.kernels import Implementation, codes, torch_ops, using
from lowbit.numerics import E2M1, E4M3, E5M2, E8M0, INT2, INT4, INT8, UE4M3, UE5M3
from lowbit.quant import check_finite, quantize
from lowbit.quant.qdq import _prepare, ungroup
from lowbit.numerics import FormatName
from lowbit.schemes import Granularity, QuantSpec, get_scheme

def _torch_encode(fmt, x):
    with using(Implementation.TORCH):  # the key tables and INT rounding, through the entry point
        return codes.encode(fmt, x)


fast_encode = SimpleNamespace(encode=_torch_encode, has_table=torch_ops.has_table)
MINIFLOATS = [E2M1, E4M3, E5M2, UE4M3, UE5M3]
# dropped-bit patterns around every 16-bit key: exact, just above, just below half, half, above half, top
LOW_BITS = [0, 1, 2, 0x7FFF, 0x8000, 0x8001, 0xFFFE, 0xFFFF]


def every_key_value() -> torch.Tensor:
    """Every float32 whose upper 16 bits take all 65536 values, with LOW_BITS below: all ties,
    binade edges, subnormals (float32's and the formats'), max finite, +-0, +-Inf, NaNs."""
    hi = torch.arange(1 << 16, dtype=torch.int64) << 16
    bits = (hi[:, None] + torch.tensor(LOW_BITS)[None, :]).reshape(-1)
    return (bits & 0xFFFFFFFF).to(torch.int32).view(torch.float32)


def grid_and_midpoints(fmt) -> torch.Tensor:
    """The format's values, the midpoints between them (ties) and their float32 neighbours."""
    v = fmt.values()
    mids = (v[1:] + v[:-1]) / 2
    pts = torch.cat([v, mids, torch.tensor([fmt.max_finite * 1.0625, fmt.max_finite * 2, 1e30])])
    near = torch.cat([pts, torch.nextafter(pts, torch.full_like(pts, float("inf"))),
                      torch.nextafter(pts, torch.zeros_like(pts))])
    return torch.cat([near, -near]) if fmt.signed else near


def encodable(fmt, x: torch.Tensor) -> torch.Tensor:
    if fmt.nan_code is None:
        x = x[~torch.isnan(x)]
    if not fmt.signed:
        x = x[~(x < 0)]
    return x


@pytest.mark.parametrize("fmt", MINIFLOATS, ids=lambda f: f.name)
def test_minifloat_table_equals_reference_on_every_key(fmt):
    assert fast_encode.has_table(fmt)
    x = encodable(fmt, every_key_value())
    assert torch.equal(fast_encode.encode(fmt, x), fmt.encode(x))
    g = encodable(fmt, grid_and_midpoints(fmt))
    assert torch.equal(fast_encode.encode(fmt, g), fmt.encode(g))
    y = encodable(fmt, torch.randn(4096, 33, generator=torch.Generator().manual_seed(1)) * fmt.max_finite / 3)
    assert torch.equal(fast_encode.encode(fmt, y), fmt.encode(y))


@pytest.mark.parametrize("fmt", MINIFLOATS, ids=lambda f: f.name)
def test_minifloat_table_keeps_shape_and_accepts_strided_input(fmt):
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(2)).abs().t()  # not contiguous
    got = fast_encode.encode(fmt, x)
    assert got.shape == (6, 8) and got.dtype == torch.uint8
    assert torch.equal(got, fmt.encode(x))
    assert fast_encode.encode(fmt, torch.empty(0, 4)).shape == (0, 4)


def test_signed_zero_and_saturation_codes():
    x = torch.tensor([0.0, -0.0, 6.0, 1e9, float("inf"), -float("inf"), 0.25, 0.75, 5.0, -5.0])
    assert fast_encode.encode(E2M1, x).tolist() == [0, 8, 7, 7, 7, 15, 0, 2, 6, 14]
    assert fast_encode.encode(E4M3, torch.tensor([float("nan"), -float("nan")])).tolist() == [0x7F, 0x7F]


def test_errors_as_the_reference():
    with pytest.raises(ValueError, match="e2m1 has no NaN"):
        fast_encode.encode(E2M1, torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="unsigned"):
        fast_encode.encode(UE5M3, torch.tensor([1.0, -2.0]))
    with pytest.raises(ValueError, match="int4 has no NaN"):
        fast_encode.encode(INT4, torch.tensor([1.0, float("nan")]))


@pytest.mark.parametrize("fmt", [INT2, INT4, INT8], ids=lambda f: f.name)
def test_int_equals_reference(fmt):
    x = every_key_value()
    x = x[~torch.isnan(x)]
    halves = torch.arange(-300, 301, dtype=torch.float32) / 2  # every .5 tie, both saturation edges
    for v in (x, halves, torch.tensor([-0.0, -0.4, 0.4, float("inf"), -float("inf")])):
        assert torch.equal(fast_encode.encode(fmt, v), fmt.encode(v))


def test_other_formats_use_the_reference():
    assert not fast_encode.has_table(E8M0)
    x = torch.tensor([0.0, 1.0, 3.0, 2.0**-130, 2.0**127])
    assert torch.equal(fast_encode.encode(E8M0, x), E8M0.encode(x))


def reference_quantize_codes(x, spec, global_scale=None):
    """quantize's codes as written before the fast path: reference encode, zero-scale groups by where."""
    p = _prepare(x, spec, None, global_scale, "x")
    scaled = p.v / p.divisor
    if p.zero_point is not None:
        scaled = torch.round(scaled) + p.zero_point.to(torch.float32).unsqueeze(-1)
    codes = p.fmt.encode(scaled)
    return ungroup(torch.where(p.nonzero.unsqueeze(-1), codes, torch.zeros_like(codes)), p.n), p


def adversarial_weight(dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(24, 256, generator=g)
    w[0] = 0.0                                       # all-zero row (every block zero)
    w[1, :16] = 0.0                                  # one all-zero block
    w[2] = torch.randn(256, generator=g) * 1e-30     # scales that underflow the block-scale formats
    w[3, :32] = torch.tensor([6.0, -6.0, 3.0, 0.5] * 8)  # the largest value of a block is a grid point
    w[4] = w[4] * 1e4
    w[5, ::2] = -0.0
    w[6, :16] = torch.tensor([2.0**-149, -(2.0**-149)] * 8)  # float32 subnormals
    return w.to(dtype)


SPECS = {name: get_scheme(name).weights for name in
         ["nvfp4-e5m3", "nvfp4a16", "mxfp4", "mxfp8", "w4a16", "w8a16", "w8a8-fp8-dynamic"]}
SPECS["int4-asymmetric-g32"] = QuantSpec(FormatName.INT4, Granularity.GROUP, 32, symmetric=False)
SPECS["e4m3-tensor"] = QuantSpec(FormatName.E4M3, Granularity.TENSOR)


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_equals_reference_pipeline(name, dtype):
    spec = SPECS[name]
    w = adversarial_weight(dtype)
    qt = quantize(w, spec)
    codes, p = reference_quantize_codes(w, spec)
    assert torch.equal(qt.codes, codes)
    assert torch.equal(qt.scale, p.scale)
    if name.startswith("nvfp4"):
        assert not bool(p.nonzero.all())  # zero block scales (zero blocks, underflow) are exercised


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 7, 16, 33, 4099])
def test_check_finite_finds_every_position(dtype, n):
    for pos in {0, n // 2, n - 1}:
        for bad in (float("nan"), float("inf"), -float("inf")):
            x = torch.randn(n).to(dtype)
            x[pos] = bad
            with pytest.raises(QuantizationError, match="1 NaN/Inf values"):
                check_finite(x, "w")
    check_finite(torch.randn(n).to(dtype), "w")
    check_finite(torch.empty(0, dtype=dtype), "w")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_fast_paths_equal_the_cpu_reference():
    for fmt in MINIFLOATS + [INT4, INT8]:
        x = every_key_value()
        x = encodable(fmt, x) if fmt in MINIFLOATS else x[~torch.isnan(x)]
        assert torch.equal(fast_encode.encode(fmt, x.cuda()).cpu(), fmt.encode(x)), fmt.name
    for name, spec in SPECS.items():
        for dtype in (torch.float32, torch.bfloat16):
            w = adversarial_weight(dtype)
            a, b = quantize(w, spec), quantize(w.cuda(), spec).to("cpu")
            assert a.equal(b), (name, dtype)
