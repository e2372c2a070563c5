/* KV cache element types: fp32 as is, bf16 widened to fp32 (its top 16 bits); one
 * element, or 8 (AVX2) or 16 (AVX-512) consecutive elements as a vector; fp32 rounded
 * to bf16; and one token's K or V row stored into its cache slot in either type. */
#ifndef TANDEM_KV_LOAD_H
#define TANDEM_KV_LOAD_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

static inline float tandem_load_f32(const float *p) { return *p; }

static inline float tandem_load_bf16(const uint16_t *p) {
    const uint32_t bits = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* fp32 -> bf16, rounded to nearest even as torch rounds it (a NaN stays a NaN). */
static inline uint16_t tandem_round_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* One token's n K (or V) values into cache slot ``slot`` of a cache of n values a slot:
 * copied (fp32) or rounded as torch rounds them (bf16). */
static inline void tandem_store_kv_row(void *cache, int bf16, int64_t slot, const float *src,
                                       int64_t n) {
    if (bf16) {
        uint16_t *dst = (uint16_t *)cache + slot * n;
        for (int64_t i = 0; i < n; ++i) dst[i] = tandem_round_bf16(src[i]);
    } else {
        memcpy((float *)cache + slot * n, src, (size_t)n * sizeof(float));
    }
}

#if defined(__AVX2__)
static inline __m256 tandem_load8_f32(const float *p) { return _mm256_loadu_ps(p); }

static inline __m256 tandem_load8_bf16(const uint16_t *p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#endif

#if defined(__AVX512F__)
static inline __m512 tandem_load16_f32(const float *p) { return _mm512_loadu_ps(p); }

static inline __m512 tandem_load16_bf16(const uint16_t *p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#endif
#endif
