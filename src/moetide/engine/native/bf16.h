/* bf16 <-> fp32 for moetide's native kernels (included by each source, one definition per translation unit),
   and reads and writes of arrays whose dtype is a runtime flag. */
#ifndef MOETIDE_BF16_H
#define MOETIDE_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* round to nearest even, as torch's bf16 conversion (NaN stays NaN) */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* element i of an fp32 or (bf16 != 0) bf16 array, as fp32; a store rounds to the array's dtype */
static inline float load_any(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store_any(void *p, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* v rounded to the dtype, kept in fp32 (where a torch op in that dtype would round) */
static inline float to_dtype(float v, int bf16) { return bf16 ? round_bf16(v) : v; }

#if defined(__AVX512F__)
#include <immintrin.h>

/* elements i .. i+15 of an fp32 or (bf16 != 0) bf16 array as 16 fp32 lanes (bf16 widened exactly) */
static inline __attribute__((always_inline)) __m512 load16(const void *p, int64_t i, int bf16) {
    if (bf16) {
        const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)p + i);
}
#endif

#endif
