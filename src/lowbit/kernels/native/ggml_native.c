/* lowbit native kernels for GGML's types: the importance-weighted direct scale search of Q4_0 / Q5_0
 * (lowbit.numerics.ggml_direct.direct_symmetric_search) and GPTQ's column loop on a fixed GGML grid
 * inside one block (lowbit.algorithms.gptq_grid.gptq_on_grid). Compiled into the same library as
 * lowbit_native.c (build.py), with the same flags: no -ffast-math, no FMA contraction; every float
 * operation below is the one IEEE float32 operation the torch code performs, in its order
 * (bit-identical, tests/kernels/test_ggml_native.py). The only fused multiply-adds are explicit
 * fmaf calls where torch's addr_ fuses. */
#include "lowbit_native.h"
#include <stdlib.h>

/* ---------------------------------------------------------------- the direct search
 * Blocks are processed LANES at a time, one block per lane (the torch code's [n, S] layout, a
 * block per column): the inner loops over lanes vectorize, and each lane's sums run over the n
 * elements in order, one float32 addition at a time, as _row_sum adds rows. */
#define LANES 16
#define DIRECT_MAX_N 64

/* round half to even under the default rounding mode, the sign of a zero kept (torch.round) */
static inline float round_even(float y) { return nearbyintf(y); }

static inline float clampf(float y, float lo, float hi) { return y < lo ? lo : (y > hi ? hi : y); }

/* The direct search on blocks x, w [S, n] (row-major, n <= DIRECT_MAX_N), the candidates' negated
 * numerators -(nmax + t_i) in float32 in the torch code's order (ncand of them, the first wins a
 * tie): scale[S] and codes[S, n] (uint8, l + nmax; a zero block: scale 0 and codes 0).
 * Per block: v the signed value of the first largest |x|; the block is zero when max |x| < 1e-15f;
 * else for each candidate isc = (1 / v) * negnum (two roundings, as torch's scalar / tensor),
 * l = clamp(round(isc x), -nmax, nmax - 1), slx = sum (w x) l, sl2 = sum (w l) l in order; where
 * sl2 > 0, sc = slx / sl2 and the gain sc * slx replaces the best so far (-1 at first) when
 * strictly larger. Returns 1 (nothing written) when x holds NaN or Inf, -1 for n out of range,
 * else 0. */
