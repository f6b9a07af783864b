"""The native encoders of GGML's MXFP4 / NVFP4 (ggml_fp4_native.c) against the torch reference
(lowbit.numerics.ggml_fp4), byte for byte: ties between E2M1 values at many scales (and the
floats beside them), every binade of the block maximum with the floats at the top of each (where
float32 log2 rounds up), E8M0 exponents clamped at 0, every UE4M3 scale code and the midpoints
between them (ggml rounds them half up), zero, saturated and subnormal scales, subnormal inputs,
the largest finite float32, signed zeros, one nonzero, random normal and heavy-tailed tensors of
several shapes (over several of the reference's CHUNKs); the entry point lowbit.kernels.ggml.encode
and its fallbacks; and mutants of the reference's tie rule that these inputs tell apart."""

from __future__ import annotations

import pytest
import torch

from lowbit.errors import QuantizationError
from lowbit.kernels import Implementation, available, using
from lowbit.kernels import ggml as kg
from lowbit.kernels import native as ng
from lowbit.numerics import ggml, ggml_fp4
from lowbit.numerics.ggml import GgmlType
from lowbit.numerics.ggml_fp4 import CHUNK, DOUBLED_E2M1, fp4_scales

pytestmark = pytest.mark.skipif(not available(Implementation.NATIVE), reason="no C compiler: no native library")

F32_MAX = torch.finfo(torch.float32).max
GROUP = {GgmlType.MXFP4: 32, GgmlType.NVFP4: 16}
MAG = torch.tensor(DOUBLED_E2M1[:8], dtype=torch.float64)


def _f32(v) -> torch.Tensor:
    return torch.as_tensor(v, dtype=torch.float64).to(torch.float32).reshape(-1)


def _around(v: torch.Tensor) -> torch.Tensor:
    """v and its float32 neighbours."""
    up, down = torch.full_like(v, float("inf")), torch.full_like(v, -float("inf"))
    return torch.cat([v, torch.nextafter(v, up), torch.nextafter(v, down)])


def _halved_scale(amax: torch.Tensor, kind: GgmlType) -> torch.Tensor:
    """The reference's halved scale of a group whose largest |x| is amax (float64 [N])."""
    n = GROUP[kind] if kind is GgmlType.MXFP4 else 64
    x = torch.zeros(len(amax), n)
    x[:, 0] = amax
    return fp4_scales(ggml.encode(x, kind), kind)[:, 0].double()


def _groups(amax: torch.Tensor, kind: GgmlType, seed: int) -> torch.Tensor:
    """Groups [N, group] led by +-amax: the E2M1 grid under each group's scale, the midpoints
    between neighbours (the ties) and the floats beside both, at most amax in magnitude, of random
    signs (a group per 31 / 15 of them)."""
    g, n = torch.Generator().manual_seed(seed), GROUP[kind]
    d = _halved_scale(amax, kind)
    rows = []
    for a, s in zip(amax.tolist(), d.tolist()):
        pts = torch.cat([MAG * s, (MAG[:-1] + MAG[1:]) / 2 * s])
        v = _around(_f32(pts))
        v = v[(v.abs() <= a) & (v != 0)].unique()
        v = v[torch.randperm(len(v), generator=g)] * (torch.randint(0, 2, (len(v),), generator=g) * 2 - 1)
        for i in range(0, max(len(v), 1), n - 1):
            part = v[i:i + n - 1]
            lead = a if torch.rand((), generator=g) < 0.5 else -a
            rows.append(torch.cat([_f32(lead), part, torch.zeros(n - 1 - len(part))]))
    return torch.stack(rows)


