/* lowbit native kernels: what lowbit_native.c, gptq_native.c and reconstruct_native.c share (the parameter blocks of
 * the exported kernels, float bits, exact conversions from the 16-bit source formats). Compiled
 * into one library (build.py). */
#ifndef LOWBIT_NATIVE_H
#define LOWBIT_NATIVE_H
#include "lowbit_constants.h" /* generated at build time (build.py) */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* ---------------------------------------------------------------- parameter blocks
 * The exported kernels with many parameters take one of these by pointer (the ctypes mirrors are
 * lowbit.kernels.native.abi; lb_sizeof reports their sizes, checked at load with the ABI version). */

typedef struct {          /* a band of source values [rows, cols], row-major, contiguous */
    const void *x;
    int64_t rows, cols;
    int64_t g;            /* group size: groups of g consecutive elements of a row, the last one may be shorter */
    int32_t dtype;        /* float32 0, bfloat16 1, float16 2 */
} lb_band;

typedef struct {          /* an element format's encoding (lowbit.kernels.native.Encoding) */
    const uint8_t *table; /* minifloat: the 65536 codes of MiniFloat.key_table; NULL: INT */
    const uint16_t *steps; /* or NULL: that table as steps (MiniFloat.key_steps) */
    int32_t qmin, qmax;   /* INT bounds */
    int32_t bits;         /* INT: code bits */
    int32_t check_negative; /* unsigned format: negative input goes to the reference (its error) */
} lb_encoding;

typedef struct {          /* lb_encode */
    lb_band band;
    const float *eff;     /* [rows, ceil(cols / g)] divisors, or NULL: no division */
    lb_encoding enc;
    int32_t pack;         /* nibble-pack the codes (4-bit codes, cols even) */
    uint8_t *out;         /* codes [rows, cols] ([rows, cols / 2] packed) */
} lb_encode_args;

typedef struct {          /* lb_quantize */
    lb_band band;
    const float *gs;      /* the global scale [1], or NULL */
    const uint8_t *scale_table; /* RULE_TABLE: the scale format's key table */
    const float *scale_values;  /* RULE_TABLE, RULE_E8M0: the scale format's code values [256] */
    float divisor;
    int32_t rule;         /* RULE_* (lowbit_native.c) */
    int32_t e8m0_emax, e8m0_max; /* RULE_E8M0: the element format's largest exponent, the largest code */
    lb_encoding enc;
    int32_t pack;
    uint8_t *out;         /* codes, as lb_encode's */
    float *scale;         /* [rows, G] float32 scales */
    uint8_t *scale_codes; /* [rows, G] their codes (RULE_TABLE, RULE_E8M0), else NULL */
    float *eff;           /* [rows, G] scratch */
    float *lo;            /* [rows, G] scratch (RULE_FULL_RANGE), else NULL */
} lb_quantize_args;

typedef struct {          /* lb_gptq_sub (gptq_native.c) */
    float *W, *E;
    const float *dv, *ef;
    int64_t ds, m, R, nparts;
    const int64_t *a, *b, *up;
    int64_t ld, j0;
    int32_t kind;
    float lo, hi;
    uint32_t mask, lowest, shift;
} lb_gptq_args;

typedef struct {          /* lb_grid_gptq (ggml_native.c): one block of n columns, each a row of R floats */
    float *W, *E, *C;     /* [n, R] working weights (left final, as torch leaves them), errors, codes */
    const float *step, *offset, *div; /* [n, R] the grid per element; div: step, 1 where step is 0 */
    const uint8_t *zmask; /* [n, R] step == 0 (bool) */
    const float *u;       /* -Ub [in, in], element strides ld0 (row), ld1 (column); the block's is
                             from row and column j0 */
    int64_t ld0, ld1, j0, n, R;
    int64_t vec;          /* torch's float vector width: addr_'s scalar tail (two roundings) */
    float zero, lo, hi, fill;
} lb_grid_args;

enum { LB_ENCODE_ARGS = 0, LB_QUANTIZE_ARGS = 1, LB_GPTQ_ARGS = 2, LB_GRID_ARGS = 3 }; /* lb_sizeof's argument */

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

/* The nearest grid value of y (lowbit.kernels.native.rounding_args gives the arguments): kind 0
 * (INT): round half to even (default rounding mode), clamp to [lo, hi]; kind 1 (signed minifloat):
 * clamp to [-lo, lo] (lo: max finite), then the magic number M from the exponent field (at least
 * ``lowest``) plus ``shift``: (y + M) - M, two IEEE roundings (no -ffast-math: never reassociated).
 * The format's qdq up to the sign of a zero result. GPTQ's column loop and block reconstruction's
 * rounded weight both round with it. */
static inline float lb_grid_round(float y, int kind, float lo, float hi, uint32_t mask, uint32_t lowest,
                                  uint32_t shift) {
    if (kind == 0) {
        y = nearbyintf(y);
        return y < lo ? lo : (y > hi ? hi : y);
    }
    y = y < -lo ? -lo : (y > lo ? lo : y);
    uint32_t bits = f2u(y) & mask;
    bits = (bits > lowest ? bits : lowest) + shift;
    float M = u2f(bits);
    return (y + M) - M;
}

#endif
