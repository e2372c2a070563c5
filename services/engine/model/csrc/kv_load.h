/* KV cache element types: fp32 as is, bf16 widened to fp32 (its top 16 bits); one
 * element, or (with AVX-512) 16 consecutive elements as a vector. */
#ifndef TANDEM_KV_LOAD_H
#define TANDEM_KV_LOAD_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float tandem_load_f32(const float *p) { return *p; }

static inline float tandem_load_bf16(const uint16_t *p) {
    const uint32_t bits = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#if defined(__AVX512F__)
static inline __m512 tandem_load16_f32(const float *p) { return _mm512_loadu_ps(p); }

static inline __m512 tandem_load16_bf16(const uint16_t *p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#endif
#endif
