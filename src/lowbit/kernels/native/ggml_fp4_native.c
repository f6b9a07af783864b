/* lowbit native encoders of GGML's FP4 block types, MXFP4 and NVFP4: the bytes of the torch
 * reference, lowbit.numerics.ggml_fp4.encode_mxfp4 / encode_nvfp4 (ggml's quantize_row_mxfp4_ref /
 * quantize_row_nvfp4_ref), for every finite input (tests/kernels/test_ggml_fp4_native.py).
 * Compiled into the library of lowbit_native.c (build.py), with its flags: no -ffast-math, no FMA
 * contraction. The scales are the torch code's float32 operations (log2 in float64 rounded to
 * float32, as it takes it); the codes are its choice, by fewer operations shown equal below.
 *
 * The code choice. The reference gives each weight x the first code c in 0..15 of least
 * fl(|d * T[c] - x|), T the doubled E2M1 table (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, ..., -12; T[8] is
 * +0) and d >= 0 the halved scale. The products d * T[c] are exact (d a power of two of at least
 * 2^-128, or half a UE4M3 value: 4 significant bits, 0 or at least 2^-10; T[c] has at most 2), or
 * infinite (MXFP4's scale code 253 times 8 and 12: an infinite error, never the least), so:
 * - for x >= 0 (and -0), a negative code's error fl(d T + |x|) is never below the error of the
 *   positive code of the same magnitude, fl(|d T - |x||), which comes first: a positive code wins;
 * - for x < 0, the negative code 8 + c has the error fl(|d T[c] - |x||) (round to nearest even is
 *   symmetric in sign), in the order of c; a positive code c >= 1 has fl(d T[c] + |x|) >= |x|, the
 *   error of code 0, which comes before it; code 8 ties code 0 always.
 * So the code is m, the first magnitude 0..7 of least fl(|d T[m] - |x||), with the sign bit set
 * when x < 0 and m > 0 (codes_scan: eight candidates instead of sixteen, the same errors, compared
 * in the same order with the same strict "less than": a tie keeps the smaller magnitude).
 *
 * Where 0 < d <= 2^124 (12 d finite) and |x| <= 2^21 d (every group of MXFP4, whose |x| < 16 d,
 * but those of scale code 253, whose 8 d and 12 d overflow: the largest float32s; every group of
 * NVFP4 unless its scale saturates under weights above 2^21 * 224), m is the number of midpoints
 * M_c = d (T[c] + T[c + 1]) / 2 (exact floats: 3 significant bits times d) strictly below y = |x|
 * (codes_near), as follows. Let v = d T, v_lo <= y < v_hi neighbours, M their midpoint and
 * h = M - v_lo = v_hi - M (exact). If y <= M: y - v_lo <= h <= v_hi - y, so rounded, lo's error
 * is at most hi's (a tie keeps lo). If y > M: y - v_lo is exact (v_lo = 0, or v_lo <= y <= 2 v_lo
 * as T[c + 1] <= 2 T[c]: Sterbenz) and above h, hi's error at most h: hi's is less. Any other
 * candidate is at least d farther than lo or hi (at least 4 d than 7 when y >= 12 d), and below
 * 2^22 d float32 rounds by at most d / 4: its rounded error is strictly larger. Where d = 0 every
 * error is |x|: m = 0. */
#include "lowbit_native.h"

#define MX_N 32  /* MXFP4: weights per block, 17 bytes: the E8M0 exponent, 16 bytes of nibbles */
#define MX_B 17
#define NV_G 16  /* NVFP4: weights per UE4M3 scale; blocks of 64 weights, 36 bytes */
#define NV_N 64
#define NV_B 36
#define TILE 512 /* weights encoded at a time: scales first, then the codes in one vectorized loop */

static const float MAG[8] = {0.0f, 1.0f, 2.0f, 3.0f, 4.0f, 6.0f, 8.0f, 12.0f};
static const float MID[7] = {0.5f, 1.5f, 2.5f, 3.5f, 5.0f, 7.0f, 10.0f}; /* (MAG[c] + MAG[c + 1]) / 2 */

/* The largest |x| of each group of g (a multiple of 8) consecutive weights of x[0..n), n a
 * multiple of g, as bits (for finite floats their order is the integers'): eight running maxima
 * (one vector), then the largest of them. Returns whether x holds NaN or Inf (bits of |x| at
 * least those of Inf). */
