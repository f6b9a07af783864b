/* lowbit native kernels: per-group extremes and fused encode over a row band [rows, cols];
 * GPTQ's column loop is in gptq_native.c, the shared helpers in lowbit_native.h.
 *
 * A fast path of lowbit.quant.scaling.quantize, bit-identical to its torch path (tested):
 * - sources: float32 (dtype 0), bfloat16 (1), float16 (2), contiguous, row-major;
 * - groups of g consecutive elements of a row, the last one possibly shorter (ragged: it
 *   behaves as if zero-padded, as lowbit.quant.groups.group_view does);
 * - codes: q = (float)x / eff[r, j] in IEEE float32 division (eff == 0: code 0), then
 *   minifloat codes through the 65536-entry key table of the format (MiniFloat.key_table; round to
 *   odd to the upper 16 bits, then lookup; for E2M1 the table's steps counted instead, 16 keys
 *   at a time with AVX2: step_codes, encode_steps_avx2), or INT codes (round half to even under the
 *   default rounding mode, saturate, n-bit two's complement); optionally nibble packed
 *   (element 2i in the low nibble, 2i+1 in the high one).
 * Compiled without -ffast-math and with -ffp-contract=off: every float operation is the
 * IEEE one torch performs. Nothing here reads the environment.
 */
#include "lowbit_native.h"

#ifdef __AVX2__
/* The largest of 8 unsigned 32-bit lanes. */
static inline uint32_t hmax_u32(__m256i v) {
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4E));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xB1));
    return (uint32_t)_mm_cvtsi128_si32(m);
}
#endif

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

#ifdef __AVX2__
/* The same maxima, 16 elements a step, for groups and rows of a multiple of 16 elements: integer
 * maxima of the magnitude bits, reduced per group with the minimum-position instruction on
 * their complement (16-bit sources) or by halving (float32). */
static int amax_avx2(const void *x, int dtype, int64_t rows, int64_t cols, int64_t g, float *out) {
    int64_t G = (cols + g - 1) / g;
    if (dtype == 0) {
        const __m256i low31 = _mm256_set1_epi32(0x7FFFFFFF);
        __m256i all = _mm256_setzero_si256();
        for (int64_t r = 0; r < rows; r++) {
            const float *row = (const float *)x + r * cols;
            for (int64_t j = 0; j < G; j++) {
                int64_t c0 = j * g, c1 = c0 + g < cols ? c0 + g : cols;
                __m256i m = _mm256_setzero_si256();
                for (int64_t c = c0; c < c1; c += 8)
                    m = _mm256_max_epu32(m, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(row + c)), low31));
                all = _mm256_max_epu32(all, m);
                out[r * G + j] = u2f(hmax_u32(m));
            }
        }
        return hmax_u32(all) >= 0x7F800000u;
    }
    const __m256i low15 = _mm256_set1_epi16(0x7FFF);
    const __m128i ones = _mm_set1_epi16(-1);
    uint16_t all = 0;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = (const uint16_t *)x + r * cols;
        for (int64_t j = 0; j < G; j++) {
            int64_t c0 = j * g, c1 = c0 + g < cols ? c0 + g : cols;
            __m256i m = _mm256_setzero_si256();
            for (int64_t c = c0; c < c1; c += 16)
                m = _mm256_max_epu16(m, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(row + c)), low15));
            __m128i h = _mm_max_epu16(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
            uint16_t mx = (uint16_t)~_mm_cvtsi128_si32(_mm_minpos_epu16(_mm_xor_si128(h, ones)));
            all = mx > all ? mx : all;
            out[r * G + j] = dtype == 1 ? bf2f(mx) : h2f(mx);
        }
    }
    return all >= (dtype == 1 ? 0x7F80 : 0x7C00);
}
#endif

/* Absolute max per group (float32 [rows, G], G = ceil(cols / g)). Returns 1 when the band holds
 * a NaN or an Inf (the maxima are then meaningless), else 0. */
