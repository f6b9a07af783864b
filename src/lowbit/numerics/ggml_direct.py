"""lowbit's importance-weighted scale search for GGML types (``ImportanceSearch.DIRECT``): the
stored layout and grid are llama.cpp's, only the choice of each block's scale differs.

llama-quantize ``--imatrix`` weighs a weight's squared error by ``imatrix[j] * sqrt(sigma2 + x^2)``
(sigma2: the row's mean square) and tries the scales -(nmax + 0.1 k) / v, k = -9..9, for the
symmetric 32-blocks (Q4_0, Q5_0). Here the weight is the importance alone: with x the layer's
input, the expected squared output error of a row is sum_j E[x_j^2] (w_j - w^_j)^2, whose weights
are exactly llama-imatrix's statistic; and the candidates span -(nmax + t) / v for t in
[-0.75 nmax, 0.75 nmax] in 48 even steps (a wider grid, as auto-round's search for these types:
its 200 candidates over the same span gave no better figure here). Each candidate's codes get the
least-squares scale sum(w x l) / sum(w l^2), and the candidate of least weighted error wins (the
first on a tie). SmolLM2-135M Q4_K_M with GPTQ codes, KLD against float on the same tokens:
bench/gguf/RESULTS-gguf.md ("The importance search").
"""

from __future__ import annotations

import torch

from lowbit.numerics.ggml_kquant_search import _row_sum

#: the grid: -(nmax + t) / v, t = SPAN * nmax * i / STEPS for i = -STEPS .. STEPS
SPAN = 0.75
STEPS = 24
#: the order the candidates are tried in (the first of equal gains wins)
CANDIDATES = (0, *(i for i in range(-STEPS, STEPS + 1) if i))


def candidate_numerators(nmax: int) -> list[float]:
    """-(nmax + SPAN nmax i / STEPS) for i in CANDIDATES, in that order (Python floats: torch rounds
    each to float32 when it divides by a float32 tensor, as (1 / v) * numerator)."""
    return [-(nmax + SPAN * nmax * i / STEPS) for i in CANDIDATES]


def direct_symmetric_search(x: torch.Tensor, nmax: int, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks x [S, n] weighted by w [S, n] (module docstring): (scale [S], codes [S, n] in
    0 .. 2 nmax - 1, i.e. l + nmax). A block of zeros (max |x| < 1e-15) gets scale 0 and codes 0,
    as llama.cpp's. The reference definition, float32 operation by operation: v the signed value of
    the first largest |x|; per candidate (``candidate_numerators``, in order) isc = numerator / v,
    l = clamp(round(isc x), -nmax, nmax - 1), slx and sl2 the in-order float32 sums of (w x) l and
    (w l) l, and where sl2 > 0 the gain (slx / sl2) slx replaces the best when strictly larger
    (lowbit.kernels.ggml.direct_search: the same bits in C)."""
    amax = x.abs().amax(dim=1)
    v = x.gather(1, x.abs().argmax(dim=1, keepdim=True)).squeeze(1)
    zero = amax < 1e-15
    v = torch.where(zero, torch.ones_like(v), v)
    xt, wt = x.t().contiguous(), w.t().contiguous()                    # [n, S]
    wx = wt * xt
    best = torch.full_like(v, -1.0)
    scale = torch.zeros_like(v)
    codes = torch.zeros_like(xt)
    for num in candidate_numerators(nmax):
        isc = num / v
        l = torch.round(isc[None] * xt).clamp(-nmax, nmax - 1)
        slx, sl2 = _row_sum(wx * l), _row_sum(wt * l * l)
        ok = sl2 > 0
        sc = torch.where(ok, slx / torch.where(ok, sl2, torch.ones_like(sl2)), torch.zeros_like(sl2))
        gain = torch.where(ok, sc * slx, torch.full_like(sl2, -1.0))  # error = sum(w x^2) - gain
        better = gain > best
        best = torch.where(better, gain, best)
        scale = torch.where(better, sc, scale)
        codes = torch.where(better[None], l, codes)
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    codes = torch.where(zero[None], torch.zeros_like(codes), codes + nmax)
    return scale, codes.t().to(torch.int64)


def encode_blocks_direct(x: torch.Tensor, kind, importance: torch.Tensor, name: str, search=None) -> torch.Tensor:
    """Q4_0 / Q5_0 blocks of ``x`` [..., K] by ``direct_symmetric_search`` weighted by
    ``importance`` [K] alone; llama.cpp's bytes layout (the scale as fp16, the codes of the
    search). ``search``: an implementation of that function with its contract and bits (None: it).
    Other types: ``ValueError`` (the caller dispatches, ``lowbit.numerics.ggml.encode``)."""
    from lowbit.numerics import ggml_blocks as gb
    from lowbit.numerics.ggml import DIRECT_TYPES, GgmlType, fp16_bytes
    from lowbit.numerics.ggml_kquant_imatrix import check_importance

    kind = GgmlType(kind)
    if kind not in DIRECT_TYPES:
        raise ValueError(f"the direct importance search encodes Q4_0 and Q5_0, not {kind.name}")
    k = x.shape[-1]
    gb.weights_in_rows(x, 32, name)                                    # whole blocks, finite weights
    check_importance(importance, k, name)
    lead = x.shape[:-1]
    b = x.detach().to(torch.float32).reshape(-1, 32)
    w = importance.to(torch.float32).reshape(1, -1).expand(b.numel() // k, -1).reshape(-1, 32)
    five = kind is GgmlType.Q5_0
    d, q = (search or direct_symmetric_search)(b, 16 if five else 8, w)
    head = [fp16_bytes(d)] + ([gb.fifth_bits(q)] if five else [])
    return torch.cat(head + [gb.pack_nibbles(q)], dim=1).reshape(*lead, -1)
