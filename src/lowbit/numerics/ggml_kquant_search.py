"""llama.cpp's reference searches of the k-quants and the encodings of Q2_K to Q6_K with them.

``Q4_K`` (``quantize_row_q4_K_ref``): each sub-block of 32 weights gets a scale and a min from a
weighted least-squares search over 21 candidate grids (``scale_min_search``, llama.cpp's
``make_qkx2_quants`` with nmax 15, rmin -1, rdelta 0.1, 20 steps; weights ``sqrt(mean(x^2)) +
|x|``; Q5_K: nmax 31, rmin -0.5, 15 steps, the codes' fifth bits in ``qh``); the super-block's eight scales and mins are then quantized to 6 bits against
``d = max scale / 63`` and ``dmin = max min / 63`` (fp16), and every weight is re-rounded to the
stored scale and min. ``Q6_K``: sub-blocks of 16 with a symmetric scale (``symmetric_search``,
llama.cpp's ``make_qx_quants``, weights x^2), stored as int8 against an fp16 d.

Byte-identical to llama.cpp's C only if the arithmetic is the same: every sum here runs
sequentially over the 32 weights in float32 (vectorized across sub-blocks, never reduced
pairwise), products are rounded before they are added (a C build that contracts them into FMAs,
e.g. compiled for the host with ``-march=native``, can round differently), ``nearest_int`` is
round-to-nearest-even (as its 1.5 * 2^23 trick is). Checked against llama.cpp's
``libggml-base`` (bench/gguf/RESULTS-gguf.md) and in CI against reference bytes it wrote
(tests/numerics/test_ggml_kquant_search.py).
"""

from __future__ import annotations

import torch

from lowbit.numerics.ggml import fp16_bytes, fp16_value, weights_in_rows
from lowbit.numerics.ggml_kquants import SUPER

SUB = 32


def _rdiv(a: float, t: torch.Tensor) -> torch.Tensor:
    """a / t as IEEE float32 division. (``a / t`` with a Python number is not: torch computes it
    as ``a * reciprocal(t)``, which rounds twice and differs from C's ``a / t`` for about a
    quarter of the values.)"""
    return torch.full_like(t, a) / t


