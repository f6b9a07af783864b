/* lowbit native kernels: GPTQ's column loop inside a sub-block (lowbit.algorithms.gptq_solve), compiled
 * into the same library as lowbit_native.c (build.py), with the same flags: no -ffast-math, no FMA
 * contraction (the fused multiply-adds below are explicit fmaf calls). */
#include "lowbit_native.h"

/* GPTQ's column loop inside one sub-block (lowbit.algorithms.gptq_solve.solve_columns, whose torch
 * loop it replaces operation for operation, in the same order: bit-identical, tested). The error
 * and the rank-1 update are fused multiply-adds (fmaf: one rounding), as torch's CPU kernels
 * for addcmul and addr_ compute them on FMA machines.
 * The parameters (lb_gptq_args, lowbit_native.h):
 * W, E: the sub-block's first working row and error row, m rows of R floats (row stride R);
 * dv, ef: the divisors and effective scales of those m columns, R floats a row, row stride ds
 * (R; 0 when every column has the same ones: per-channel scales). For i = 0..m-1:
 *   y = w_i / dv_i; y = nearest grid value; e_i = w_i - y * ef_i;
 *   for each part p (rows a[p]..b[p]) and k = i+1..m-1: w_k[a:b] += u_p[i, k] * e_i[a:b],
 * u_p: the part's -Ub [in, in] (row stride ld, up[p] is its address) from row and column j0,
 * the sub-block's first column. Rounding: lb_grid_round (lowbit_native.h). */
int lb_gptq_sub(const lb_gptq_args *args) {
    float *W = args->W, *E = args->E;
    const float *dv = args->dv, *ef = args->ef;
    const int64_t ds = args->ds, m = args->m, R = args->R, nparts = args->nparts, ld = args->ld, j0 = args->j0;
    const int64_t *a = args->a, *b = args->b, *up = args->up;
    const int kind = args->kind;
    const float lo = args->lo, hi = args->hi;
    const uint32_t mask = args->mask, lowest = args->lowest, shift = args->shift;
    for (int64_t i = 0; i < m; i++) {
        float *w = W + i * R, *e = E + i * R;
        const float *d = dv + i * ds, *f = ef + i * ds;
        for (int64_t r = 0; r < R; r++) {
            float y = lb_grid_round(w[r] / d[r], kind, lo, hi, mask, lowest, shift);
            e[r] = fmaf(-y, f[r], w[r]);  /* w - y * f, one rounding */
        }
        for (int64_t p = 0; p < nparts; p++) {
            const float *u = (const float *)(intptr_t)up[p] + (j0 + i) * ld + j0;
            for (int64_t k = i + 1; k < m; k++) {
                float c = u[k], *wk = W + k * R;
                for (int64_t r = a[p]; r < b[p]; r++) wk[r] = fmaf(c, e[r], wk[r]);
            }
        }
    }
    return 0;
}