static uint32_t group_amax(const float *restrict x, int n, int g, uint32_t *restrict am) {
    uint32_t bad = 0;
    for (int s = 0; s < n / g; s++) {
        uint32_t v[8] = {0};
        for (int i = 0; i < g; i += 8)
            for (int k = 0; k < 8; k++) {
                const uint32_t u = f2u(x[s * g + i + k]) & 0x7FFFFFFFu;
                v[k] = u > v[k] ? u : v[k];
            }
        uint32_t m = 0;
        for (int k = 0; k < 8; k++) m = v[k] > m ? v[k] : m;
        am[s] = m;
        bad |= m >= 0x7F800000u;
    }
    return bad;
}

/* The codes of n <= TILE weights x[j] under the halved scales d[j], candidate by candidate (see
 * the top of the file). The loops run over the weights with the candidate outside (GCC
 * if-converts and vectorizes them so under -ftrapping-math; a candidate loop inside stays scalar). */
static void codes_scan(const float *restrict x, const float *restrict d, int n, uint8_t *restrict q) {
    float y[TILE], best[TILE];
    int32_t m[TILE];
    for (int j = 0; j < n; j++) {
        y[j] = fabsf(x[j]);
        best[j] = y[j];  /* code 0: |d * 0 - |x|| = |x| */
        m[j] = 0;
    }
    for (int c = 1; c < 8; c++) {
        const float t = MAG[c];
        for (int j = 0; j < n; j++) {
            const float e = fabsf(d[j] * t - y[j]);
            const int32_t lt = e < best[j];  /* strictly less: a tie keeps the smaller magnitude */
            best[j] = lt ? e : best[j];
            m[j] = lt ? c : m[j];
        }
    }
    for (int j = 0; j < n; j++) {
        const int32_t neg = (m[j] > 0) & (x[j] < 0.0f);
        q[j] = (uint8_t)(m[j] | neg << 3);
    }
}

/* The same codes where every group has d = 0 or max |x| <= 2^21 d: the midpoints strictly below
 * |x| (see the top of the file), none where d = 0. */
static void codes_near(const float *restrict x, const float *restrict d, int n, uint8_t *restrict q) {
    for (int j = 0; j < n; j++) {
        const float y = fabsf(x[j]);
        int32_t m = 0;
        for (int c = 0; c < 7; c++) m += y > d[j] * MID[c];
        m &= -(int32_t)(d[j] > 0.0f);
        const int32_t neg = (m > 0) & (x[j] < 0.0f);
        q[j] = (uint8_t)(m | neg << 3);
    }
}

/* Whether codes_near gives a group of largest |x| am (bits) under the halved scale d its codes. */
static inline int near_ok(uint32_t am, float d) { return d == 0.0f || (d <= 0x1p124f && u2f(am) <= d * 0x1p21f); }

/* E8M0 code e -> 2^(e - 128) (half the block scale), exact, subnormal for e < 2 (_half_scale). */
static inline float half_scale(int e) {
    return u2f(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23);
}

/* MXFP4 (encode_mxfp4): per block of 32, amax = max |x|; e = 0 for amax 0, else
 * clamp(floor(log2f(amax)) - 2 + 127, 0, 254), log2f correctly rounded as the reference takes it
 * (the float64 log2 rounded to float32: near the top of a binade it rounds up to the next
 * integer); the codes under 2^(e - 128); the byte e, then element j | element j + 16 << 4.
 * x: nblocks * 32 contiguous floats; out: nblocks * 17 bytes. Returns 1 when x holds NaN or Inf
 * (out partly written: the caller takes the reference, which raises), else 0. */