int lb_group_amax(const void *x, int dtype, int64_t rows, int64_t cols, int64_t g, float *out) {
#ifdef __AVX2__
    if (g % 16 == 0 && cols % 16 == 0 && dtype >= 0 && dtype <= 2)
        return amax_avx2(x, dtype, rows, cols, g, out);
#endif
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

/* NSTEPS (magnitude steps of a format with 8 magnitude codes, E2M1) and LB_ABI_VERSION come from
 * lowbit_constants.h, generated by build.py from lowbit.kernels.native.constants. */

typedef struct {
    const uint8_t *table; /* minifloat: the 65536 codes of MiniFloat.key_table; NULL: INT */
    const uint16_t *steps; /* or NULL: the table as steps (MiniFloat.key_steps): the first magnitude
                            * key of each magnitude code 1..NSTEPS, then the sign's code bits */
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

/* The table's codes of keys k[0..n) (nibble packed when pack, n even) from its steps: a key's
 * code is the number of steps its magnitude bits (key & 0x7FFF) reach, ORed with the sign's code
 * bits for a negative key. MiniFloat.key_steps checks that this equals the table entry of
 * every non-NaN key; NaN keys never get here (their input is refused first). The AVX2 loop and
 * the scalar one give the same bytes (lb_step_codes tests both on every key). */
static inline uint8_t step_code(const uint16_t *st, uint16_t key) {
    uint32_t km = key & 0x7FFFu, c = (key >> 15) ? st[NSTEPS] : 0u;
    for (int q = 0; q < NSTEPS; q++) c += km >= st[q];
    return (uint8_t)c;
}

static void step_codes_scalar(const uint16_t *st, const uint16_t *k, int64_t n, int pack, uint8_t *o, int64_t i) {
    if (pack) {
        for (; i + 1 < n; i += 2) o[i / 2] = (uint8_t)(step_code(st, k[i]) | (step_code(st, k[i + 1]) << 4));
    } else {
        for (; i < n; i++) o[i] = step_code(st, k[i]);
    }
}

static void step_codes(const uint16_t *st, const uint16_t *k, int64_t n, int pack, uint8_t *o, int simd) {
    int64_t i = 0;
#ifdef __AVX2__
    if (simd) {
        /* km >= step as the signed 16-bit km > step - 1 (km <= 0x7FFF; steps lie in 1..0x8000) */
        __m256i thr[NSTEPS];
        for (int q = 0; q < NSTEPS; q++) thr[q] = _mm256_set1_epi16((short)(st[q] - 1));
        const __m256i low15 = _mm256_set1_epi16(0x7FFF), sign = _mm256_set1_epi16((short)st[NSTEPS]);
        const __m256i byte = _mm256_set1_epi32(0xFF);
        for (; i + 32 <= n; i += 32) {
            __m256i c[2];
            for (int h = 0; h < 2; h++) {
                __m256i key = _mm256_loadu_si256((const __m256i *)(k + i + 16 * h));
                __m256i km = _mm256_and_si256(key, low15);
                __m256i code = _mm256_and_si256(_mm256_srai_epi16(key, 15), sign);
                for (int q = 0; q < NSTEPS; q++) code = _mm256_sub_epi16(code, _mm256_cmpgt_epi16(km, thr[q]));
                c[h] = code;
            }
            if (pack) { /* a 32-bit lane holds codes 2j (low half) and 2j+1: byte = c_2j | c_2j+1 << 4 */
                __m256i v0 = _mm256_and_si256(_mm256_or_si256(c[0], _mm256_srli_epi32(c[0], 12)), byte);
                __m256i v1 = _mm256_and_si256(_mm256_or_si256(c[1], _mm256_srli_epi32(c[1], 12)), byte);
                __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(v0, v1), 0xD8);
                __m128i b = _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
                _mm_storeu_si128((__m128i *)(o + i / 2), b);
            } else {
                __m256i b = _mm256_permute4x64_epi64(_mm256_packus_epi16(c[0], c[1]), 0xD8);
                _mm256_storeu_si256((__m256i *)(o + i), b);
            }
        }
    }
#endif
    (void)simd;
    step_codes_scalar(st, k, n, pack, o, i);
}

#ifdef __AVX2__
/* 16 source elements as two float32 vectors (exact conversions; NaN stays NaN). */
static inline void load16(const void *x, int dtype, int64_t i, __m256 *a, __m256 *b) {
    if (dtype == 0) {
        *a = _mm256_loadu_ps((const float *)x + i);
        *b = _mm256_loadu_ps((const float *)x + i + 8);
        return;
    }
    __m128i lo = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
    __m128i hi = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i + 8));
    if (dtype == 1) {
        *a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(lo), 16));
        *b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hi), 16));
    } else {
#ifdef __F16C__
        *a = _mm256_cvtph_ps(lo);
        *b = _mm256_cvtph_ps(hi);
#endif
    }
}

/* The encode pass of a steps format in one loop, 16 elements a step (groups and rows a multiple
 * of 16, so each step lies in one group): x / eff, the round-to-odd keys, their codes from the
 * steps (a zero eff: code 0), packed or not; the same bytes and flags as the chunked path. */
