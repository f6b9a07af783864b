/* lowbit native kernels: per-group extremes and fused encode over a row band [rows, cols];
 * GPTQ's column loop inside a sub-block (lb_gptq_sub, at the end).
 *
 * A fast path of lowbit.quant.scaling.quantize, bit-identical to its torch path (tested):
 * - sources: float32 (dtype 0), bfloat16 (1), float16 (2), contiguous, row-major;
 * - groups of g consecutive elements of a row, the last one possibly shorter (ragged: it
 *   behaves as if zero-padded, as lowbit.quant.groups.group_view does);
 * - codes: q = (float)x / eff[r, j] in IEEE float32 division (eff == 0: code 0), then
 *   minifloat codes through the 65536-entry table of lowbit.numerics.fast_encode (round to
 *   odd to the upper 16 bits, then lookup), or INT codes (round half to even under the
 *   default rounding mode, saturate, n-bit two's complement); optionally nibble packed
 *   (element 2i in the low nibble, 2i+1 in the high one).
 * Compiled without -ffast-math and with -ffp-contract=off: every float operation is the
 * IEEE one torch performs. Nothing here reads the environment.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>


static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* float16 -> float32, exact: the magnitude bits moved to float32 position are 2^-112 times the
 * value (subnormals included), and scaling by 2^112 is exact; exponent 31 is Inf/NaN. */
static inline float h2f(uint16_t h) {
    uint32_t mag = (uint32_t)(h & 0x7FFF) << 13;
    uint32_t v = f2u(u2f(mag) * 0x1p112f);
    uint32_t special = 0x7F800000u | (mag & 0x007FE000u);
    v = (h & 0x7C00) == 0x7C00 ? special : v;
    return u2f(v | ((uint32_t)(h & 0x8000) << 16));
}

static inline float bf2f(uint16_t h) { return u2f((uint32_t)h << 16); }

/* ---------------------------------------------------------------- per-group extremes
 * |x| of finite floats orders as the unsigned magnitude bits, so the absolute max is an integer
 * max (which vectorizes); a magnitude at or above the Inf pattern flags NaN/Inf. */
#define DEF_AMAX(NAME, T, MASK, INF, TOF)                                                     \
    static int NAME(const T *x, int64_t rows, int64_t cols, int64_t g, float *out) {          \
        int64_t G = (cols + g - 1) / g;                                                       \
        T all = 0;                                                                            \
        for (int64_t r = 0; r < rows; r++) {                                                  \
            const T *row = x + r * cols;                                                      \
            for (int64_t j = 0; j < G; j++) {                                                 \
                int64_t c0 = j * g, c1 = c0 + g < cols ? c0 + g : cols;                       \
                T m = 0;                                                                      \
                for (int64_t c = c0; c < c1; c++) {                                           \
                    T a = row[c] & MASK;                                                      \
                    m = a > m ? a : m;                                                        \
                }                                                                             \
                all = m > all ? m : all;                                                      \
                out[r * G + j] = TOF(m);                                                      \
            }                                                                                 \
        }                                                                                     \
        return all >= INF;                                                                    \
    }

DEF_AMAX(amax_f32, uint32_t, 0x7FFFFFFFu, 0x7F800000u, u2f)
DEF_AMAX(amax_bf16, uint16_t, 0x7FFF, 0x7F80, bf2f)
DEF_AMAX(amax_f16, uint16_t, 0x7FFF, 0x7C00, h2f)

/* Absolute max per group (float32 [rows, G], G = ceil(cols / g)). Returns 1 when the band holds
 * a NaN or an Inf (the maxima are then meaningless), else 0. */
int lb_group_amax(const void *x, int dtype, int64_t rows, int64_t cols, int64_t g, float *out) {
    switch (dtype) {
    case 0: return amax_f32((const uint32_t *)x, rows, cols, g, out);
    case 1: return amax_bf16((const uint16_t *)x, rows, cols, g, out);
    case 2: return amax_f16((const uint16_t *)x, rows, cols, g, out);
    }
    return -1;
}

/* Signed min and max per group. Sign-magnitude bits map to a totally ordered signed integer
 * (negative values: magnitude bits flipped), an involution; a ragged last group includes 0
 * (its zero padding). */
