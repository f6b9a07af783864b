"""Triton kernels, run on the CPU under Triton's interpreter: bit-exact with lowbit.quant.

TRITON_INTERPRET=1 is set here, before Triton and lowbit.kernels' Triton modules are imported:
Triton reads it when it decorates a function (triton.jit), i.e. at import of triton.language
and of lowbit.kernels.actquant / dequant. Where Triton was imported earlier in this process,
the module re-runs itself in a fresh one. Skipped only where Triton is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

import importlib.util  # noqa: E402

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
_IMPORTED_BEFORE = "triton" in sys.modules
os.environ["TRITON_INTERPRET"] = "1"
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

# Triton builds its language functions when first imported, in the mode TRITON_INTERPRET says
# then; it cannot be imported afresh. If an earlier test module imported it compiled
# (transformers' Llama does), these tests run in a fresh process instead (see the end).
IN_PROCESS = isinstance(tl.sum, InterpretedFunction)
from lowbit.errors import QuantizationError  # noqa: E402
from lowbit.backends import triton_conformance as C  # noqa: E402
from lowbit.kernels.actquant import quantize_blocks, quantize_rows  # noqa: E402
from lowbit.kernels.dequant import dequantize_microscaled, pack_microscaled  # noqa: E402
from lowbit.numerics import E8M0, UE4M3, UE5M3  # noqa: E402
from lowbit.quant import dequantize, quantize  # noqa: E402
from lowbit.schemes import QuantSpec, get_scheme  # noqa: E402

pytestmark = pytest.mark.interpreter

BLOCK_SCHEMES = ["nvfp4", "nvfp4-e5m3", "mxfp4", "mxfp8"]
FAST = dict(block_n=1024)  # one interpreted program per call: the interpreter is slow per program


@pytest.fixture(autouse=True)
def _quiet_overflow():
    with warnings.catch_warnings():  # numpy warns on float32 overflow in the interpreter (inf is intended)
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _nonzero(d: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in d.items() if v}


# ---------------------------------------------------------------------------- activations
@pytest.mark.parametrize("scheme", BLOCK_SCHEMES)
def test_block_quant_bit_exact_on_adversarial_and_random_blocks(scheme):
    spec = get_scheme(scheme).input_activations
    x = C.adversarial_blocks(spec, n_random=32)
    res = C.check_block_quant(spec, x, "cpu", **FAST)
    assert res and _nonzero(res) == {}
    # codes, scale values, scale codes and QDQ (float32 and bfloat16) for every global scale
    assert {k.split(".")[1] for k in res} == {"codes", "scale", "scale_codes", "qdq_f32", "qdq_bfloat16"}


def test_block_quant_small_programs_and_leading_dims():
    """Several programs with a ragged last one, and a 3-D input: same codes as the reference."""
    spec = get_scheme("nvfp4").input_activations
    x = torch.randn(3, 5, 64) * 7
    gs = torch.tensor([37.5])
    got = quantize_blocks(x, spec, gs, qdq_dtype=torch.bfloat16, block_n=8)
    ref = quantize(x, spec, global_scale=gs)
    assert torch.equal(got["codes"], ref.codes) and torch.equal(got["scale"], ref.scale)
    assert torch.equal(got["qdq"], dequantize(ref, torch.bfloat16))


@pytest.mark.parametrize("scheme", BLOCK_SCHEMES + ["w8a8-int8", "w8a8-int8-dynamic", "w8a8-fp8", "w8a8-fp8-dynamic"])
def test_triton_implementation_of_spec_qdq_equals_the_reference(scheme):
    """lowbit.kernels.triton_ops (what fake_quantize runs for CUDA tensors under using(TRITON))."""
    from lowbit.kernels import Implementation, triton_ops, using
    from lowbit.quant import fake_quantize

    spec = get_scheme(scheme).input_activations
    x = C.adversarial_blocks(spec, n_random=8) if spec.is_microscaled else torch.randn(6, 96) * torch.logspace(-3, 3, 96)
    kw = {"global_scale": torch.tensor([37.5])} if spec.global_scale else {}
    if spec.dynamic.value == "static":
        kw["scale"] = torch.tensor([0.0123])
    got = triton_ops.fake_quantize(x, spec, **kw)
    with using(Implementation.REFERENCE):
        want = fake_quantize(x, spec, **kw)
    assert got is not None and torch.equal(got.view(torch.int32), want.view(torch.int32)), scheme


def test_adversarial_blocks_reach_the_edge_cases():
    """The adversarial set exercises what it claims (else the bit-exactness test proves little)."""
    e5 = get_scheme("nvfp4-e5m3").input_activations
    ref = quantize(C.adversarial_blocks(e5, n_random=0), e5)
    sc = UE5M3.encode(ref.scale)
    assert int(((sc > 0) & (sc < 8)).sum()) >= 10          # subnormal UE5M3 scales
    assert int((sc == 0xFE).sum()) >= 3                      # saturated scales
    assert int((sc == 0).sum()) >= 3                         # zero scales (all-zero / tiny blocks)
    mx = get_scheme("mxfp4").input_activations
    xm = C.adversarial_blocks(mx, n_random=0)
    rm = quantize(xm, mx)
    lowest = E8M0.encode(rm.scale).squeeze(-1) == 0
    assert int(lowest.sum()) >= 3                            # the 2^-127 scale
    assert bool(((rm.codes & 7) != 0)[lowest].any())         # with non-zero element codes
    assert bool((xm.abs() < 2.0 ** -126).logical_and(xm != 0).any())  # float32 subnormal inputs
    nv = get_scheme("nvfp4").input_activations
    rn = quantize(C.adversarial_blocks(nv, n_random=0), nv, global_scale=torch.tensor([1.0]))
    assert int((UE4M3.encode(rn.scale) == 0x7E).sum()) >= 3  # saturated UE4M3 scales


def test_the_checks_catch_a_reciprocal_multiply():
    """A kernel computing x * (1/scale) instead of x / scale (what a fast GPU path does) is
    caught by the adversarial data: so a passing check means something."""
    spec = get_scheme("nvfp4-e5m3").input_activations
    x = C.adversarial_blocks(spec, n_random=32)
    ref = quantize(x, spec)
    s = ref.scale.unsqueeze(-1)
    v = x.reshape(*x.shape[:-1], -1, spec.group_size)
    inv = torch.where(s > 0, 1.0 / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(s))
    from lowbit.numerics import E2M1
    naive = E2M1.encode(v * inv).reshape(x.shape)
    naive = torch.where((s > 0).expand_as(v).reshape(x.shape), naive, torch.zeros_like(naive))
    assert C.count_diff(naive, ref.codes) > 0


@pytest.mark.parametrize("scheme", ["w8a8-int8-dynamic", "w8a8-fp8-dynamic", "w8a8-int8", "w8a8-fp8"])
def test_row_quant_bit_exact(scheme):
    spec = get_scheme(scheme).input_activations
    x, scales = C.adversarial_rows(spec)
    static = spec.dynamic.value == "static"
    res = C.check_row_quant(spec, x, "cpu", scales if static else (None,), block_m=64, block_k=64)
    assert res and _nonzero(res) == {}


def test_row_quant_default_tiles_3d():
    spec = get_scheme("w8a8-int8-dynamic").input_activations
    x = torch.randn(2, 7, 600) * 3
    codes, s = quantize_rows(x, spec)
    ref = quantize(x, spec)
    assert torch.equal(codes, ref.codes) and torch.equal(s, ref.scale)


def test_nonfinite_input_is_an_error_naming_the_tensor():
    spec = get_scheme("mxfp4").input_activations
    x = torch.randn(2, 64)
    x[1, 5] = float("nan")
    with pytest.raises(QuantizationError, match="layer0.input"):
        quantize_blocks(x, spec, name="layer0.input", **FAST)
    x[1, 5] = float("inf")
    with pytest.raises(QuantizationError):
        quantize_rows(x, get_scheme("w8a8-int8-dynamic").input_activations)


def test_ragged_last_dimension_is_refused():
    spec = get_scheme("nvfp4-e5m3").input_activations
    with pytest.raises(QuantizationError, match="multiple of the block size 16"):
        quantize_blocks(torch.randn(2, 40), spec, name="x")


# ---------------------------------------------------------------------------- weights
@pytest.mark.parametrize("scheme", BLOCK_SCHEMES)
def test_microscaled_dequant_bit_exact_all_scale_codes(scheme):
    """Random element codes and every finite block-scale code (E8M0 2^-127 included, whose
    products are float32 subnormals): float32 and bfloat16 outputs equal the reference's."""
    spec = get_scheme(scheme).weights
    qt = C.random_microscaled_weight(spec, 40, 256 if spec.group_size == 16 else 512)
    res = C.check_microscaled_dequant(qt, "cpu", **FAST)
    assert res and _nonzero(res) == {}


