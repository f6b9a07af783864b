"""The native GGML kernels (ggml_native.c) against their torch references, bit for bit: the direct
importance search of Q4_0 / Q5_0 (lowbit.numerics.ggml_direct) on adversarial blocks (ties of the
scaled value, zero and near-zero blocks, one nonzero, equal |max| of opposite sign, subnormals,
the largest finite float32, zero and underflowing importance), the encoded bytes, and GPTQ's
column loop on GGML grids (lowbit.algorithms.gptq_grid) for several types, row counts around
torch's vector width (its addr_ fuses the vector part only) and one-row weights."""

from __future__ import annotations

import pytest
import torch

from lowbit.algorithms.gptq import GPTQOptions
from lowbit.algorithms.gptq_grid import block_loop, gptq_on_grid
from lowbit.kernels import Implementation, available, using
from lowbit.kernels import ggml as kg
from lowbit.kernels import native as ng
from lowbit.numerics import ggml
from lowbit.numerics.ggml import GgmlType, ImportanceSearch
from lowbit.numerics.ggml_codes import codes_of, grid_of
from lowbit.numerics.ggml_direct import candidate_numerators, direct_symmetric_search

pytestmark = pytest.mark.skipif(not available(Implementation.NATIVE), reason="no C compiler: no native library")