int lb_encode_mxfp4(const float *x, int64_t nblocks, uint8_t *out) {
    float d[TILE];
    uint8_t q[TILE];
    for (int64_t b0 = 0; b0 < nblocks; b0 += TILE / MX_N) {
        const int nb = nblocks - b0 < TILE / MX_N ? (int)(nblocks - b0) : TILE / MX_N;
        const float *xt = x + b0 * MX_N;
        uint8_t *ot = out + b0 * MX_B;
        uint32_t am[TILE / MX_N];
        if (group_amax(xt, nb * MX_N, MX_N, am)) return 1;
        int near = 1;
        for (int b = 0; b < nb; b++) {
            int e = 0;
            if (am[b]) {
                e = (int)floorf((float)log2((double)u2f(am[b]))) - 2 + 127;
                e = e < 0 ? 0 : (e > 254 ? 254 : e);
            }
            ot[b * MX_B] = (uint8_t)e;
            const float h = half_scale(e);
            near &= near_ok(am[b], h);
            for (int j = 0; j < MX_N; j++) d[b * MX_N + j] = h;
        }
        (near ? codes_near : codes_scan)(xt, d, nb * MX_N, q);
        for (int b = 0; b < nb; b++)
            for (int j = 0; j < 16; j++) ot[b * MX_B + 1 + j] = (uint8_t)(q[b * MX_N + j] | q[b * MX_N + j + 16] << 4);
    }
    return 0;
}

/* ggml's float32 -> UE4M3 code (fp32_to_ue4m3): x <= 0 -> 0; x capped at 448; a normal code
 * rounds half up on the fourth mantissa bit, exponent field 15 or more -> 0x7E; below 2^-6 the
 * subnormal code trunc(x * 512 + 0.5) (float32 operations), at most 7. */
static inline uint8_t fp32_to_ue4m3(float x) {
    if (!(x > 0.0f)) return 0;
    x = x > 448.0f ? 448.0f : x;
    const uint32_t bits = f2u(x);
    int exp = (int)((bits >> 23) & 0xFF) - 127 + 7;
    if (exp <= 0) {
        float t = truncf(x * 512.0f + 0.5f);
        return (uint8_t)(t > 7.0f ? 7 : (int)t);
    }
    int man = (int)((bits >> 20) & 7) + (int)((bits >> 19) & 1);
    if (man > 7) {
        exp += 1;
        man = 0;
    }
    return exp >= 15 ? 0x7E : (uint8_t)(exp << 3 | man);
}

/* UE4M3 code -> half its value (_ue4m3_half): 0 and 0x7F read as 0; exponent field 0:
 * man * 2^-10; else 2^(exp - 8) * (1 + man / 8). */
static inline float ue4m3_half(uint8_t s) {
    if (s == 0 || s == 0x7F) return 0.0f;
    const uint32_t exp = (s >> 3) & 0xF, man = s & 7;
    return exp == 0 ? (float)man * 0x1p-10f : u2f((exp + 127 - 8) << 23 | man << 20);
}

/* NVFP4 (encode_nvfp4): per 16 weights the scale code fp32_to_ue4m3(amax / 6) and the codes under
 * half its value; a block of 64 is the 4 scale codes, then per 16 weights 8 bytes, element
 * j | element j + 8 << 4. x: nblocks * 64 contiguous floats; out: nblocks * 36 bytes. Returns 1
 * when x holds NaN or Inf (as lb_encode_mxfp4), else 0. */
int lb_encode_nvfp4(const float *x, int64_t nblocks, uint8_t *out) {
    float d[TILE];
    uint8_t q[TILE];
    for (int64_t b0 = 0; b0 < nblocks; b0 += TILE / NV_N) {
        const int nb = nblocks - b0 < TILE / NV_N ? (int)(nblocks - b0) : TILE / NV_N;
        const float *xt = x + b0 * NV_N;
        uint8_t *ot = out + b0 * NV_B;
        uint32_t am[TILE / NV_G];
        if (group_amax(xt, nb * NV_N, NV_G, am)) return 1;
        int near = 1;
        for (int s = 0; s < nb * (NV_N / NV_G); s++) {  /* group s: scale byte s % 4 of block s / 4 */
            const uint8_t ue = fp32_to_ue4m3(u2f(am[s]) / 6.0f);
            ot[s / 4 * NV_B + s % 4] = ue;
            const float h = ue4m3_half(ue);
            near &= near_ok(am[s], h);
            for (int j = 0; j < NV_G; j++) d[s * NV_G + j] = h;
        }
        (near ? codes_near : codes_scan)(xt, d, nb * NV_N, q);
        for (int s = 0; s < nb * (NV_N / NV_G); s++)
            for (int j = 0; j < 8; j++)
                ot[s / 4 * NV_B + 4 + 8 * (s % 4) + j] = (uint8_t)(q[s * NV_G + j] | q[s * NV_G + j + 8] << 4);
    }
    return 0;
}
