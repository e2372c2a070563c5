/* The GEMV's AVX2 + FMA blocks (included by gemv.c): 4 weight rows against up to
 * TILE_M = 2 input rows, 8 lanes (13 of 16 ymm), each output one vector sum over k in
 * steps of 8 then a fixed horizontal sum: the same value whatever M is. */
#ifndef TANDEM_GEMV_AVX2_H
#define TANDEM_GEMV_AVX2_H
#include <immintrin.h>
#include <string.h>

#define TILE_M 2 /* input rows per block */
#define GEMV_TAIL_CASES(BLOCK, x, w, bias, y, n, n_out, k_in, m0, R) /* only 1 is left */
#define PREFETCH_ROWS 8 /* rows ahead (a prefetch past the end of W is harmless) */

/* Lanes below ``left`` (all 8 from 8 on). */
static inline __m256i lanes8(int64_t left) {
    const int64_t n = left < 8 ? left : 8;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline __m256 load8_f32(const float *p, int64_t left) {
    return left >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes8(left));
}

static inline __m256 load8_bf16(const uint16_t *p, int64_t left) {
    __m128i h;
    if (left >= 8) {
        h = _mm_loadu_si128((const __m128i *)p);
    } else {  /* the row's last elements, zero-filled */
        uint16_t tail[8] = {0};
        memcpy(tail, p, (size_t)left * sizeof *p);
        h = _mm_loadu_si128((const __m128i *)tail);
    }
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));  /* bf16 = fp32's top half */
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* Rows n..n+R-1 of W (R <= 4) against M <= 2 input rows; W_T the element type. */
#define GEMV_BLOCK8(NAME, W_T, LOAD8)                                                          \
    static inline __attribute__((always_inline)) void NAME(                                    \
        const float *x, const W_T *w, const float *bias, float *y, int64_t n, int64_t n_out,   \
        int64_t k_in, const int M, const int R) {                                              \
        __m256 acc[2][4];                                                                      \
        _Pragma("GCC unroll 2") for (int m = 0; m < M; ++m)                                    \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_ps(); \
        for (int64_t k = 0; k < k_in; k += 8) {                                                \
            __m256 wv[4];                                                                      \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {                              \
                const W_T *row = w + (n + r) * k_in + k;                                       \
                wv[r] = LOAD8(row, k_in - k);                                                  \
                if (!(k & 15)) /* once a line: the same line of a later block */              \
                    _mm_prefetch((const char *)(row + PREFETCH_ROWS * k_in), _MM_HINT_T0);     \
            }                                                                                  \
            _Pragma("GCC unroll 2") for (int m = 0; m < M; ++m) {                              \
                const __m256 xv = load8_f32(x + m * k_in + k, k_in - k);                       \
                _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r)                            \
                    acc[m][r] = _mm256_fmadd_ps(wv[r], xv, acc[m][r]);                         \
            }                                                                                  \
        }                                                                                      \
        for (int m = 0; m < M; ++m)                                                            \
            for (int r = 0; r < R; ++r)                                                        \
                y[m * n_out + n + r] = hsum8(acc[m][r]) + (bias ? bias[n + r] : 0.f);          \
    }

GEMV_BLOCK8(block_f32, float, load8_f32)
GEMV_BLOCK8(block_bf16, uint16_t, load8_bf16)

#endif
