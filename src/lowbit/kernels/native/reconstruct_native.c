/* lowbit native kernels: block reconstruction's rounded weight and offset step
 * (lowbit.algorithms.reconstruct_offsets, fixed scales), compiled into the same library as
 * lowbit_native.c (build.py), with the same flags: no -ffast-math, no FMA contraction, so every
 * operation below is one IEEE float32 operation in the order written, as the torch expressions
 * they replace compute them (bit-identical, tested in tests/kernels/test_reconstruct_native.py).
 *
 * Rounding to the element grid is lb_grid_round (lowbit_native.h), GPTQ's: the format's
 * decode(encode(.)) up to the sign of a zero result, which the straight-through value below does
 * not see ((+-0 - x) + x is +0 for either sign). */
#include "lowbit_native.h"

/* out[i] = zero[i] ? +0 : ((r - x) + x) * e[i], x = V[i] * step[i] + v[i] (two roundings), r the
 * nearest grid value of x: Offsets.weight's value, torch's _RoundedWeight.forward. */
void lb_rounded_weight(const float *V, const float *v, const float *step, const float *e, const uint8_t *zero,
                       int64_t n, int kind, float lo, float hi, uint32_t mask, uint32_t lowest, uint32_t shift,
                       float *out) {
    for (int64_t i = 0; i < n; i++) {
        float x = V[i] * step[i];
        x = x + v[i];
        float w = lb_grid_round(x, kind, lo, hi, mask, lowest, shift) - x;
        w = w + x;
        w = w * e[i];
        out[i] = zero[i] ? 0.0f : w;
    }
}

/* One signed step of the offsets: with ``rounds``, g is first rounded to a multiple of ``down``
 * (= 1 / up, both powers of two) as lowbit.algorithms.reconstruct_steps._rounded_float32 rounds
 * it (g * up, round half to even, + 0, * down: each exact); then d = (zero ? +0 : g) * e * step
 * (the rounded weight's gradient, two roundings), V = clamp(V - sign(d) * lr, -0.5, 0.5), where
 * sign is torch's (+1, -1, and +0 for zeros of either sign and NaN) and clamp passes NaN through. */
void lb_offset_step(float *V, const float *g, const float *e, const float *step, const uint8_t *zero, int64_t n,
                    float lr, int rounds, float up, float down) {
    for (int64_t i = 0; i < n; i++) {
        float r = g[i];
        if (rounds) {
            r = r * up;
            r = nearbyintf(r);
            r = r + 0.0f;
            r = r * down;
        }
        float d = zero[i] ? 0.0f : r;
        d = d * e[i];
        d = d * step[i];
        float s = d > 0.0f ? 1.0f : (d < 0.0f ? -1.0f : 0.0f);
        float u = V[i] - s * lr;
        V[i] = u < -0.5f ? -0.5f : (u > 0.5f ? 0.5f : u);
    }
}