F32_MAX = torch.finfo(torch.float32).max
TINY = float(torch.tensor(1e-15, dtype=torch.float32))  # the zero-block bound as torch compares it


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _adversarial(nmax: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks x, w [S, 32]: random rows with outliers, and one block per adversarial kind."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(300, 32, generator=g) * torch.rand(300, 1, generator=g)
    x[:, ::7] *= 6
    w = torch.exp(2 * torch.randn(300, 32, generator=g))
    half = torch.arange(32, dtype=torch.float32) % (2 * nmax) - nmax + 0.5  # k + 0.5: ties at isc = +-1
    special = [
        torch.cat([torch.tensor([float(nmax)]), half[1:]]),             # v = nmax: isc a multiple of 1/4
        torch.cat([torch.tensor([-float(nmax)]), -half[1:]]),
        torch.cat([torch.tensor([float(nmax)]), half[1:] / 2]),          # quarter ties
        torch.zeros(32), -torch.zeros(32),                               # zero blocks (+0, -0)
        torch.full((32,), 1e-16), torch.full((32,), TINY),               # below / at the bound
        torch.full((32,), float(torch.nextafter(torch.tensor(TINY), torch.tensor(1.0)))),
        torch.full((32,), float(torch.nextafter(torch.tensor(TINY), torch.tensor(0.0)))),
        torch.zeros(32).index_fill_(0, torch.tensor([5]), -3.0),        # one nonzero
        torch.zeros(32).index_fill_(0, torch.tensor([31]), 1e-14),
        torch.linspace(-1, 1, 32).index_fill_(0, torch.tensor([3]), 2.0).index_fill_(0, torch.tensor([9]), -2.0),
        torch.linspace(-1, 1, 32).index_fill_(0, torch.tensor([3]), -2.0).index_fill_(0, torch.tensor([9]), 2.0),
        torch.full((32,), 1e-40).index_fill_(0, torch.tensor([0]), 1e-14),  # subnormals beside a small max
        torch.full((32,), -1e-41),                                       # all subnormal: a zero block
        torch.linspace(-1, 1, 32) * 1e30,
        torch.linspace(-1, 1, 32).index_fill_(0, torch.tensor([2]), F32_MAX)
        .index_fill_(0, torch.tensor([4]), -F32_MAX),
        torch.full((32,), -F32_MAX),
        torch.linspace(-3, 2, 32), torch.linspace(-3, 2, 32), torch.linspace(-3, 2, 32),
        -torch.linspace(1e-14, 2e-14, 32),
    ]
    tail = [torch.zeros(32),                                             # no importance
            torch.ones(32).index_fill_(0, torch.arange(0, 32, 2), 0.0),  # zero columns
            torch.full((32,), 1e-35)]                                    # products underflow
    ws = [torch.ones(32)] * (len(special) - len(tail)) + tail
    x = torch.cat([x, torch.stack(special)])
    w = torch.cat([w, torch.stack(ws)])
    w[:50, ::5] = 0.0                                                    # zero importance columns
    return x.contiguous(), w.contiguous()


@pytest.mark.parametrize("nmax", [8, 16])
def test_native_direct_search_equals_the_torch_search(nmax):
    x, w = _adversarial(nmax)
    nums = torch.tensor(candidate_numerators(nmax), dtype=torch.float32)
    got = ng.direct_search(x, nmax, w, nums)
    assert got is not None, "the native search did not run"
    want = direct_symmetric_search(x, nmax, w)
    assert torch.equal(_bits(got[0]), _bits(want[0])), (got[0] - want[0]).abs().max()
    assert torch.equal(got[1].to(torch.int64), want[1])
    entry = kg.direct_search(x, nmax, w)
    assert torch.equal(_bits(entry[0]), _bits(want[0])) and torch.equal(entry[1], want[1])
    # the cases are what they say: ties of the scaled value, zero blocks, signed zero scales
    v = x.gather(1, x.abs().argmax(1, keepdim=True))
    y = (1.0 / v) * nums[0] * x
    assert bool((y - y.floor() == 0.5).any()) and bool((want[0] == 0).sum() >= 6)
    assert bool((_bits(want[0]) == _bits(torch.tensor(-0.0))).any() | (_bits(want[0]) == 0).any())


def test_native_direct_search_refuses_what_it_cannot_take():
    x, w = _adversarial(8)
    nums = torch.tensor(candidate_numerators(8), dtype=torch.float32)
    x[3, 4] = float("nan")
    assert ng.direct_search(x, 8, w, nums) is None                      # NaN: the torch code decides
    a, b = kg.direct_search(x, 8, w), direct_symmetric_search(x, 8, w)  # and the entry falls back to it
    assert torch.equal(_bits(a[0]), _bits(b[0])) and torch.equal(a[1], b[1])
    assert ng.direct_search(x[:, :16].t(), 8, w[:, :16].t(), nums) is None  # not contiguous
    wide = torch.randn(4, 65)
    assert ng.direct_search(wide, 8, wide.abs(), nums) is None          # blocks over 64
    with using(Implementation.TORCH):
        assert ng.direct_search(x, 8, w, nums) is None


@pytest.mark.parametrize("kind", [GgmlType.Q4_0, GgmlType.Q5_0])
def test_encoded_bytes_equal_the_reference_and_the_torch_setting(kind):
    g = torch.Generator().manual_seed(3)
    W = torch.randn(96, 256, generator=g) * torch.rand(96, 1, generator=g)
    W[:, ::37] *= 8
    W[5] = 0.0
    W[6, 32:64] = 0.0
    W[7, :32] = torch.linspace(-8, 8, 32)
    imp = torch.exp(2 * torch.randn(256, generator=g))
    imp[::11] = 0.0
    want = ggml.encode(W, kind, importance=imp, search=ImportanceSearch.DIRECT)
    got = kg.encode(W, kind, importance=imp, search=ImportanceSearch.DIRECT)
    assert torch.equal(got, want)
    with using(Implementation.TORCH):
        assert torch.equal(kg.encode(W, kind, importance=imp, search=ImportanceSearch.DIRECT), want)
    x, _ = _adversarial(16 if kind is GgmlType.Q5_0 else 8)
    x = x[-256:].reshape(-1, 256)
    imp = torch.rand(256, generator=g) + 0.5
    imp[:32] = 0.0
    assert torch.equal(kg.encode(x, kind, importance=imp, search=ImportanceSearch.DIRECT),
                       ggml.encode(x, kind, importance=imp, search=ImportanceSearch.DIRECT))


def _hessian(n: int, seed: int, dead: tuple[int, ...] = ()) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3 * n, n, generator=g) * (1 + 5 * torch.rand(n, generator=g))
    x = x @ (torch.eye(n) + torch.randn(n, n, generator=g) / n ** 0.5)
    H = (x.T @ x).double()
    for d in dead:
        H[d], H[:, d] = 0.0, 0.0
    return H