def test_dequant_from_quantized_weight_and_packing_layout():
    spec = get_scheme("nvfp4").weights
    w = torch.randn(24, 64)
    qt = quantize(w, spec)
    data, scodes = pack_microscaled(qt.codes, qt.scale, spec)
    assert data.shape == (24, 32) and torch.equal(data[0, 0] & 0xF, qt.codes[0, 0])
    got = dequantize_microscaled(data, scodes, spec, qt.global_scale, out_features=24, in_features=64,
                                 dtype=torch.float32, block_n=16)
    assert torch.equal(got, dequantize(qt))


@pytest.mark.parametrize("spec", [
    get_scheme("w4a16").weights,                                  # int4, group 128, ragged last group
    get_scheme("w8a16").weights,                                  # int8 per channel
    QuantSpec("int4", "group", 64, symmetric=False),              # asymmetric, zero points
    QuantSpec("int8", "tensor"),
], ids=["w4a16-ragged", "w8a16", "int4-asym", "int8-tensor"])
def test_int_dequant_bit_exact(spec):
    w = torch.randn(20, 200) * 0.05 + 0.01
    qt = quantize(w, spec)
    res = C.check_int_dequant(qt, "cpu", block_r=32, block_c=256)
    assert res and _nonzero(res) == {}


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp8"])  # nibbles + UE4M3 + global; bytes + E8M0
def test_fused_matmul_matches_dequantized_linear(scheme):
    from lowbit.kernels.matmul import MatmulTiles, mx_matmul

    spec = get_scheme(scheme).weights
    torch.manual_seed(1)
    qt = quantize(torch.randn(40, 256) * 0.05, spec)
    data, sc = pack_microscaled(qt.codes, qt.scale, spec)
    x = torch.randn(2, 9, 256).to(torch.bfloat16)
    b = torch.randn(40)
    y = mx_matmul(x, data, sc, spec, qt.global_scale, b, out_features=40, tiles=MatmulTiles(32, 64, 128),
                  out_dtype=torch.float32)
    ref = torch.nn.functional.linear(x.float(), dequantize(qt), b)
    assert y.shape == (2, 9, 40)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- backends
