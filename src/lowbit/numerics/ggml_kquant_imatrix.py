"""llama.cpp's importance-weighted k-quant encodings (an importance matrix's per-column weights,
``llama-imatrix``'s mean squared activations): Q4_K, Q5_K and Q6_K as ``quantize_q4_K`` /
``quantize_q5_K`` / ``quantize_q6_K`` with quant_weights.

Byte-identical to llama.cpp's C under the same conditions as ``ggml_kquant_search`` (sequential
float32 sums, IEEE divisions, no FMA): bench/gguf/RESULTS-gguf.md, and in CI against the C's
bytes stored in tests/numerics/data/kquant_reference.safetensors.
"""

from __future__ import annotations

import torch

from lowbit.errors import QuantizationError
from lowbit.numerics.ggml_kquant_search import SUB, _pack_scale_min, _rdiv, _row_sum, _seq_sum, scale_min_search, sqrt32
from lowbit.numerics.ggml_kquants import SUPER


def qp_search(v: torch.Tensor, w: torch.Tensor, nmax: int = 63) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's ``make_qp_quants``: the non-negative values v [S, n] (a super-block's sub-block
    scales or mins) as codes 0..nmax times one scale, weighted by w: the grid nmax / max and 8
    neighbours (nmax + 0.1 k) / max, k = -4..4, by weighted squared error (first on a tie), then up
    to five in-order passes moving one code when sumlx^2 / suml2 grows. (scale [S], codes [S, n]
    as the C's uint8 holds them.)"""
    mx = torch.clamp(v.amax(dim=1), min=0.0)
    zero = mx < 1e-15
    mx = torch.where(zero, torch.ones_like(mx), mx)
    v, w = v.t().contiguous(), w.t().contiguous()                      # [n, S]: sums run over rows in order

    def mse(isc: torch.Tensor) -> torch.Tensor:
        l = torch.clamp(torch.round(isc[None] * v), max=nmax)
        diff = v - _rdiv(1.0, isc)[None] * l
        return _row_sum(w * diff * diff)

    iscale = _rdiv(nmax, mx)
    diff = v - _rdiv(1.0, iscale)[None] * torch.round(iscale[None] * v)  # the first grid: no clamp
    best = _row_sum(w * diff * diff)
    for k in (-4, -3, -2, -1, 1, 2, 3, 4):
        isc = (torch.tensor(0.1, dtype=torch.float32) * k + nmax) / mx
        cur = mse(isc)
        better = cur < best
        best = torch.where(better, cur, best)
        iscale = torch.where(better, isc, iscale)
    L = torch.clamp(torch.round(iscale[None] * v), max=nmax)
    L = (L.to(torch.int64) & 0xFF).to(torch.float32)                   # uint8_t L[]
    sumlx, suml2 = _row_sum(w * v * L), _row_sum(w * L * L)
    for _ in range(5):
        for i in range(v.shape[0]):
            wi, xi, li = w[i], v[i], L[i]
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            ok = (slx > 0) & (sl2 > 0)
            new = torch.clamp(torch.round(xi * sl2 / torch.where(ok, slx, torch.ones_like(slx))), max=nmax)
            slx2 = slx + wi * xi * new
            sl22 = sl2 + wi * new * new
            take = ok & (new != li) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
            L[i] = torch.where(take, (new.to(torch.int64) & 0xFF).to(torch.float32), li)
            sumlx = torch.where(take, slx2, sumlx)
            suml2 = torch.where(take, sl22, suml2)
    scale = torch.where(suml2 > 0, sumlx / torch.where(suml2 > 0, suml2, torch.ones_like(suml2)),
                        torch.zeros_like(suml2))
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    return scale, torch.where(zero[None], torch.zeros_like(L), L).t().to(torch.int64)


def check_importance(importance: torch.Tensor, k: int, name: str) -> None:
    """Importance weights are [k] (one per input column), finite and non-negative, or a
    QuantizationError naming the tensor."""
    if importance.shape != (k,):
        raise QuantizationError(f"tensor {name!r}: importance weights must be [{k}] (one per input column), got "
                                f"{list(importance.shape)}")
    if not bool(torch.isfinite(importance).all()) or bool((importance < 0).any()):
        raise QuantizationError(f"tensor {name!r}: importance weights must be finite and non-negative")


def column_weights(x: torch.Tensor, importance: torch.Tensor, name: str) -> torch.Tensor:
    """The importance weight of every weight of ``x`` [..., K] as [N, 256] per super-block (one
    weight per input column, repeated over the rows); a QuantizationError naming the tensor if
    ``importance`` is not [K], finite and non-negative."""
    k = x.shape[-1]
    check_importance(importance, k, name)
    rows = x.reshape(-1, k).shape[0]
    return importance.to(torch.float32).reshape(1, -1, SUPER).expand(rows, -1, -1).reshape(-1, SUPER)


def encode_scale_min_weighted(x: torch.Tensor, importance: torch.Tensor, name: str, five: bool) -> torch.Tensor:
    """llama.cpp's ``quantize_row_q4_K_impl`` / ``quantize_row_q5_K_impl`` with importance weights
    (``quantize_q4_K`` / ``quantize_q5_K`` given an importance matrix): sub-block weights
    ``qw * sqrt(sigma2 + x^2)`` (sigma2 = 2 mean(x^2) of the super-block), the finer search (from
    -0.9 in 36 steps of 0.05), and the 6-bit scales and mins chosen by ``qp_search`` weighted by
    each sub-block's total weight (Q5_K's capped at 63)."""
    lead = x.shape[:-1]
    qw = column_weights(x, importance, name)
    sb = x.reshape(-1, SUPER)                                          # [N, 256]
    sigma2 = 2 * _seq_sum(sb * sb) / SUPER
    w = (qw * sqrt32(sigma2[:, None] + sb * sb)).reshape(-1, SUB)
    sub = sb.reshape(-1, SUB)
    scales, mins, q = scale_min_search(sub, w, nmax=31 if five else 15, rmin=-0.9, rdelta=0.05, nstep=36)
    sw = _seq_sum(w).reshape(-1, 8)
    d_block, ls = qp_search(scales.reshape(-1, 8), sw)
    m_block, lm = qp_search(mins.reshape(-1, 8), sw)
    if five:
        ls, lm = ls.clamp(max=63), lm.clamp(max=63)
    return _pack_scale_min(x, lead, ls, lm, d_block, m_block, q.reshape(-1, 8, SUB), five=five)


def encode_q2_k_weighted(x: torch.Tensor, importance: torch.Tensor, name: str) -> torch.Tensor:
    """llama.cpp's ``quantize_row_q2_K_impl`` (``quantize_q2_K`` given an importance matrix):
    sub-blocks of 16 weighted ``qw * sqrt(sigma2 + x^2)`` (sigma2 = mean(x^2) of the super-block),
    the finer search with squared error (nmax 3, from -0.9 in 36 steps of 0.05), 4-bit scales and
    mins by ``qp_search`` (nmax 15) weighted by each sub-block's total weight, every weight re-rounded."""
    from lowbit.numerics.ggml_kquant_search import _fp16_pair, pack_q2_k

    lead = x.shape[:-1]
    qw = column_weights(x, importance, name)
    sb = x.reshape(-1, SUPER)
    sigma2 = _seq_sum(sb * sb) / SUPER
    w = (qw * sqrt32(sigma2[:, None] + sb * sb)).reshape(-1, 16)
    sub = sb.reshape(-1, 16)
    scales, mins, q = scale_min_search(sub, w, nmax=3, rmin=-0.9, rdelta=0.05, nstep=36)
    sw = _seq_sum(w).reshape(-1, 16)
    dm, ls = qp_search(scales.reshape(-1, 16), sw, nmax=15)
    mm, lm = qp_search(mins.reshape(-1, 16), sw, nmax=15)
    sc_bytes = (ls | (lm << 4)) & 0xFF
    d_bytes, d = _fp16_pair(dm)
    m_bytes, dmin = _fp16_pair(mm)
    return pack_q2_k(x, lead, sc_bytes, d_bytes, d, m_bytes, dmin, q.reshape(-1, 16, 16))


def encode_q3_k_weighted(x: torch.Tensor, importance: torch.Tensor, name: str) -> torch.Tensor:
    """llama.cpp's ``quantize_row_q3_K_impl`` (``quantize_q3_K`` given an importance matrix):
    sub-blocks of 16 by the symmetric search (nmax 4) weighted ``qw * sqrt(sigma2 + x^2)``
    (sigma2 = 2 mean(x^2) of the super-block), their scales to 6 bits by the same search (nmax 32)
    weighted by each sub-block's total weight, every weight re-rounded to them."""
    from lowbit.numerics.ggml_kquant_search import pack_q3_k, symmetric_search

    lead = x.shape[:-1]
    qw = column_weights(x, importance, name)
    sb = x.reshape(-1, SUPER)
    sigma2 = 2 * _seq_sum(sb * sb) / SUPER
    w = (qw * sqrt32(sigma2[:, None] + sb * sb)).reshape(-1, 16)
    scales, codes = symmetric_search(sb.reshape(-1, 16), nmax=4, qw=w)
    d_block, l6 = symmetric_search(scales.reshape(-1, 16), nmax=32, qw=_seq_sum(w).reshape(-1, 16))
    return pack_q3_k(x, lead, l6, d_block.to(torch.float16), codes.reshape(-1, 16, 16))


def encode_blocks_weighted(x: torch.Tensor, kind, importance: torch.Tensor, name: str) -> torch.Tensor:
    """llama.cpp's ``quantize_row_q4_0_impl`` ... ``q5_1_impl`` (``quantize_q4_0`` ... with an
    importance matrix): blocks of 32 weighted ``qw * sqrt(sigma2 + x^2)`` (sigma2 = mean(x^2) of
    the whole row); Q4_0 / Q5_0 by the symmetric search (nmax 8 / 16), Q4_1 / Q5_1 by the finer
    scale/min search (from -0.9 in 36 steps of 0.05); the codes of the search, no re-rounding.
    Q8_0 takes no importance weights in llama.cpp: its reference encoding."""
    from lowbit.numerics import ggml_blocks as gb
    from lowbit.numerics.ggml import GgmlType, fp16_bytes
    from lowbit.numerics.ggml_kquant_search import symmetric_search

    kind = GgmlType(kind)
    if kind is GgmlType.Q8_0:
        return gb.encode(x, kind, name)
    k = x.shape[-1]
    gb.weights_in_rows(x, 32, name)                                    # whole blocks, finite weights
    check_importance(importance, k, name)
    lead = x.shape[:-1]
    rows = x.detach().to(torch.float32).reshape(-1, k)                 # [R, K]
    sigma2 = _seq_sum(rows * rows) / k
    b = rows.reshape(-1, 32)
    qw = importance.to(torch.float32).reshape(1, -1).expand(rows.shape[0], -1).reshape(-1, 32)
    w = qw * sqrt32(sigma2.repeat_interleave(k // 32)[:, None] + b * b)
    five = kind in (GgmlType.Q5_0, GgmlType.Q5_1)
    if kind in (GgmlType.Q4_0, GgmlType.Q5_0):
        d, q = symmetric_search(b, nmax=16 if five else 8, qw=w)
        head = [fp16_bytes(d)]
    else:
        d, neg_min, q = scale_min_search(b, w, nmax=31 if five else 15, rmin=-0.9, rdelta=0.05, nstep=36)
        head = [fp16_bytes(d), fp16_bytes(-neg_min)]
    if five:
        head.append(gb.fifth_bits(q))
    return torch.cat(head + [gb.pack_nibbles(q)], dim=1).reshape(*lead, -1)