def _mxfp4_cases() -> torch.Tensor:
    """Rows of 32 (one block each) for MXFP4."""
    ks = torch.tensor([-149, -140, -130, -127, -126, -125, -124, -123, -100, -20, -1, 0, 1, 2, 40, 125, 126, 127])
    amax = torch.cat([torch.pow(2.0, ks.double()) * f for f in (1.0, 1.5, 1.9999)])
    amax = torch.cat([_f32(amax[amax < 2.0 ** 128]).double(), _f32(F32_MAX).double()])
    ties = _groups(amax, GgmlType.MXFP4, 0)
    # every binade: the block maximum at 2^k and at the 64 floats below 2^(k + 1)
    tops = [_f32(2.0 ** k) for k in range(-149, 128)]
    for k in range(-148, 129):
        top = torch.tensor(2.0 ** k, dtype=torch.float32)               # 2^128: inf, F32_MAX below it
        below = top.view(torch.int32) - torch.arange(1, 65, dtype=torch.int32)
        tops.append(below[below > 0].view(torch.float32))
    tops = torch.cat(tops)
    pattern = torch.linspace(-1, 1, 32)
    pattern[0] = 1.0
    edges = tops[:, None] * pattern
    edges[1::2] = -edges[1::2]
    return torch.cat([ties, edges, _specials(32)])


def _nvfp4_cases() -> torch.Tensor:
    """Rows of 64 (one block each) for NVFP4: groups of 16 in random order."""
    codes = torch.arange(1, 0x7F, dtype=torch.uint8)
    values = (2 * ggml_fp4._ue4m3_half(codes)).double()
    mids = (values[:-1] + values[1:]) / 2                                # fp32_to_ue4m3 rounds these up
    sub = (torch.arange(0, 9, dtype=torch.float64) - 0.5).clamp(min=0.25) / 512  # trunc(x * 512 + 0.5) steps
    amax = torch.cat([values, mids, sub, torch.tensor([1e-12, 2.0 ** -11, 255.0, 256.0, 300.0, 448.0, 480.0, 1e4])])
    amax = _around(_f32(6 * amax)).double()
    amax = torch.cat([amax, torch.tensor([1e9, 2.0 ** 34, 2.0 ** 37, 1e10, 3e38, F32_MAX], dtype=torch.float64)])
    ties = _groups(amax, GgmlType.NVFP4, 1)
    rows = torch.cat([ties, _specials(16)])
    rows = rows[torch.randperm(len(rows), generator=torch.Generator().manual_seed(2))]
    rows = torch.cat([rows, torch.zeros(-len(rows) % 4, 16)])
    return rows.reshape(-1, 64)