static int encode_steps_avx2(const void *x, int dtype, int64_t rows, int64_t cols, int64_t g, const float *eff,
                             const uint16_t *st, int check_negative, int pack, uint8_t *out) {
    int64_t G = (cols + g - 1) / g;
    __m256i thr[NSTEPS];
    for (int q = 0; q < NSTEPS; q++) thr[q] = _mm256_set1_epi16((short)(st[q] - 1));
    const __m256i low15 = _mm256_set1_epi16(0x7FFF), sign = _mm256_set1_epi16((short)st[NSTEPS]);
    const __m256i low31 = _mm256_set1_epi32(0x7FFFFFFF), low16 = _mm256_set1_epi32(0xFFFF);
    const __m256i byte = _mm256_set1_epi32(0xFF);
    __m256i mag = _mm256_setzero_si256(), any = _mm256_setzero_si256();
    for (int64_t r = 0; r < rows; r++) {
        uint8_t *orow = out + (pack ? r * (cols / 2) : r * cols);
        for (int64_t c0 = 0; c0 < cols; c0 += 16) {
            float e = eff ? eff[r * G + c0 / g] : 1.0f;
            __m256i keep = _mm256_set1_epi16(e == 0.0f ? 0 : -1);
            __m256 d = _mm256_set1_ps(e == 0.0f ? 1.0f : e);
            /* a power of two 2^k whose reciprocal 2^-k is a normal float (E8M0 scales): x * 2^-k
             * is the same correctly rounded quotient as x / 2^k, and multiplying is cheaper */
            uint32_t eb = f2u(e), ef = eb >> 23;
            int pow2 = eff && (eb & 0x807FFFFFu) == 0 && ef >= 1 && ef <= 253;
            __m256 inv = _mm256_set1_ps(u2f((254u - (pow2 ? ef : 127u)) << 23));
            __m256 f[2];
            load16(x, dtype, r * cols + c0, &f[0], &f[1]);
            __m256i k[2];
            for (int h = 0; h < 2; h++) {
                __m256 q = !eff ? f[h] : pow2 ? _mm256_mul_ps(f[h], inv) : _mm256_div_ps(f[h], d);
                __m256i b = _mm256_castps_si256(q);
                mag = _mm256_max_epu32(mag, _mm256_and_si256(b, low31));
                any = _mm256_max_epu32(any, b);
                k[h] = _mm256_srli_epi32(_mm256_or_si256(_mm256_add_epi32(_mm256_and_si256(b, low16), low16), b), 16);
            }
            __m256i key = _mm256_permute4x64_epi64(_mm256_packus_epi32(k[0], k[1]), 0xD8);
            __m256i km = _mm256_and_si256(key, low15);
            __m256i code = _mm256_and_si256(_mm256_srai_epi16(key, 15), sign);
            for (int q = 0; q < NSTEPS; q++) code = _mm256_sub_epi16(code, _mm256_cmpgt_epi16(km, thr[q]));
            code = _mm256_and_si256(code, keep);
            if (pack) {
                __m256i v = _mm256_and_si256(_mm256_or_si256(code, _mm256_srli_epi32(code, 12)), byte);
                __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
                _mm_storel_epi64((__m128i *)(orow + c0 / 2), _mm_packus_epi16(w, w));
            } else {
                __m128i w = _mm_packus_epi16(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
                _mm_storeu_si128((__m128i *)(orow + c0), w);
            }
        }
    }
    return hmax_u32(mag) > 0x7F800000u || (check_negative && hmax_u32(any) > 0x80000000u);
}
#endif

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

/* The 16-bit table key of float bits b: the upper 16 bits rounded to odd (the lowest kept bit is
 * set when any dropped bit is: lowbit.kernels.torch_ops.round_to_odd_keys). */
static inline uint16_t odd_key(uint32_t b) { return (uint16_t)((((b & 0xFFFFu) + 0xFFFFu) | b) >> 16); }

/* Table keys (round to odd to the upper 16 bits: odd_key) into k, or
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
                k[i] = odd_key(b);                                                            \
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
                if (t->steps) {                                                               \
                    step_codes(t->steps, k, n, pack, pack ? orow + c0 / 2 : orow + c0, 1);    \
                } else if (t->table && pack) {                                                \
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
 * out [rows, cols] (pack: [rows, cols / 2], cols even, 4-bit codes). enc.table: a minifloat code
 * table, or NULL for INTn with bounds qmin..qmax; enc.steps (or NULL): that table as steps (see
 * step_codes), counted instead of looked up. Returns 0, or 1 when some value needs the
 * reference encoder (NaN, negative input of an unsigned format; the caller's torch path then
 * raises the reference's error or encodes NaN), or -1 for an unknown dtype. */
int lb_encode(const lb_encode_args *p) {
    const lb_encoding *en = &p->enc;
    const void *x = p->band.x;
    const float *eff = p->eff;
    int dtype = p->band.dtype, pack = p->pack, check_negative = en->check_negative;
    int64_t rows = p->band.rows, cols = p->band.cols, g = p->band.g;
    uint8_t *out = p->out;
    Target t = {en->table, en->table ? en->steps : NULL, (float)en->qmin, (float)en->qmax,
                (uint8_t)((1u << en->bits) - 1u), check_negative};
    if (!eff || g <= 0) g = cols > 0 ? cols : 1;
#ifdef __AVX2__
#ifndef __F16C__
    if (dtype != 2)
#endif
    if (t.steps && g % 16 == 0 && cols % 16 == 0 && dtype >= 0 && dtype <= 2)
        return encode_steps_avx2(x, dtype, rows, cols, g, eff, t.steps, check_negative, pack, out);
#endif
    switch (dtype) {
    case 0: return encode_f32((const uint32_t *)x, rows, cols, g, eff, &t, pack, out);
    case 1: return encode_bf16((const uint16_t *)x, rows, cols, g, eff, &t, pack, out);
    case 2: return encode_f16((const uint16_t *)x, rows, cols, g, eff, &t, pack, out);
    }
    return -1;
}

/* ---------------------------------------------------------------- whole band: extremes, scales, codes
 * The scale rules of lowbit.quant.scales on each group's extremes, operation for operation in
 * float32 (lowbit.quant.native_quant.scale_rule gives the constants; bit-identical to the torch
 * path, tested on adversarial values for every scheme):
 *   RULE_DIVIDE      scale = amax / divisor                      (fp32 scales: max, half-step)
 *   RULE_FULL_RANGE  scale = (-lo >= hi ? lo : hi) / divisor + 0  (divisor: qmin)
 *   RULE_TABLE       raw = amax / divisor [* gs]; code = table[round-to-odd key of raw];
 *                    scale = values[code]                        (a minifloat scale format)
 *   RULE_E8M0        code = clamp(exponent field of amax - emax, 0, e8m0_max); scale = values[code]
 * and eff = scale [/ gs] divides the group's elements before they are encoded (lb_encode). */
enum { RULE_DIVIDE = 0, RULE_FULL_RANGE = 1, RULE_TABLE = 2, RULE_E8M0 = 3 };

/* x [rows, cols] -> codes (out, packed when pack), scales [rows, G] (float32), their codes
 * (scale_codes, RULE_TABLE and RULE_E8M0; else unused), using eff [rows, G] (and lo [rows, G]
 * for RULE_FULL_RANGE) as scratch. Returns 0, 1 when the input holds NaN/Inf or a value needs
 * the reference encoder (the caller's torch path then decides), -1 on bad arguments. */
int lb_quantize(const lb_quantize_args *p) {
    const void *x = p->band.x;
    int dtype = p->band.dtype, rule = p->rule;
    int64_t rows = p->band.rows, cols = p->band.cols, g = p->band.g;
    const float divisor = p->divisor, *gs = p->gs, *scale_values = p->scale_values;
    const uint8_t *scale_table = p->scale_table;
    float *scale = p->scale, *eff = p->eff, *lo = p->lo;
    uint8_t *scale_codes = p->scale_codes;
    if (rows <= 0 || cols <= 0 || g <= 0 || dtype < 0 || dtype > 2) return -1;
    /* a few rows at a time, so that the encode pass reads what the extremes pass just brought
     * into the cache (about 16 KB of source) */
    int64_t G = (cols + g - 1) / g, esize = dtype == 0 ? 4 : 2;
    int64_t block = (16 << 10) / (cols * esize);
    block = block < 1 ? 1 : block;
    if (rows > block) {
        int64_t step = cols * esize, ostep = p->pack ? cols / 2 : cols;
        for (int64_t r = 0; r < rows; r += block) {
            lb_quantize_args q = *p;
            q.band.x = (const char *)x + r * step;
            q.band.rows = rows - r < block ? rows - r : block;
            q.out = p->out + r * ostep;
            q.scale = scale + r * G;
            q.scale_codes = scale_codes ? scale_codes + r * G : NULL;
            q.eff = eff + r * G;
            q.lo = lo ? lo + r * G : NULL;
            int st = lb_quantize(&q);
            if (st) return st;
        }
        return 0;
    }
    int64_t n = rows * G;
    int bad = rule == RULE_FULL_RANGE ? lb_group_minmax(x, dtype, rows, cols, g, lo, scale)
                                      : lb_group_amax(x, dtype, rows, cols, g, scale);
    if (bad) return bad;
    /* one loop per rule, so that the arithmetic ones vectorize; the table rule looks its keys
     * up in a second loop, 4096 at a time */
    const float gsv = gs ? gs[0] : 1.0f;
    if (rule == RULE_DIVIDE) {
        for (int64_t i = 0; i < n; i++) scale[i] = scale[i] / divisor;
    } else if (rule == RULE_FULL_RANGE) {
        for (int64_t i = 0; i < n; i++) scale[i] = (-lo[i] >= scale[i] ? lo[i] : scale[i]) / divisor + 0.0f;
    } else if (rule == RULE_TABLE) {
        uint16_t key[4096];
        for (int64_t c0 = 0; c0 < n; c0 += 4096) {
            int64_t m = n - c0 < 4096 ? n - c0 : 4096;
            for (int64_t i = 0; i < m; i++) {
                float raw = scale[c0 + i] / divisor;
                key[i] = odd_key(f2u(gs ? raw * gsv : raw));
            }
            for (int64_t i = 0; i < m; i++) scale_codes[c0 + i] = scale_table[key[i]];
        }
    } else if (rule == RULE_E8M0) {
        for (int64_t i = 0; i < n; i++) {
            int32_t e = (int32_t)((f2u(scale[i]) >> 23) & 0xFFu) - p->e8m0_emax;
            scale_codes[i] = (uint8_t)(e < 0 ? 0 : e > p->e8m0_max ? p->e8m0_max : e);
        }
    } else {
        return -1;
    }
    if (rule == RULE_TABLE || rule == RULE_E8M0) /* the scales are the codes' values */
        for (int64_t i = 0; i < n; i++) scale[i] = scale_values[scale_codes[i]];
    if (gs) {
        for (int64_t i = 0; i < n; i++) eff[i] = scale[i] / gsv;
    } else {
        memcpy(eff, scale, (size_t)n * sizeof *eff);
    }
    lb_encode_args e = {p->band, eff, p->enc, p->pack, p->out};
    return lb_encode(&e);
}

/* Nibble packing of uint8 codes [n] (n even) into [n / 2]; returns the largest code (the caller
 * refuses codes above 15). */
int lb_pack_nibbles(const uint8_t *codes, int64_t n, uint8_t *out) {
    uint8_t m = 0;
    for (int64_t i = 0; i < n; i++) m = codes[i] > m ? codes[i] : m;
    for (int64_t i = 0; i < n / 2; i++) out[i] = (uint8_t)(codes[2 * i] | (codes[2 * i + 1] << 4));
    return m;
}


/* out[i] = values[codes[i]] for i < n: decoding through a format's own table of code values. */
void lb_decode(const uint8_t *codes, int64_t n, const float *values, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = values[codes[i]];
}

/* Codes of the n keys k (packed when pack) from steps, by the AVX2 loop where built with it
 * (simd) or the scalar one: tests compare both with the table on every key. */
void lb_step_codes(const uint16_t *steps, const uint16_t *k, int64_t n, int pack, int simd, uint8_t *out) {
    step_codes(steps, k, n, pack, out, simd);
}

/* The ABI version the loader checks (LB_ABI_VERSION, generated from lowbit.kernels.native.constants). */
int lb_version(void) { return LB_ABI_VERSION; }

/* The size of a parameter block (LB_ENCODE_ARGS, LB_QUANTIZE_ARGS, LB_GPTQ_ARGS,
 * LB_GRID_ARGS), -1 for another
 * value: the loader checks them against its ctypes mirrors. */
int64_t lb_sizeof(int which) {
    switch (which) {
    case LB_ENCODE_ARGS: return (int64_t)sizeof(lb_encode_args);
    case LB_QUANTIZE_ARGS: return (int64_t)sizeof(lb_quantize_args);
    case LB_GPTQ_ARGS: return (int64_t)sizeof(lb_gptq_args);
    case LB_GRID_ARGS: return (int64_t)sizeof(lb_grid_args);
    }
    return -1;
}