def _module(scheme: str, out_f=32, in_f=64, seed=0, bias=True):
    from lowbit.modules import QuantLinear

    torch.manual_seed(seed)
    lin = torch.nn.Linear(in_f, out_f, bias=bias)
    sch = get_scheme(scheme)
    kw = {}
    a = sch.input_activations
    if a is not None and a.global_scale:
        from lowbit.quant import global_scale_from_amax
        kw["input_global_scale"] = global_scale_from_amax(torch.tensor(4.0), a)
    if a is not None and a.dynamic.value == "static":
        from lowbit.quant import static_scale_from_amax
        kw["input_scale"] = static_scale_from_amax(torch.tensor(4.0), a)
    return QuantLinear.from_linear(lin, sch, name="layer", **kw)


@pytest.mark.parametrize("scheme", ["nvfp4", "nvfp4-e5m3", "mxfp4", "mxfp8", "nvfp4a16", "w4a16", "w8a16"])
def test_triton_backend_matches_reference(scheme):
    from lowbit.backends.reference import ReferenceBackend, qdq_input
    from lowbit.backends.triton_mx import TritonBackend

    m = _module(scheme)
    x = torch.randn(3, 5, 64)
    be = TritonBackend()
    # the input QDQ and the dequantized weight are bit-exact; the output is within float rounding
    assert torch.equal(be.qdq_input(m, x, torch.float32), qdq_input(m, x))
    assert torch.equal(be.dequantized_weight(m, torch.float32), m.dequantized_weight())
    y, ref = be.forward(m, x), ReferenceBackend().forward(m, x)
    assert y.shape == ref.shape == (3, 5, 32)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    yb = be.forward(m, x.to(torch.bfloat16))
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), ReferenceBackend().forward(m, x.to(torch.bfloat16)).float(),
                               rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("scheme", ["w8a8-int8", "w8a8-int8-dynamic", "w8a8-fp8", "w8a8-fp8-dynamic"])
