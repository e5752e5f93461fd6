/*
 * What sparseattn's C kernels share: the cpu backend's (sparseattn/backends/cpu_kernels.c) and the paged
 * engine's fused step (sparseattn/vllm/paged_kernels.c).
 *
 * The codes both sides of ctypes read (storage dtypes, statuses), the cache-element loaders, and the
 * online-softmax step. Each kernel file is compiled alone with this header beside it
 * (sparseattn.backends.cpu_kernels.build_library copies it there), so everything here is static and
 * inlined into its callers: the loops compile inside each kernel's own, as if written there.
 *
 * Both are built with -ffast-math (vectorised expf/tanhf from libmvec), which assumes finite numbers:
 * a running maximum therefore starts at the finite SA_NO_SCORE, never at -inf.
 */
#ifndef SPARSEATTN_KERNEL_COMMON_H
#define SPARSEATTN_KERNEL_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define SA_NO_SCORE (-1e30f) /* the running maximum before any token (finite: see above) */

/* Storage dtypes, as sparseattn.backends.cpu_kernels.DTYPE_CODES numbers them; the fp8 ones (vLLM's fp8 KV caches:
 * bytes holding float8 e4m3fn or e5m2 numbers, read by the paged kernel only, sparseattn.vllm.paged_kernel.FP8_CODES). */
enum { SA_F32 = 0, SA_BF16 = 1, SA_F16 = 2, SA_FP8_E4M3 = 3, SA_FP8_E5M2 = 4 };

/* The float16 whose bits are h, as float32 (exact: every float16 is a float32), without the compiler's _Float16. */
static inline float sa_half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    uint32_t bits;
    if (exp == 0x1Fu) {
        bits = sign | 0x7F800000u | (mant << 13); /* inf, NaN */
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13); /* normal: rebias 15 -> 127 */
    } else {                                          /* zero or subnormal: mant x 2^-24 */
        float f = (float)mant * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

/* An fp8 byte read as the paged kernel reads it: its bits placed in a float16 (e5m2: the top byte of the float16 it
 * is; e4m3fn: sign, then exponent and mantissa shifted into the float16's, so the number comes out 2^-8 times its
 * value, subnormals included). The caller multiplies by SA_FP8_E4M3's 256 with the layer's scale, once per query or
 * output row, not per element. e4m3fn's NaN (0x7F) reads as 480 / 256: an fp8 cache holds scaled, saturated numbers. */
static inline uint16_t sa_fp8_half_bits(uint8_t x, int dtype) {
    return dtype == SA_FP8_E5M2 ? (uint16_t)((uint16_t)x << 8) : (uint16_t)(((x & 0x80u) << 8) | ((x & 0x7Fu) << 7));
}

/* The statuses both kernels return (each adds its own); the Python side words them (_ERRORS). */
enum { SA_OK = 0, SA_NO_MEMORY = 2, SA_BAD_DTYPE = 4 };

/* Whether this build reads float16 storage: the build retries with -DSA_NO_FLOAT16 where the compiler
 * has no _Float16. */
static inline int sa_float16_built(void) {
#ifdef SA_NO_FLOAT16
    return 0;
#else
    return 1;
#endif
}

/* *dst = the bfloat16 whose bits are h: the top half of a float32, so widening is a shift, exact. It stores
 * through memcpy rather than returning the float: so the loops around it compile as the bit copy they are
 * (a returned float changed both kernels' vectorised loops). */
static inline void sa_bf16_to_float(float *dst, uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    memcpy(dst, &bits, 4);
}

/* n elements of a cache row (any storage dtype) as float32 into dst (fp8: as sa_fp8_half_bits reads them). */
static inline void sa_to_float(const void *src, int dtype, int64_t n, float *restrict dst) {
    if (dtype == SA_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dtype == SA_BF16) {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; ++i) sa_bf16_to_float(dst + i, s[i]);
    } else if (dtype == SA_FP8_E4M3 || dtype == SA_FP8_E5M2) {
        const uint8_t *s = (const uint8_t *)src;
        for (int64_t i = 0; i < n; ++i) dst[i] = sa_half_to_float(sa_fp8_half_bits(s[i], dtype));
    }
#ifndef SA_NO_FLOAT16
    else {
        const _Float16 *s = (const _Float16 *)src;
        for (int64_t i = 0; i < n; ++i) dst[i] = (float)s[i];
    }
#endif
}

/* One online-softmax step of a query row over a block of N logits P[0..N) (overwritten by their weights
 * exp(P_j - m')), TOP being the block's largest: the running maximum M becomes m', the running sum L is rescaled
 * to it and grows by the weights, and ALPHA (declared here) is exp(M - m'), by which the caller rescales its
 * weighted sum of values (a loop over its own head-dim type). A macro, not an inline function: inlined, the
 * same statements compiled to other code in both kernels' hot loops; expanded, they compile as written there. */
#define SA_SOFTMAX_STEP(P, N, TOP, M, L, ALPHA)                     \
    const float ALPHA##_max = (M) > (TOP) ? (M) : (TOP);            \
    const float ALPHA = expf((M) - ALPHA##_max);                    \
    float ALPHA##_sum = 0.f;                                        \
    for (int ALPHA##_j = 0; ALPHA##_j < (N); ++ALPHA##_j) {         \
        const float ALPHA##_e = expf((P)[ALPHA##_j] - ALPHA##_max); \
        (P)[ALPHA##_j] = ALPHA##_e;                                 \
        ALPHA##_sum += ALPHA##_e;                                   \
    }                                                               \
    (L) = (L) * ALPHA + ALPHA##_sum;                                \
    (M) = ALPHA##_max

#endif /* SPARSEATTN_KERNEL_COMMON_H */
