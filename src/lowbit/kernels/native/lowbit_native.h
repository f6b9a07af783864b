/* lowbit native kernels: what lowbit_native.c and gptq_native.c share (float bits, exact
 * conversions from the 16-bit source formats). Compiled into one library (build.py). */
#ifndef LOWBIT_NATIVE_H
#define LOWBIT_NATIVE_H
#include "lowbit_constants.h" /* generated at build time (build.py) */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

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

#endif