def test_torch_addr_follows_the_rules_the_kernel_reproduces():
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AVX2"):
        pytest.skip("torch's vector width here is not one the kernel knows")
    assert ng.addr_vector_width() == {"AVX512": 16, "AVX2": 8}[torch.backends.cpu.get_cpu_capability()]
    assert kg.grid_block("cpu") is not None
    with using(Implementation.TORCH):
        assert kg.grid_block("cpu") is None


@pytest.mark.parametrize("kind", [GgmlType.Q4_0, GgmlType.Q5_0, GgmlType.Q4_K, GgmlType.Q6_K, GgmlType.Q2_K,
                                  GgmlType.Q3_K, GgmlType.Q8_0])
@pytest.mark.parametrize("rows,block", [(37, 128), (64, 50), (1, 128), (17, 1)])
def test_native_grid_loop_equals_the_torch_loop(kind, rows, block):
    if kg.grid_block("cpu") is None:
        pytest.skip("torch's addr_ here follows rules the kernel does not reproduce")
    g = torch.Generator().manual_seed(rows + block)
    W = torch.randn(rows, 512, generator=g) * 0.05
    W[:, 40:48] *= 20                                                    # saturating codes
    if rows > 2:
        W[1, 64:128] = 0.0                                               # zero-step sub-blocks
    H = _hessian(512, rows, dead=(3, 200))
    grid = grid_of(ggml.encode(W, kind), kind)
    assert rows < 2 or bool((grid.step == 0).any())
    opts = GPTQOptions(block_size=block)
    got = gptq_on_grid(W, H, grid, opts)
    with using(Implementation.TORCH):
        want = gptq_on_grid(W, H, grid, opts)
    assert torch.equal(got, want) and got.dtype == torch.int32
    assert rows == 1 or not torch.equal(got, codes_of(ggml.encode(W, kind), kind).to(torch.int32))  # GPTQ, not RTN


def _grid_case(rows: int, n: int, seed: int):
    """A block on a hand-made grid: ties of (w + offset) / step at every column (a diagonal H gives
    no updates: u's off-diagonal is zero, so every column is plain rounding), zero steps, both ends."""
    g = torch.Generator().manual_seed(seed)
    step = torch.full((n, rows), 0.25)
    step[::5, 0] = 0.0
    offset = torch.full((n, rows), -0.125) * (torch.arange(rows) % 2)
    k = torch.randint(-12, 12, (n, rows), generator=g).to(torch.float32) + 0.5
    W = k * 0.25 - offset
    zs = step == 0
    return W, step, offset, zs, torch.where(zs, torch.ones_like(step), step)


@pytest.mark.parametrize("rows", [1, 15, 16, 33])
@pytest.mark.parametrize("u_layout", ["rows", "columns"])
def test_native_block_equals_the_torch_block(rows, u_layout):
    """Ties and zero steps (a diagonal u), then a dense u of either memory layout: for one-row
    weights its layout decides which of torch's updates are fused."""
    block = kg.grid_block("cpu")
    if block is None:
        pytest.skip("torch's addr_ here follows rules the kernel does not reproduce")
    n = 40
    for dense in (False, True):
        W, step, offset, zs, div = _grid_case(rows, n, rows)
        g = torch.Generator().manual_seed(7)
        u = torch.triu(torch.randn(n + 3, n + 3, generator=g) * 0.3, 1) if dense else torch.zeros(n + 3, n + 3)
        u = u if u_layout == "rows" else u.t().contiguous().t()
        outs = []
        for fn in (block, block_loop):
            W1, E1, C1 = W.clone(), torch.empty_like(W), torch.empty_like(W)
            with torch.no_grad():
                fn(W1, E1, C1, step, offset, div, zs, u, 3, 4, 0.0, 15.0, 4.0)
            outs.append((W1, E1, C1))
        for a, b in zip(*outs):
            assert torch.equal(_bits(a), _bits(b))
        if not dense:  # the ties went to even, the zero steps to the fill, the ends clamped
            c = outs[1][2]
            assert bool((c[zs] == 4.0).all())
            inner = c[~zs & (c > 0) & (c < 15)]
            assert bool((inner % 2 == 0).all()) and bool((c == 15).any()) and bool((c == 0).any())