int lb_direct_search(const float *x, const float *w, int64_t S, int64_t n, int32_t nmax, const float *negnum,
                     int32_t ncand, float *scale, uint8_t *codes) {
    if (n < 1 || n > DIRECT_MAX_N) return -1;
    for (int64_t i = 0; i < S * n; i++)
        if (!isfinite(x[i])) return 1;
    const float lo = (float)-nmax, hi = (float)(nmax - 1), fn = (float)nmax;
    float xt[DIRECT_MAX_N][LANES], wt[DIRECT_MAX_N][LANES], wx[DIRECT_MAX_N][LANES];
    for (int64_t s0 = 0; s0 < S; s0 += LANES) {
        int64_t nb = S - s0 < LANES ? S - s0 : LANES;
        float v[LANES], rv[LANES], best[LANES], sc_best[LANES], isc_best[LANES];
        int zero[LANES];
        for (int b = 0; b < LANES; b++) {
            float amax = 0.0f, vb = 0.0f;
            for (int64_t k = 0; k < n; k++) {
                float xv = b < nb ? x[(s0 + b) * n + k] : 0.0f;
                xt[k][b] = xv;
                wt[k][b] = b < nb ? w[(s0 + b) * n + k] : 0.0f;
                if (fabsf(xv) > amax) { amax = fabsf(xv); vb = xv; }  /* the first largest */
            }
            zero[b] = amax < 1e-15f;
            v[b] = zero[b] ? 1.0f : vb;
            rv[b] = 1.0f / v[b];
            best[b] = -1.0f;
            sc_best[b] = 0.0f;
            isc_best[b] = 0.0f;
        }
        for (int64_t k = 0; k < n; k++)
            for (int b = 0; b < LANES; b++) wx[k][b] = wt[k][b] * xt[k][b];
        for (int32_t c = 0; c < ncand; c++) {
            float isc[LANES], slx[LANES], sl2[LANES];
            for (int b = 0; b < LANES; b++) {
                isc[b] = rv[b] * negnum[c];
                float l = clampf(round_even(isc[b] * xt[0][b]), lo, hi);
                slx[b] = wx[0][b] * l;
                sl2[b] = (wt[0][b] * l) * l;
            }
            for (int64_t k = 1; k < n; k++) {
                for (int b = 0; b < LANES; b++) {
                    float l = clampf(round_even(isc[b] * xt[k][b]), lo, hi);
                    float a = wx[k][b] * l, q = wt[k][b] * l;
                    q = q * l;
                    slx[b] = slx[b] + a;
                    sl2[b] = sl2[b] + q;
                }
            }
            for (int b = 0; b < LANES; b++) {
                int ok = sl2[b] > 0.0f;
                float sc = ok ? slx[b] / sl2[b] : 0.0f;
                float gain = ok ? sc * slx[b] : -1.0f;
                int better = gain > best[b];
                best[b] = better ? gain : best[b];
                sc_best[b] = better ? sc : sc_best[b];
                isc_best[b] = better ? isc[b] : isc_best[b];  /* its codes are recomputed below */
            }
        }
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *q = codes + (s0 + b) * n;
            if (zero[b]) {
                scale[s0 + b] = 0.0f;
                for (int64_t k = 0; k < n; k++) q[k] = 0;
                continue;
            }
            scale[s0 + b] = sc_best[b];  /* never better: 0 and l = 0 (isc 0) */
            for (int64_t k = 0; k < n; k++)
                q[k] = (uint8_t)(int)(clampf(round_even(isc_best[b] * xt[k][b]), lo, hi) + fn);
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- GPTQ on a GGML grid
 * One block of n columns (rows of the transposed weight, R floats each; row stride R): for
 * i = 0..n-1, c = clamp(round((w_i + offset_i) / div_i) + zero, lo, hi), fill where the step is zero;
 * q = step_i * (c - zero) - offset_i; e_i = w_i - q; then w_k += u[j0 + i, j0 + k] e_i for k > i
 * (torch's addr_: one fused multiply-add where its vector loop runs, two roundings in its scalar
 * tail, the last (length mod vec) elements of the contiguous run it iterates: the row, or for
 * R == 1 the n - i - 1 rows updated, a run only where u's row is contiguous, ld1 == 1, else all of
 * them are its scalar loop). The updates of each element are applied in the order of i,
 * so visiting the row in tiles, all columns per tile, gives the same values. */
#define TILE 128

static inline float addr_one(float w, float u, float e, int fused) {
    if (fused) return fmaf(u, e, w);
    float p = u * e;
    return w + p;
}

/* Columns [r0, r1) of block row i, whose updated weights are acc: its codes, errors and final weights
 * (the loop vectorizes: restrict pointers, no branches). */
static void grid_round(const lb_grid_args *g, int64_t i, int64_t r0, int64_t r1, const float *restrict acc) {
    const int64_t o = i * g->R;
    const float *restrict off = g->offset + o, *restrict dv = g->div + o, *restrict st = g->step + o;
    const uint8_t *restrict zm = g->zmask + o;
    float *restrict W = g->W + o, *restrict C = g->C + o, *restrict E = g->E + o;
    const float zero = g->zero, lo = g->lo, hi = g->hi, fill = g->fill;
    for (int64_t r = r0; r < r1; r++) {
        float w = acc[r - r0];
        float y = w + off[r];
        y = y / dv[r];
        float c = round_even(y) + zero;
        c = c < lo ? lo : (c > hi ? hi : c);
        c = zm[r] ? fill : c;
        float q = c - zero;
        q = st[r] * q;
        q = q - off[r];
        W[r] = w;
        C[r] = c;
        E[r] = w - q;
    }
}

/* Returns 0, or -1 when scratch memory is unavailable (nothing written). */
int lb_grid_gptq(const lb_grid_args *g) {
    const int64_t n = g->n, R = g->R, vec = g->vec > 0 ? g->vec : 1;
    float *cu = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (cu == NULL) return -1;
    const int64_t ld0 = g->ld0, ld1 = g->ld1;
    const float *u = g->u + g->j0 * ld0 + g->j0 * ld1;
    if (R == 1) {  /* the update runs along the n - i - 1 rows: its tail is the last rows */
        for (int64_t i = 0; i < n; i++) {
            float w = g->W[i];
            for (int64_t p = 0; p < i; p++) {
                int64_t K = n - p - 1, kk = i - p - 1;
                w = addr_one(w, u[p * ld0 + i * ld1], g->E[p], ld1 == 1 && kk < K - K % vec);
            }
            grid_round(g, i, 0, 1, &w);
        }
        free(cu);
        return 0;
    }
    const int64_t fused_end = R - R % vec;  /* elements of a row from here on: two roundings */
    for (int64_t r0 = 0; r0 < R; r0 += TILE) {
        const int64_t r1 = r0 + TILE < R ? r0 + TILE : R;
        const int64_t f1 = fused_end < r0 ? r0 : (fused_end < r1 ? fused_end : r1);
        for (int64_t i = 0; i < n; i++) {
            float acc[TILE];
            const float *wi = g->W + i * R;
            for (int64_t r = r0; r < r1; r++) acc[r - r0] = wi[r];
            for (int64_t p = 0; p < i; p++) cu[p] = u[p * ld0 + i * ld1];
            if (f1 - r0 == TILE) {  /* a whole fused tile: constant trip count, acc kept in registers */
                for (int64_t p = 0; p < i; p++) {
                    const float c = cu[p], *e = g->E + p * R + r0;
                    for (int k = 0; k < TILE; k++) acc[k] = fmaf(c, e[k], acc[k]);
                }
            } else {
                for (int64_t p = 0; p < i; p++) {
                    const float c = cu[p], *e = g->E + p * R;
                    for (int64_t r = r0; r < f1; r++) acc[r - r0] = fmaf(c, e[r], acc[r - r0]);
                    for (int64_t r = f1; r < r1; r++) acc[r - r0] = addr_one(acc[r - r0], c, e[r], 0);
                }
            }
            grid_round(g, i, r0, r1, acc);
        }
    }
    free(cu);
    return 0;
}