#define DEF_MINMAX(NAME, T, S, MASK, INF, SHIFT, TOF)                                         \
    static inline S NAME##_key(T b) { return (S)(b ^ (T)(((S)b >> SHIFT) & (S)MASK)); }       \
    static int NAME(const T *x, int64_t rows, int64_t cols, int64_t g, float *lo, float *hi) { \
        int64_t G = (cols + g - 1) / g;                                                       \
        T all = 0;                                                                            \
        for (int64_t r = 0; r < rows; r++) {                                                  \
            const T *row = x + r * cols;                                                      \
            for (int64_t j = 0; j < G; j++) {                                                 \
                int64_t c0 = j * g, c1 = c0 + g < cols ? c0 + g : cols;                       \
                S mn = NAME##_key(row[c0]), mx = mn;                                          \
                T m = 0;                                                                      \
                for (int64_t c = c0; c < c1; c++) {                                           \
                    S k = NAME##_key(row[c]);                                                 \
                    T a = row[c] & MASK;                                                      \
                    mn = k < mn ? k : mn;                                                     \
                    mx = k > mx ? k : mx;                                                     \
                    m = a > m ? a : m;                                                        \
                }                                                                             \
                if (c1 - c0 < g) {                                                            \
                    mn = mn < 0 ? mn : 0;                                                     \
                    mx = mx > 0 ? mx : 0;                                                     \
                }                                                                             \
                all = m > all ? m : all;                                                      \
                lo[r * G + j] = TOF((T)NAME##_key((T)mn));                                    \
                hi[r * G + j] = TOF((T)NAME##_key((T)mx));                                    \
            }                                                                                 \
        }                                                                                     \
        return all >= INF;                                                                    \
    }

DEF_MINMAX(minmax_f32, uint32_t, int32_t, 0x7FFFFFFFu, 0x7F800000u, 31, u2f)
DEF_MINMAX(minmax_bf16, uint16_t, int16_t, 0x7FFF, 0x7F80, 15, bf2f)
DEF_MINMAX(minmax_f16, uint16_t, int16_t, 0x7FFF, 0x7C00, 15, h2f)

/* Signed min and max per group (float32 [rows, G] each); returns 1 on NaN/Inf, else 0. */
int lb_group_minmax(const void *x, int dtype, int64_t rows, int64_t cols, int64_t g, float *lo, float *hi) {
    switch (dtype) {
    case 0: return minmax_f32((const uint32_t *)x, rows, cols, g, lo, hi);
    case 1: return minmax_bf16((const uint16_t *)x, rows, cols, g, lo, hi);
    case 2: return minmax_f16((const uint16_t *)x, rows, cols, g, lo, hi);
    }
    return -1;
}

/* ---------------------------------------------------------------- encode */
#define CHUNK 256 /* elements per step: whole groups when g <= CHUNK */

typedef struct {
    const uint8_t *table; /* minifloat: the 65536 codes of fast_encode.code_table; NULL: INT */
    float qmin, qmax;     /* INT bounds */
    uint8_t mask;         /* INT: (1 << bits) - 1 */
    int check_negative;   /* unsigned format: negative input goes to the reference (its error) */
} Target;

/* Table lookups, assembling 8 output bytes per store (fewer byte stores between the loads). */
static void lookup(const uint8_t *tb, const uint16_t *k, int64_t n, uint8_t *o) {
    int64_t m = 0;
    for (; m + 8 <= n; m += 8) {
        uint64_t w = 0;
        for (int q = 0; q < 8; q++) w |= (uint64_t)tb[k[m + q]] << (8 * q);
        memcpy(o + m, &w, 8);
    }
    for (; m < n; m++) o[m] = tb[k[m]];
}

static void lookup_packed(const uint8_t *tb, const uint16_t *k, int64_t n, uint8_t *o) {
    int64_t m = 0;
    for (; m + 8 <= n / 2; m += 8) {
        uint64_t w = 0;
        for (int q = 0; q < 8; q++)
            w |= (uint64_t)(tb[k[2 * (m + q)]] | (tb[k[2 * (m + q) + 1]] << 4)) << (8 * q);
        memcpy(o + m, &w, 8);
    }
    for (; m < n / 2; m++) o[m] = (uint8_t)(tb[k[2 * m]] | (tb[k[2 * m + 1]] << 4));
}

/* Table keys (round to odd to the upper 16 bits: fast_encode.round_to_odd_keys) into k, or
 * INT codes into c, of x[i] / d[i] for i < n. Returns 1 when a value needs the reference
 * encoder (NaN, or negative for an unsigned format). The flags are integer max reductions (they
 * vectorize): magnitude bits above Inf's are NaN; bits above those of -0.0 are negative. */
#define DEF_CODES(NAME, T, TOF)                                                               \
    static int NAME(const T *x, const float *d, int64_t n, const Target *t, uint16_t *k,      \
                    uint8_t *c) {                                                             \
        uint32_t mag = 0, any = 0;                                                            \
        if (t->table) {                                                                       \
            for (int64_t i = 0; i < n; i++) {                                                 \
                uint32_t b = f2u(TOF(x[i]) / d[i]);                                           \
                uint32_t m = b & 0x7FFFFFFFu;                                                 \
                mag = m > mag ? m : mag;                                                      \
                any = b > any ? b : any;                                                      \
                k[i] = (uint16_t)((((b & 0xFFFFu) + 0xFFFFu) | b) >> 16);                     \
            }                                                                                 \
        } else {                                                                              \
            /* clamp, then add 1.5 * 2^23: the sum rounds |v| <= 128 to an integer, half to   \
             * even (the default rounding mode), and its low mantissa bits are that integer in \
             * two's complement; clamping to integer bounds commutes with rounding */          \
            const float magic = 0x1.8p23f, lo = t->qmin, hi = t->qmax;                        \
            const uint8_t mask = t->mask;                                                     \
            for (int64_t i = 0; i < n; i++) {                                                 \
                float v = TOF(x[i]) / d[i];                                                   \
                uint32_t m = f2u(v) & 0x7FFFFFFFu;                                            \
                mag = m > mag ? m : mag;                                                      \
                v = v < lo ? lo : v;                                                          \
                v = v > hi ? hi : v;                                                          \
                c[i] = (uint8_t)(f2u(v + magic) & mask);                                      \
            }                                                                                 \
        }                                                                                     \
        return mag > 0x7F800000u || (t->check_negative && any > 0x80000000u);                 \
    }

/* Per row, chunks of up to CHUNK elements: each element's divisor (its group's eff; 1 where eff
 * is 0, a zero scale, whose elements then get key/code 0: +0.0 encodes to code 0 in every
 * format), the keys or INT codes, then the table lookup and the nibble packing. */
#define DEF_ENCODE(NAME, T, TOF)                                                              \
    DEF_CODES(NAME##_codes, T, TOF)                                                           \
    static int NAME(const T *x, int64_t rows, int64_t cols, int64_t g, const float *eff,     \
                    const Target *t, int pack, uint8_t *out) {                                \
        int64_t G = (cols + g - 1) / g;                                                       \
        int64_t step = g <= CHUNK ? (CHUNK / g) * g : CHUNK;                                  \
        int bad = 0;                                                                          \
        float d[CHUNK];                                                                       \
        uint16_t k[CHUNK];                                                                    \
        uint8_t cbuf[CHUNK];                                                                  \
        for (int64_t r = 0; r < rows; r++) {                                                  \
            const T *row = x + r * cols;                                                      \
            const float *erow = eff ? eff + r * G : NULL;                                     \
            uint8_t *orow = out + (pack ? r * (cols / 2) : r * cols);                         \
            for (int64_t c0 = 0; c0 < cols; c0 += step) {                                     \
                int64_t n = cols - c0 < step ? cols - c0 : step;                              \
                uint8_t *c = (pack || t->table) ? cbuf : orow + c0;                           \
                int zero = 0;                                                                 \
                int64_t j0 = c0 / g, j = j0, i = 0;                                           \
                if (g == 16 && n % 16 == 0) {                                                 \
                    for (; i < n; i += 16, j++) {                                             \
                        float e = erow ? erow[j] : 1.0f;                                      \
                        zero |= e == 0.0f;                                                    \
                        e = e == 0.0f ? 1.0f : e;                                             \
                        for (int q = 0; q < 16; q++) d[i + q] = e;                            \
                    }                                                                         \
                } else {                                                                      \
                    for (int64_t gend = (j + 1) * g - c0; i < n; j++, gend += g) {            \
                        int64_t end = gend < n ? gend : n;                                    \
                        float e = erow ? erow[j] : 1.0f;                                      \
                        zero |= e == 0.0f;                                                    \
                        e = e == 0.0f ? 1.0f : e;                                             \
                        for (; i < end; i++) d[i] = e;                                        \
                    }                                                                         \
                }                                                                             \
                bad |= NAME##_codes(row + c0, d, n, t, k, c);                                 \
                if (zero) {                                                                   \
                    i = 0;                                                                    \
                    for (int64_t jj = j0, gend = (j0 + 1) * g - c0; i < n; jj++, gend += g) { \
                        int64_t end = gend < n ? gend : n;                                    \
                        if (erow[jj] == 0.0f) {                                               \
                            if (t->table) memset(k + i, 0, (size_t)(end - i) * sizeof *k);    \
                            else memset(c + i, 0, (size_t)(end - i));                         \
                        }                                                                     \
                        i = end;                                                              \
                    }                                                                         \
                }                                                                             \
                if (t->table && pack) {                                                       \
                    lookup_packed(t->table, k, n, orow + c0 / 2);                             \
                } else if (t->table) {                                                        \
                    lookup(t->table, k, n, orow + c0);                                        \
                } else if (pack) {                                                            \
                    uint8_t *o = orow + c0 / 2;                                               \
                    for (int64_t m = 0; m < n / 2; m++)                                       \
                        o[m] = (uint8_t)(c[2 * m] | (c[2 * m + 1] << 4));                     \
                }                                                                             \
            }                                                                                 \
        }                                                                                     \
        return bad;                                                                           \
    }

static inline float f32_of(uint32_t b) { return u2f(b); }
DEF_ENCODE(encode_f32, uint32_t, f32_of)
DEF_ENCODE(encode_bf16, uint16_t, bf2f)
DEF_ENCODE(encode_f16, uint16_t, h2f)

/* Codes of x [rows, cols] divided by eff [rows, ceil(cols / g)] (eff NULL: no division), into
 * out [rows, cols] (pack: [rows, cols / 2], cols even, 4-bit codes). table: a minifloat code
 * table, or NULL for INTn with bounds qmin..qmax. Returns 0, or 1 when some value needs the
 * reference encoder (NaN, negative input of an unsigned format; the caller's torch path then
 * raises the reference's error or encodes NaN), or -1 for an unknown dtype. */
int lb_encode(const void *x, int dtype, int64_t rows, int64_t cols, int64_t g, const float *eff,
              const uint8_t *table, int qmin, int qmax, int bits, int check_negative, int pack, uint8_t *out) {
    Target t = {table, (float)qmin, (float)qmax, (uint8_t)((1u << bits) - 1u), check_negative};
    if (!eff || g <= 0) g = cols > 0 ? cols : 1;
    switch (dtype) {
    case 0: return encode_f32((const uint32_t *)x, rows, cols, g, eff, &t, pack, out);
    case 1: return encode_bf16((const uint16_t *)x, rows, cols, g, eff, &t, pack, out);
    case 2: return encode_f16((const uint16_t *)x, rows, cols, g, eff, &t, pack, out);
    }
    return -1;
}

/* Nibble packing of uint8 codes [n] (n even) into [n / 2]; returns the largest code (the caller
 * refuses codes above 15). */
int lb_pack_nibbles(const uint8_t *codes, int64_t n, uint8_t *out) {
    uint8_t m = 0;
    for (int64_t i = 0; i < n; i++) m = codes[i] > m ? codes[i] : m;
    for (int64_t i = 0; i < n / 2; i++) out[i] = (uint8_t)(codes[2 * i] | (codes[2 * i + 1] << 4));
    return m;
}

/* GPTQ's column loop inside one sub-block (lowbit.quant.gptq_solve.solve_columns, whose torch
 * loop it replaces operation for operation, in the same order: bit-identical, tested). The error
 * and the rank-1 update are fused multiply-adds (fmaf: one rounding), as torch's CPU kernels
 * for addcmul and addr_ compute them on FMA machines.
 * W, E: the sub-block's first working row and error row, m rows of R floats (row stride R);
 * dv, ef: the divisors and effective scales of those m columns, R floats a row, row stride ds
 * (R; 0 when every column has the same ones: per-channel scales). For i = 0..m-1:
 *   y = w_i / dv_i; y = nearest grid value; e_i = w_i - y * ef_i;
 *   for each part p (rows a[p]..b[p]) and k = i+1..m-1: w_k[a:b] += u_p[i, k] * e_i[a:b],
 * u_p: the part's -Ub [in, in] (row stride ld, up[p] is its address) from row and column j0,
 * the sub-block's first column. Rounding (kind 0, INT): round half to even (default rounding mode), clamp to
 * [lo, hi]; (kind 1, signed minifloat): clamp to [-lo, lo] (lo: max finite), then the magic
 * number M from the exponent field (at least ``lowest``) plus ``shift``: (y + M) - M. */
int lb_gptq_sub(float *W, float *E, const float *dv, const float *ef, int64_t ds, int64_t m, int64_t R,
                int64_t nparts, const int64_t *a, const int64_t *b, const int64_t *up, int64_t ld,
                int64_t j0, int kind, float lo, float hi, uint32_t mask, uint32_t lowest, uint32_t shift) {
    for (int64_t i = 0; i < m; i++) {
        float *w = W + i * R, *e = E + i * R;
        const float *d = dv + i * ds, *f = ef + i * ds;
        for (int64_t r = 0; r < R; r++) {
            float y = w[r] / d[r];
            if (kind == 0) {
                y = nearbyintf(y);
                y = y < lo ? lo : (y > hi ? hi : y);
            } else {
                y = y < -lo ? -lo : (y > lo ? lo : y);
                uint32_t bits = f2u(y) & mask;
                bits = (bits > lowest ? bits : lowest) + shift;
                float M = u2f(bits);
                y = (y + M) - M;  /* two IEEE roundings: no -ffast-math, so never reassociated */
            }
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

/* The ABI version the loader checks (bump with any signature change). */
int lb_version(void) { return 2; }