def _specials(n: int) -> torch.Tensor:
    """Groups of n: zeros of both signs, one nonzero, subnormals, the largest finite float32,
    weights from 1e8 to 1e38 (float32's spacing there is above NVFP4's saturated scale)."""
    tiny = 2.0 ** -149
    one = torch.zeros(6, n)
    one[0, 0], one[1, n // 2], one[2, n - 1], one[3, 3], one[4, 5], one[5, 1] = 1.0, -3.0, 1e-30, -tiny, F32_MAX, 1e30
    sub = torch.tensor([tiny * k for k in (1, 2, 3, 5, 7, 100, 2 ** 20, 2 ** 23 - 1)], dtype=torch.float32)
    sub = sub.repeat(n // 8 + 1)[:n]
    rows = [
        torch.zeros(2, n), -torch.zeros(2, n), torch.zeros(n).index_fill_(0, torch.arange(0, n, 2), -0.0)[None],
        one,
        sub[None], -sub[None], (sub * torch.tensor([1.0, -1.0]).repeat(n // 2))[None],
        torch.cat([torch.tensor([1e-38]), sub[1:]])[None],                # subnormals beside a normal max
        torch.cat([torch.tensor([1.0]), sub[1:]])[None],
        torch.full((1, n), F32_MAX), torch.full((1, n), -F32_MAX),
        torch.cat([torch.tensor([F32_MAX, -F32_MAX]), torch.linspace(-1, 1, n - 2) * 1e38])[None],
        torch.cat([torch.tensor([-F32_MAX]), torch.linspace(-3, 3, n - 1)])[None],
        torch.logspace(8, 38, n)[None] * torch.tensor([1.0, -1.0]).repeat(n // 2),  # NVFP4: a saturated scale
        torch.logspace(30, 8, n)[None] * torch.tensor([-1.0, 1.0]).repeat(n // 2),
    ]
    return torch.cat(rows)


CASES = {GgmlType.MXFP4: _mxfp4_cases, GgmlType.NVFP4: _nvfp4_cases}


@pytest.fixture(scope="module")
def cases():
    return {k: f().contiguous() for k, f in CASES.items()}


def _same(got: torch.Tensor | None, want: torch.Tensor) -> None:
    assert got is not None, "the native encoder did not run"
    assert got.shape == want.shape and got.dtype == want.dtype == torch.uint8
    bad = (got != want).nonzero()
    assert not len(bad), f"{len(bad)} bytes differ, first at {bad[0].tolist()}"


@pytest.mark.parametrize("kind", [GgmlType.MXFP4, GgmlType.NVFP4])
def test_native_fp4_equals_the_reference_on_adversarial_values(kind, cases):
    x = cases[kind]
    want = ggml.encode(x, kind)
    _same(ng.encode_fp4(x, kind.value), want)
    _same(kg.encode(x, kind), want)
    # the cases are what they say: exact ties between two E2M1 values, zero groups
    d = fp4_scales(want, kind).repeat_interleave(GROUP[kind], dim=1).double()
    y = x.double().abs() / d
    mids = ((MAG[:-1] + MAG[1:]) / 2)
    assert int(torch.isin(y[d > 0], mids).sum()) > 200
    assert int((d == 0).sum()) > 0 or kind is GgmlType.MXFP4


def test_the_mxfp4_cases_reach_the_binade_tops_and_the_clamped_exponent(cases):
    x = cases[GgmlType.MXFP4]
    e = ggml.encode(x, GgmlType.MXFP4)[:, 0].to(torch.int64)
    amax = x.abs().amax(1)
    exact = torch.frexp(amax.double())[1] - 1 - 2 + 127                  # floor(log2) without float32 log2
    normal = amax > 2.0 ** -100
    assert int((e[normal] != exact[normal]).sum()) > 100                 # float32 log2 rounded up to 2^(k+1)
    assert int(((e == 0) & (amax > 0)).sum()) > 50
    assert int(e[amax == F32_MAX].unique()) == 253 and int((e == 252).sum()) > 0  # log2f(F32_MAX) rounds to 128


def test_the_nvfp4_cases_reach_every_scale_code_and_the_half_up_rounding(cases):
    x = cases[GgmlType.NVFP4].reshape(-1, 16)
    ue = ggml.encode(cases[GgmlType.NVFP4], GgmlType.NVFP4).reshape(-1, 36)[:, :4].reshape(-1)
    assert set(ue.tolist()) == set(range(0x78)) | {0x7E}                # exponent field 15: 0x7E (ggml)
    assert bool((x.abs().amax(1)[ue == 0x7E] / 6 < 448).any())
    s = x.abs().amax(1) / 6.0
    fine = (s > 2.0 ** -6) & (s < 240)                                   # normal, unsaturated
    rne = s[fine].to(torch.float8_e4m3fn).view(torch.uint8)
    assert int((rne != ue[fine]).sum()) > 50                             # ggml's half up is not even


@pytest.mark.parametrize("kind", [GgmlType.MXFP4, GgmlType.NVFP4])
@pytest.mark.parametrize("shape", [(3, 7, 192), (1, 64), (64,), (5, 1, 2560)])
def test_native_fp4_equals_the_reference_on_random_tensors(kind, shape):
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    x = torch.randn(*shape, generator=g) * torch.logspace(-6, 6, shape[-1])
    t = torch.randn(*shape, generator=g) / torch.randn(*shape, generator=g) * 0.02  # Cauchy: heavy tails
    for v in (x, t, x.to(torch.bfloat16).to(torch.float32)):
        _same(kg.encode(v, kind), ggml.encode(v, kind))


@pytest.mark.parametrize("kind", [GgmlType.MXFP4, GgmlType.NVFP4])
def test_native_fp4_equals_the_reference_over_several_chunks(kind):
    """More groups than two of the reference's chunks; the C kernel's tiles of 512 weights do
    not divide the rows (K = 576, SmolLM2's hidden size)."""
    rows = 2 * CHUNK * GROUP[kind] // 576 + 11
    g = torch.Generator().manual_seed(9)
    x = torch.randn(rows, 576, generator=g) * torch.rand(rows, 1, generator=g)
    x[:, ::97] *= 30
    assert x.numel() // GROUP[kind] > 2 * CHUNK
    _same(kg.encode(x, kind), ggml.encode(x, kind))


@pytest.mark.parametrize("kind", [GgmlType.MXFP4, GgmlType.NVFP4])
def test_the_entry_point_falls_back_to_the_reference(kind, monkeypatch):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(48, 128, generator=g)
    want = ggml.encode(x, kind)
    imp = torch.rand(128, generator=g)
    _same(kg.encode(x, kind, importance=imp, search=ggml.ImportanceSearch.DIRECT), want)  # FP4 takes none
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[-1, -1] = bad                                                  # after blocks already written
        assert ng.encode_fp4(y, kind.value) is None
        with pytest.raises(QuantizationError, match="'blk.0.attn_q.weight' holds NaN or infinite"):
            kg.encode(y, kind, name="blk.0.attn_q.weight")
    with pytest.raises(QuantizationError, match="not a multiple"):
        kg.encode(x[:, :96 if kind is GgmlType.NVFP4 else 80], kind, name="w")
    xt = x.t().contiguous().t()                                          # not contiguous: the reference
    assert ng.encode_fp4(xt, kind.value) is None and torch.equal(kg.encode(xt, kind), want)
    assert ng.encode_fp4(x.to(torch.bfloat16), kind.value) is None
    _same(kg.encode(x.to(torch.bfloat16), kind), ggml.encode(x.to(torch.bfloat16), kind))
    with using(Implementation.TORCH):
        assert ng.encode_fp4(x, kind.value) is None
        _same(kg.encode(x, kind), want)
    # with the native implementation allowed the entry point never reaches the torch encoder
    monkeypatch.setattr(ggml_fp4, "encode_mxfp4" if kind is GgmlType.MXFP4 else "encode_nvfp4", None)
    _same(kg.encode(x, kind), want)


def _mutant(rule: str):
    """``_nearest_codes`` with another tie rule: "larger" (a tie goes to the larger magnitude) or
    "even" (to the even code, the even E2M1 mantissa: OCP's round to nearest even)."""
    table = torch.tensor(DOUBLED_E2M1, dtype=torch.float32)
    code = torch.arange(16)
    prio = torch.where(code == 8, -1, code % 8) if rule == "larger" else (code % 2 == 0).long() - (code == 8).long()

    def codes(b: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        err = (d[:, None, None] * table - b[:, :, None]).abs()
        best = err == err.min(dim=-1, keepdim=True).values
        return torch.where(best, prio + 2, 0).argmax(dim=-1).to(torch.uint8)

    return codes


@pytest.mark.parametrize("kind", [GgmlType.MXFP4, GgmlType.NVFP4])
@pytest.mark.parametrize("rule", ["larger", "even"])
def test_the_cases_catch_a_wrong_tie_rule(kind, rule, cases, monkeypatch):
    """A reference with another tie rule gives other bytes on these cases, and ``_same`` says so;
    on random values (no exact ties) the mutants agree with the reference."""
    x = cases[kind]
    native = ng.encode_fp4(x, kind.value)
    r = torch.randn(64, 128, generator=torch.Generator().manual_seed(5))
    plain = ggml.encode(r, kind)
    monkeypatch.setattr(ggml_fp4, "_nearest_codes", _mutant(rule))
    assert torch.equal(ggml.encode(r, kind), plain)
    with pytest.raises(AssertionError, match="bytes differ"):
        _same(native, ggml.encode(x, kind))