def sqrt32(t: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 square root, as C's sqrtf. (torch's float32 sqrt on a vectorized CPU
    path is off by one ulp for about 0.7% of values; the float64 root rounded to float32 is exact.)"""
    return torch.sqrt(t.double()).float()


def _seq_sum(terms: torch.Tensor) -> torch.Tensor:
    """sum over the last dimension [S, n] in order, float32, one element at a time."""
    return _row_sum(terms.t().contiguous())


def _row_sum(terms: torch.Tensor) -> torch.Tensor:
    """sum over the first dimension [n, S] in order, float32, one element at a time (each step
    adds a contiguous row: the searches below keep their sub-blocks in this layout)."""
    acc = terms[0].clone()
    for i in range(1, terms.shape[0]):
        acc.add_(terms[i])
    return acc


def scale_min_search(x: torch.Tensor, w: torch.Tensor, nmax: int = 15, rmin: float = -1.0, rdelta: float = 0.1,
                     nstep: int = 20, mad: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's ``make_qkx2_quants`` on sub-blocks x, w [S, n] (squared error, or absolute with
    ``mad``): (scale [S], min [S] (as stored: -min, >= 0), codes [S, n] in 0..nmax)."""
    f32 = torch.float32
    x, w = x.t().contiguous(), w.t().contiguous()                      # [n, S]: sums run over rows in order
    lo = torch.clamp(x.amin(dim=0), max=0.0)
    hi = x.amax(dim=0)
    sum_w = _row_sum(w)
    sum_x = _row_sum(w * x)
    flat = hi == lo
    span = torch.where(flat, torch.ones_like(hi), hi - lo)
    iscale = _rdiv(nmax, span)
    scale = _rdiv(1.0, iscale)

    def codes(isc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return torch.round(isc[None] * (x - m[None])).clamp(0, nmax)

    def error(sc: torch.Tensor, m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        diff = sc[None] * q + m[None] - x
        return _row_sum(w * (diff.abs() if mad else diff * diff))

    best_q = codes(iscale, lo)
    best = error(scale, lo, best_q)
    best_min = lo.clone()
    for step in range(nstep + 1):
        # the grid is laid from the best min so far (llama.cpp updates ``min`` as it goes)
        span = torch.where(flat, torch.ones_like(hi), hi - best_min)
        isc = (torch.tensor(rmin, dtype=f32) + torch.tensor(rdelta, dtype=f32) * step + nmax) / span
        q = codes(isc, best_min)
        wq = w * q
        sum_l, sum_l2, sum_xl = _row_sum(wq), _row_sum(wq * q), _row_sum(wq * x)
        d = sum_w * sum_l2 - sum_l * sum_l
        ok = d > 0
        safe = torch.where(ok, d, torch.ones_like(d))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        pos = this_min > 0
        this_scale = torch.where(pos, sum_xl / torch.where(sum_l2 == 0, torch.ones_like(sum_l2), sum_l2), this_scale)
        this_min = torch.where(pos, torch.zeros_like(this_min), this_min)
        cur = error(this_scale, this_min, q)
        better = ok & (cur < best) & ~flat
        best_q = torch.where(better[None], q, best_q)
        best = torch.where(better, cur, best)
        scale = torch.where(better, this_scale, scale)
        best_min = torch.where(better, this_min, best_min)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    best_q = torch.where(flat[None], torch.zeros_like(best_q), best_q)
    return scale, -best_min, best_q.t().to(torch.uint8)


def _six_bits(v: torch.Tensor) -> torch.Tensor:
    """nearest_int, cast to uint8 (two's complement wrap), at most 63: as the C stores a 6-bit scale."""
    return torch.clamp(torch.round(v).to(torch.int64) & 0xFF, max=63)


def _fp16_pair(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v's fp16 bytes and the float32 value they hold (the scale the weights are re-rounded to)."""
    b = fp16_bytes(v)
    return b, fp16_value(b)


def _encode_scale_min(x: torch.Tensor, name: str, five: bool) -> torch.Tensor:
    """Q4_K (``five`` False: 4-bit codes, search from -1 in 20 steps) or Q5_K (5-bit codes, from
    -0.5 in 15 steps): llama.cpp's ``quantize_row_q4_K_ref`` / ``quantize_row_q5_K_ref``."""
    x = _checked(x, name)
    nmax = 31 if five else 15
    lead = x.shape[:-1]
    sub = x.reshape(-1, SUB)                                           # [N * 8, 32]
    av = sqrt32(_seq_sum(sub * sub) / 32)
    scales, mins, q = scale_min_search(sub, av[:, None] + sub.abs(), nmax=nmax, rmin=-0.5 if five else -1.0,
                                       nstep=15 if five else 20)
    scales, mins, q = scales.reshape(-1, 8), mins.reshape(-1, 8), q.reshape(-1, 8, SUB)
    zero = torch.zeros((), dtype=torch.float32)
    # the largest above 0, else +0 (a flat sub-block's min is -0.0: clamp would keep the sign)
    max_scale = torch.where(scales.amax(dim=1) > 0, scales.amax(dim=1), zero)
    max_min = torch.where(mins.amax(dim=1) > 0, mins.amax(dim=1), zero)
    inv_scale = torch.where(max_scale > 0, _rdiv(63.0, torch.where(max_scale > 0, max_scale, 1.0)), zero)
    inv_min = torch.where(max_min > 0, _rdiv(63.0, torch.where(max_min > 0, max_min, 1.0)), zero)
    ls, lm = _six_bits(inv_scale[:, None] * scales), _six_bits(inv_min[:, None] * mins)   # [N, 8]
    return _pack_scale_min(x, lead, ls, lm, max_scale / 63.0, max_min / 63.0, q, five)


def _pack_scale_min(x: torch.Tensor, lead, ls: torch.Tensor, lm: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor,
                    q: torch.Tensor, five: bool) -> torch.Tensor:
    """The Q4_K / Q5_K super-blocks: 6-bit scales ``ls`` and mins ``lm`` [N, 8] packed, d and dmin
    in fp16, every weight re-rounded to its stored scale and min (``q`` [N, 8, 32] kept where the
    stored scale is 0), the codes packed."""
    nmax = 31 if five else 15
    packed = torch.zeros(ls.shape[0], 12, dtype=torch.int64)
    packed[:, 0:4], packed[:, 4:8] = ls[:, :4], lm[:, :4]
    packed[:, 8:12] = (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)
    packed[:, 0:4] |= (ls[:, 4:] >> 4) << 6
    packed[:, 4:8] |= (lm[:, 4:] >> 4) << 6
    d_bytes, d = _fp16_pair(d)
    m_bytes, dmin = _fp16_pair(dmin)
    dsub = d[:, None] * ls.to(torch.float32)                           # [N, 8]
    dm = dmin[:, None] * lm.to(torch.float32)
    requant = torch.round((x.reshape(-1, 8, SUB) + dm[:, :, None]) / torch.where(dsub == 0, 1.0, dsub)[:, :, None])
    q = torch.where((dsub == 0)[:, :, None], q.to(torch.float32), requant.clamp(0, nmax)).to(torch.int64)
    q = q.reshape(-1, 4, 2, SUB)                                       # chunks of 64: low nibbles, then high
    qs = ((q[:, :, 0] & 0x0F) | ((q[:, :, 1] & 0x0F) << 4)).reshape(-1, 128)
    head = [d_bytes, m_bytes, packed.to(torch.uint8)]
    if five:  # byte j: bit 2c is the fifth bit of chunk c's low-nibble weight j, bit 2c + 1 of its high one
        bits = (q >> 4) & 1                                            # [N, chunk, half, 32]
        shift = torch.arange(8, dtype=torch.int64).reshape(1, 4, 2, 1)
        head.append((bits << shift).sum(dim=(1, 2)).to(torch.uint8))
    out = torch.cat(head + [qs.to(torch.uint8)], dim=1)
    return out.reshape(*lead, -1)


def encode_q4_k(x: torch.Tensor, name: str = "tensor", importance: torch.Tensor | None = None) -> torch.Tensor:
    """llama.cpp's reference Q4_K encoding of ``x`` [..., K] (K a multiple of 256) -> uint8 [..., K / 256 * 144];
    with ``importance`` [K] (an importance matrix's per-column weights, llama-imatrix's mean squared
    activations) llama.cpp's weighted encoding instead (``quantize_q4_K`` with quant_weights)."""
    if importance is not None:
        from lowbit.numerics.ggml_kquant_imatrix import encode_scale_min_weighted

        return encode_scale_min_weighted(_checked(x, name), importance, name, five=False)
    return _encode_scale_min(x, name, five=False)


def encode_q5_k(x: torch.Tensor, name: str = "tensor", importance: torch.Tensor | None = None) -> torch.Tensor:
    """llama.cpp's reference Q5_K encoding of ``x`` [..., K] (K a multiple of 256) -> uint8 [..., K / 256 * 176];
    with ``importance`` [K], llama.cpp's weighted encoding (``quantize_q5_K`` with quant_weights)."""
    if importance is not None:
        from lowbit.numerics.ggml_kquant_imatrix import encode_scale_min_weighted

        return encode_scale_min_weighted(_checked(x, name), importance, name, five=True)
    return _encode_scale_min(x, name, five=True)


def encode_q2_k(x: torch.Tensor, name: str = "tensor", importance: torch.Tensor | None = None) -> torch.Tensor:
    """llama.cpp's reference Q2_K encoding (``quantize_row_q2_K_ref``) of ``x`` [..., K] (K a
    multiple of 256) -> uint8 [..., K / 256 * 84]: sub-blocks of 16 searched with absolute
    error and weights |x| (nmax 3, from -0.5 in 15 steps), their scales and mins to 4 bits
    against fp16 d and dmin, every weight re-rounded to them. With ``importance`` [K]: llama.cpp's
    weighted encoding (``quantize_q2_K`` with quant_weights)."""
    x = _checked(x, name)
    if importance is not None:
        from lowbit.numerics.ggml_kquant_imatrix import encode_q2_k_weighted

        return encode_q2_k_weighted(x, importance, name)
    lead = x.shape[:-1]
    sub = x.reshape(-1, 16)
    scales, mins, q = scale_min_search(sub, sub.abs(), nmax=3, rmin=-0.5, nstep=15, mad=True)
    scales, mins, q = scales.reshape(-1, 16), mins.reshape(-1, 16), q.reshape(-1, 16, 16)
    zero = torch.zeros((), dtype=torch.float32)
    max_scale = torch.where(scales.amax(dim=1) > 0, scales.amax(dim=1), zero)
    max_min = torch.where(mins.amax(dim=1) > 0, mins.amax(dim=1), zero)
    ls = torch.where(max_scale[:, None] > 0, torch.round(_rdiv(15.0, torch.where(max_scale > 0, max_scale, 1.0))[:, None]
                                                          * scales), zero).to(torch.int64)
    lm = torch.where(max_min[:, None] > 0, torch.round(_rdiv(15.0, torch.where(max_min > 0, max_min, 1.0))[:, None]
                                                        * mins), zero).to(torch.int64)
    sc_bytes = (ls & 0xFF) | ((lm << 4) & 0xFF)                       # as the C stores ints into bytes
    d_bytes, d = _fp16_pair(torch.where(max_scale > 0, max_scale / 15.0, zero))
    m_bytes, dmin = _fp16_pair(torch.where(max_min > 0, max_min / 15.0, zero))
    return pack_q2_k(x, lead, sc_bytes, d_bytes, d, m_bytes, dmin, q)


def pack_q2_k(x: torch.Tensor, lead, sc_bytes: torch.Tensor, d_bytes: torch.Tensor, d: torch.Tensor,
              m_bytes: torch.Tensor, dmin: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q2_K super-blocks from the scale bytes [N, 16] (low nibble scale, high nibble min), d and
    dmin (bytes and float32 values): every weight re-rounded to its stored scale and min (``q``
    [N, 16, 16] kept where the stored scale is 0), 2-bit codes in four runs of 32 per half."""
    dsub = d[:, None] * (sc_bytes & 0x0F).to(torch.float32)
    dm = dmin[:, None] * (sc_bytes >> 4).to(torch.float32)
    requant = torch.round((x.reshape(-1, 16, 16) + dm[:, :, None]) / torch.where(dsub == 0, 1.0, dsub)[:, :, None])
    L = torch.where((dsub == 0)[:, :, None], q.to(torch.float32), requant.clamp(0, 3)).to(torch.int64)
    L = L.reshape(-1, 2, 4, 32)                                        # halves of 128: four runs of 32
    qs = (L[:, :, 0] | (L[:, :, 1] << 2) | (L[:, :, 2] << 4) | (L[:, :, 3] << 6)).reshape(-1, 64)
    out = torch.cat([sc_bytes.to(torch.uint8), qs.to(torch.uint8), d_bytes, m_bytes], dim=1)
    return out.reshape(*lead, -1)


def _checked(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x`` as float32 [..., K], K a multiple of the super-block, every weight finite."""
    weights_in_rows(x, SUPER, name, "k-quant super-block")
    return x.detach().to(torch.float32)


def symmetric_search(x: torch.Tensor, nmax: int = 32, qw: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's ``make_qx_quants`` with weights x^2 (rmse_type 1) on sub-blocks x [S, n]:
    (scale [S], codes [S, n] in 0..2*nmax-1, i.e. l + nmax). The grid -nmax / v (v the first
    element of largest magnitude) and 18 neighbours -(nmax + 0.1 k) / v, k = -9..9, are tried; the
    one maximizing sumlx^2 / suml2 wins (the first on a tie)."""
    f32 = torch.float32
    amax = x.abs().amax(dim=1)
    v = x.gather(1, x.abs().argmax(dim=1, keepdim=True)).squeeze(1)
    zero = amax < 1e-15
    v = torch.where(zero, torch.ones_like(v), v)
    x = x.t().contiguous()                                             # [n, S]: sums run over rows in order
    w = x * x if qw is None else qw.t().contiguous()
    wx = w * x

    def grid(isc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        l = torch.round(isc[None] * x).clamp(-nmax, nmax - 1)
        return l, _row_sum(wx * l), _row_sum(w * l * l)

    l, sumlx, suml2 = grid(_rdiv(-nmax, v))
    scale = torch.where(suml2 != 0, sumlx / torch.where(suml2 != 0, suml2, torch.ones_like(suml2)),
                        torch.zeros_like(suml2))
    best = scale * sumlx
    best_l = l
    for k in [k for k in range(-9, 10) if k != 0]:
        isc = -(nmax + torch.tensor(0.1, dtype=f32) * k) / v
        lk, slx, sl2 = grid(isc)
        better = (sl2 > 0) & (slx * slx > best * sl2)
        best_l = torch.where(better[None], lk, best_l)
        scale = torch.where(better, slx / torch.where(sl2 > 0, sl2, torch.ones_like(sl2)), scale)
        best = torch.where(better, scale * slx, best)
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    codes = torch.where(zero[None], torch.zeros_like(best_l), best_l + nmax)
    return scale, codes.t().to(torch.int64)


def encode_q6_k(x: torch.Tensor, name: str = "tensor", importance: torch.Tensor | None = None) -> torch.Tensor:
    """llama.cpp's reference Q6_K encoding (``quantize_row_q6_K_ref``) of ``x`` [..., K] (K a multiple
    of 256) -> uint8 [..., K / 256 * 210]: sub-blocks of 16 scaled by ``symmetric_search``, their
    scales to int8 against d = -(the scale of largest magnitude) / 128 (fp16), every weight
    re-rounded to its stored scale, codes l + 32 in 6 bits. With ``importance`` [K]: the search
    weighted by it instead of x^2 (``quantize_q6_K`` with quant_weights)."""
    x = _checked(x, name)
    lead = x.shape[:-1]
    sub = x.reshape(-1, 16)
    qw = None
    if importance is not None:
        from lowbit.numerics.ggml_kquant_imatrix import column_weights

        qw = column_weights(x, importance, name).reshape(-1, 16)
    scales, codes = symmetric_search(sub, qw=qw)
    scales, codes = scales.reshape(-1, 16), codes.reshape(-1, 16, 16)
    pick = scales.abs().argmax(dim=1, keepdim=True)                      # the first of largest magnitude
    max_scale = scales.gather(1, pick).squeeze(1)
    empty = max_scale.abs() < 1e-15
    iscale = _rdiv(-128.0, torch.where(empty, torch.ones_like(max_scale), max_scale))
    d16 = _rdiv(1.0, iscale).to(torch.float16)
    q_sc = torch.clamp(torch.round(iscale[:, None] * scales), max=127).to(torch.int64)     # int8 values
    dsub = d16.to(torch.float32)[:, None] * q_sc.to(torch.float32)
    requant = torch.round(x.reshape(-1, 16, 16) / torch.where(dsub == 0, 1.0, dsub)[:, :, None]).clamp(-32, 31) + 32
    L = torch.where((dsub == 0)[:, :, None], codes.to(torch.float32), requant).to(torch.int64).reshape(-1, 2, 4, 32)
    ql = torch.cat([(L[:, :, 0] & 0x0F) | ((L[:, :, 2] & 0x0F) << 4),
                    (L[:, :, 1] & 0x0F) | ((L[:, :, 3] & 0x0F) << 4)], dim=2).reshape(-1, 128)
    qh = ((L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4) | ((L[:, :, 3] >> 4) << 6))
    out = torch.cat([ql.to(torch.uint8), qh.reshape(-1, 64).to(torch.uint8),
                     (q_sc & 0xFF).to(torch.uint8), d16.contiguous().view(torch.uint8).reshape(-1, 2)], dim=1)
    out[empty] = 0                                                       # an all-zero super-block: zero bytes
    return out.reshape(*lead, -1)


def refined_symmetric(x: torch.Tensor, nmax: int = 4, tries: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's ``make_q3_quants`` with do_rmse on sub-blocks x [S, n]: codes from the grid
    -nmax / v, then up to ``tries`` passes that move one code at a time, in order, to
    round(x * suml2' / sumlx') when that raises sumlx^2 / suml2 (weights x^2). Returns (scale [S],
    codes [S, n] in 0..2*nmax-1). A pass that changes nothing leaves a fixed point, so running all
    passes equals the C's early stop."""
    amax = x.abs().amax(dim=1)
    v = x.gather(1, x.abs().argmax(dim=1, keepdim=True)).squeeze(1)
    zero = amax < 1e-15
    v = torch.where(zero, torch.ones_like(v), v)
    x = x.t().contiguous()                                             # [n, S]: one row per position
    w = x * x
    L = torch.round(_rdiv(-nmax, v)[None] * x).clamp(-nmax, nmax - 1)
    sumlx, suml2 = _row_sum(w * x * L), _row_sum(w * L * L)
    for _ in range(tries):
        for i in range(x.shape[0]):
            wi, xi, li = w[i], x[i], L[i]
            slx = sumlx - wi * xi * li
            sl2 = suml2 - wi * li * li
            pos = slx > 0
            new = torch.round(xi * sl2 / torch.where(pos, slx, torch.ones_like(slx))).clamp(-nmax, nmax - 1)
            slx2 = slx + wi * xi * new
            sl22 = sl2 + wi * new * new
            take = pos & (new != li) & (sl22 > 0) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
            L[i] = torch.where(take, new, li)
            sumlx = torch.where(take, slx2, sumlx)
            suml2 = torch.where(take, sl22, suml2)
    scale = torch.where(suml2 > 0, sumlx / torch.where(suml2 > 0, suml2, torch.ones_like(suml2)),
                        torch.zeros_like(suml2))
    scale = torch.where(zero, torch.zeros_like(scale), scale)
    codes = torch.where(zero[None], torch.zeros_like(L), L + nmax)
    return scale, codes.t().to(torch.int64)


def encode_q3_k(x: torch.Tensor, name: str = "tensor", importance: torch.Tensor | None = None) -> torch.Tensor:
    """llama.cpp's reference Q3_K encoding (``quantize_row_q3_K_ref``) of ``x`` [..., K] (K a
    multiple of 256) -> uint8 [..., K / 256 * 110]: sub-blocks of 16 by ``refined_symmetric``,
    their scales to 6 bits (offset 32) against d = -(the scale of largest magnitude) / 32 (fp16),
    every weight re-rounded to its stored scale, codes l + 4: two bits in qs, the third in hmask.
    With ``importance`` [K]: llama.cpp's weighted encoding (``quantize_q3_K`` with quant_weights)."""
    x = _checked(x, name)
    if importance is not None:
        from lowbit.numerics.ggml_kquant_imatrix import encode_q3_k_weighted

        return encode_q3_k_weighted(x, importance, name)
    lead = x.shape[:-1]
    scales, codes = refined_symmetric(x.reshape(-1, 16))
    scales, codes = scales.reshape(-1, 16), codes.reshape(-1, 16, 16)
    max_scale = scales.gather(1, scales.abs().argmax(dim=1, keepdim=True)).squeeze(1)
    has = max_scale != 0
    iscale = _rdiv(-32.0, torch.where(has, max_scale, torch.ones_like(max_scale)))
    l6 = torch.round(iscale[:, None] * scales).clamp(-32, 31).to(torch.int64) + 32       # [N, 16]
    l6 = torch.where(has[:, None], l6, torch.zeros_like(l6))
    d16 = torch.where(has, _rdiv(1.0, iscale), torch.zeros_like(iscale)).to(torch.float16)
    return pack_q3_k(x, lead, l6, d16, codes)


def pack_q3_k(x: torch.Tensor, lead, l6: torch.Tensor, d16: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """Q3_K super-blocks from the 6-bit scales ``l6`` [N, 16] (offset 32) and d (float16 [N]):
    every weight re-rounded to its stored scale (``codes`` [N, 16, 16] in 0..7 kept where the
    stored scale is 0), the third bits in hmask, two bits in qs."""
    packed = torch.zeros(l6.shape[0], 12, dtype=torch.int64)
    packed[:, 0:8] = (l6[:, :8] & 0x0F) | ((l6[:, 8:] & 0x0F) << 4)
    j = torch.arange(16)
    for k in range(4):  # byte 8 + k: the top two bits of sub-blocks k, k + 4, k + 8, k + 12
        packed[:, 8 + k] = sum(((l6[:, jj] >> 4) << (2 * (jj // 4))) for jj in j[j % 4 == k].tolist())
    dsub = d16.to(torch.float32)[:, None] * (l6 - 32).to(torch.float32)
    requant = torch.round(x.reshape(-1, 16, 16) / torch.where(dsub == 0, 1.0, dsub)[:, :, None]).clamp(-4, 3) + 4
    L = torch.where((dsub == 0)[:, :, None], codes.to(torch.float32), requant).to(torch.int64).reshape(-1, SUPER)
    high = L > 3
    bits = high.to(torch.int64).reshape(-1, 8, 32) << torch.arange(8).reshape(1, 8, 1)     # weight o: bit o // 32
    hmask = bits.sum(dim=1)
    L = torch.where(high, L - 4, L).reshape(-1, 2, 4, 32)
    qs = (L[:, :, 0] | (L[:, :, 1] << 2) | (L[:, :, 2] << 4) | (L[:, :, 3] << 6)).reshape(-1, 64)
    out = torch.cat([hmask.to(torch.uint8), qs.to(torch.uint8), packed.to(torch.uint8),
                     d16.contiguous().view(torch.uint8).reshape(-1, 2)], dim=1)
    return out.reshape(*lead, -1)