def test_w8a8_backends_match_reference(scheme):
    """torch._int_mm / _scaled_mm (CPU implementations here) after the Triton input quantizer."""
    from lowbit.backends.gpu_w8a8 import FP8MMBackend, Int8MMBackend
    from lowbit.backends.reference import ReferenceBackend
    from lowbit.modules.inputs import quantize_input

    m = _module(scheme, out_f=48, in_f=64)
    x = torch.randn(20, 64)
    be = Int8MMBackend() if "int8" in scheme else FP8MMBackend()
    codes, sx = quantize_rows(x, m.scheme.input_activations, m.input_scale)
    ref_q = quantize_input(m, x)
    assert torch.equal(codes, ref_q.codes) and torch.equal(sx, ref_q.scale)
    torch.testing.assert_close(be.forward(m, x), ReferenceBackend().forward(m, x), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_row", [True, False])
def test_scale_epilogue_bit_identical_to_torch(dtype, per_row):
    from lowbit.kernels.epilogue import scale_epilogue
    from lowbit.kernels.gemm import apply_scales

    g = torch.Generator().manual_seed(2)
    acc = torch.randint(-2**20, 2**20, (37, 70), generator=g, dtype=torch.int32)
    sx = torch.rand(37, 1, generator=g) * 0.01 if per_row else torch.tensor([0.0123])
    sw = torch.rand(70, 1, generator=g) * 0.02
    b = torch.randn(70, generator=g).to(dtype)
    for bias in (None, b):
        y = scale_epilogue(acc, sx, sw, bias, dtype, block_m=16, block_n=32)
        assert C.count_diff(y, apply_scales(acc, sx, sw, bias).to(dtype)) == 0


def test_registry_declares_gpu_backends():
    from lowbit.backends import REGISTRY
    from lowbit.backends.gpu_w8a8 import supports_fp8, supports_int8
    from lowbit.backends.triton_mx import supports

    ref = REGISTRY.get("reference")
    for name in ("triton", "cuda-int8", "cuda-fp8"):
        spec = REGISTRY.get(name)
        assert spec.devices == frozenset({"cuda"}) and spec.priority > ref.priority and spec.auto
    triton_ok = {s for s in ["nvfp4", "nvfp4a16", "nvfp4-e5m3", "mxfp4", "mxfp8", "w4a16", "w8a16",
                             "w8a8-int8", "w8a8-int8-dynamic", "w8a8-fp8", "w8a8-fp8-dynamic"] if supports(get_scheme(s))}
    assert triton_ok == {"nvfp4", "nvfp4a16", "nvfp4-e5m3", "mxfp4", "mxfp8", "w4a16", "w8a16"}
    assert supports_int8(get_scheme("w8a8-int8")) and supports_int8(get_scheme("w8a8-int8-dynamic"))
    assert supports_fp8(get_scheme("w8a8-fp8-dynamic")) and not supports_fp8(get_scheme("w8a8-int8"))
    # a CPU module never gets a GPU backend, and without CUDA none is available
    m = _module("nvfp4-e5m3")
    assert REGISTRY.select(m).name != "triton"
    if not torch.cuda.is_available():
        assert not REGISTRY.get("triton").available() and not REGISTRY.get("cuda-int8").available()


# ---------------------------------------------------------------------------- PTX
@pytest.mark.subprocess
def test_ptx_uses_only_ieee_round_to_nearest_float_ops():
    """Compiled for sm_90 on this CPU (no GPU needed): float32 division is div.rn (not the
    approximate div.full that Triton's '/' emits), nothing flushes subnormals (.ftz), no FMA.
    Runs in a fresh process, where TRITON_INTERPRET is unset."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    names = ["block_quant[nvfp4]", "row_quant[w8a8-int8-dynamic]", "mx_dequant[mxfp4]"]
    p = subprocess.run([sys.executable, "-m", "lowbit.kernels.ptx_audit", *names], capture_output=True,
                       text=True, env=env, timeout=300)
    if p.returncode != 0 and "GPUTarget" in p.stderr:
        pytest.skip("this Triton cannot compile for CUDA targets on this host")
    assert p.returncode == 0, p.stderr[-2000:]
    import json
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["violations"] == {}
    assert set(out["instructions"]) == set(names)
    assert "div.rn.f32" in out["instructions"]["block_quant[nvfp4]"]
    assert "div.rn.f32" in out["instructions"]["row_quant[w8a8-int8-dynamic]"]


# The GPU run of these checks (compiled kernels, Llama-sized tensors, timings) is bench/gpu/gpu_check.py.

if not IN_PROCESS:  # replace the tests above by one that runs them all in a fresh process
    for _name in [n for n in list(globals()) if n.startswith("test_")]:
        del globals()[_name]

    @pytest.mark.subprocess
    def test_triton_kernels_in_a_fresh_process():
        env = dict(os.environ, TRITON_INTERPRET="1")
        p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu",
                            __file__], capture_output=True, text=True, env=env, timeout=600)
        assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
        assert " passed" in p.stdout
