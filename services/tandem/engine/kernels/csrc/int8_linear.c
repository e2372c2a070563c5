/* Weight-only int8 linear on CPU: y = (x @ W_q.T) * scale + bias, fp32 activations.
 *
 * W_q [N, K] int8 with one fp32 scale per output channel, packed once like the fp32
 * packed layout (packed_linear.c) but in int8: panels of NR = 32 output channels,
 * K-major, [ceil(N / 32), K, 32] (the last panel zero-padded). A micro-tile multiplies up
 * to MR input rows by one panel: per k the panel's 32 int8 weights are widened to fp32
 * and feed one FMA per row and lane. Rows are taken MC at a time against every panel of
 * the thread's share (threads take contiguous runs of panels), so a decode step streams
 * each panel once (a quarter of the fp32 bytes), widening it as it goes, and a prompt's
 * block of rows widens each panel once into a buffer its tiles read from cache.
 *
 * Each output is one FMA chain over k = 0 .. K-1, then fma(acc, scale, bias): the same
 * sum in the same order whatever M is and whichever tile a row falls in, so a row's
 * result does not depend on the rest of its batch.
 *
 *   w     [N, K] int8 contiguous        packed [ceil(N / 32), K, 32] int8
 *   x     [M, K] fp32 contiguous        scale [N] fp32; bias [N] fp32 or NULL
 *   y     [M, N] fp32 contiguous
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "pack_panels.h"
#include "team.h"

#define NR TANDEM_PACK_WIDTH /* output channels per panel */
#define MC 168               /* input rows per block */
#define WIDEN_MIN_ROWS 24    /* blocks of this many rows widen each panel once, not per tile */

void tandem_pack_int8(const int8_t *w, int8_t *packed, int64_t n_out, int64_t k_in) {
    TANDEM_PACK_PANELS(w, packed, n_out, k_in);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

#define MR 12 /* input rows per micro-tile: 24 of 32 zmm accumulate */
#define WIDENS 1 /* tiles read a widened panel */

static inline __mmask16 lanes(int64_t n) {  /* the first n (0..16) of 16 lanes */
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}

/* y[r][0 .. cols) = (x[r] . panel) * scale + bias for R rows; the panel int8, widened as
 * it is read, or (``wide``) already widened to fp32: the same values, the same sums. */
static inline __attribute__((always_inline)) void tile(
        const float *x, int64_t k_in, const int8_t *panel, const float *wide, const float *scale,
        const float *bias, float *y, int64_t n_out, int64_t cols, const int R) {
    __m512 acc[MR][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < k_in; ++k) {
        __m512 b0, b1;
        if (wide != NULL) {
            b0 = _mm512_loadu_ps(wide + k * NR);
            b1 = _mm512_loadu_ps(wide + k * NR + 16);
        } else {
            const __m256i w8 = _mm256_loadu_si256((const __m256i *)(panel + k * NR));
            b0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(w8)));
            b1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(w8, 1)));
        }
        for (int r = 0; r < R; ++r) {
            const __m512 a = _mm512_set1_ps(x[r * k_in + k]);
            acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
        }
    }
    const __mmask16 lo = lanes(cols), hi = lanes(cols - 16);
    const __m512 s0 = _mm512_maskz_loadu_ps(lo, scale), s1 = _mm512_maskz_loadu_ps(hi, scale + 16);
    const __m512 c0 = bias ? _mm512_maskz_loadu_ps(lo, bias) : _mm512_setzero_ps();
    const __m512 c1 = bias ? _mm512_maskz_loadu_ps(hi, bias + 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
        _mm512_mask_storeu_ps(y + r * n_out, lo, _mm512_fmadd_ps(acc[r][0], s0, c0));
        _mm512_mask_storeu_ps(y + r * n_out + 16, hi, _mm512_fmadd_ps(acc[r][1], s1, c1));
    }
}

static void tile_rows(const float *x, int64_t k_in, const int8_t *panel, const float *wide,
                      const float *scale, const float *bias, float *y, int64_t n_out, int64_t cols,
                      int rows) {
    switch (rows) {
#define TILE(R) case R: tile(x, k_in, panel, wide, scale, bias, y, n_out, cols, R); break;
        TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7) TILE(8) TILE(9) TILE(10)
        TILE(11) default: TILE(12)
#undef TILE
    }
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define MR 2 /* input rows per micro-tile: 8 of 16 ymm accumulate, 4 hold the weights */
#define WIDENS 1

static inline __attribute__((always_inline)) void tile(
        const float *x, int64_t k_in, const int8_t *panel, const float *wide, const float *scale,
        const float *bias, float *y, int64_t n_out, int64_t cols, const int R) {
    __m256 acc[MR][4];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < k_in; ++k) {
        __m256 b[4];
        for (int c = 0; c < 4; ++c)
            b[c] = wide != NULL ? _mm256_loadu_ps(wide + k * NR + 8 * c)
                                : _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                      _mm_loadl_epi64((const __m128i *)(panel + k * NR + 8 * c))));
        for (int r = 0; r < R; ++r) {
            const __m256 a = _mm256_broadcast_ss(x + r * k_in + k);
            for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_fmadd_ps(a, b[c], acc[r][c]);
        }
    }
    float out[4 * 8];
    for (int r = 0; r < R; ++r) {
        for (int c = 0; c < 4; ++c) _mm256_storeu_ps(out + 8 * c, acc[r][c]);
        for (int64_t c = 0; c < cols; ++c)
            y[r * n_out + c] = fmaf(out[c], scale[c], bias ? bias[c] : 0.f);
    }
}

static void tile_rows(const float *x, int64_t k_in, const int8_t *panel, const float *wide,
                      const float *scale, const float *bias, float *y, int64_t n_out, int64_t cols,
                      int rows) {
    if (rows == 1) tile(x, k_in, panel, wide, scale, bias, y, n_out, cols, 1);
    else tile(x, k_in, panel, wide, scale, bias, y, n_out, cols, 2);
}

#else /* portable: the same chain per output; the compiler vectorizes over lanes */

#define MR 1
#define WIDENS 0 /* one row at a time: nothing to share a widened panel */

static void tile_rows(const float *x, int64_t k_in, const int8_t *panel, const float *wide,
                      const float *scale, const float *bias, float *y, int64_t n_out, int64_t cols,
                      int rows) {
    (void)rows;
    (void)wide;
    float acc[NR] = {0.f};
    for (int64_t k = 0; k < k_in; ++k)
        for (int c = 0; c < NR; ++c) acc[c] = fmaf(x[k], (float)panel[k * NR + c], acc[c]);
    for (int64_t c = 0; c < cols; ++c) y[c] = fmaf(acc[c], scale[c], bias ? bias[c] : 0.f);
}
#endif

void tandem_int8_linear_f32(const float *x, const int8_t *packed, const float *scale,
                            const float *bias, float *y, int64_t m_rows, int64_t n_out,
                            int64_t k_in) {
    const int64_t panels = (n_out + NR - 1) / NR;
#pragma omp parallel num_threads(tandem_team(panels))
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t j0 = panels * t / nt, j1 = panels * (t + 1) / nt;
        /* blocks of WIDEN_MIN_ROWS rows and more widen each panel once into ``wide`` (a
         * thread's buffer; without it they widen as they go) */
        float *wide = WIDENS && m_rows >= WIDEN_MIN_ROWS ? malloc(sizeof(float) * k_in * NR) : NULL;
        for (int64_t i0 = 0; i0 < m_rows; i0 += MC) {
            const int64_t i1 = i0 + MC < m_rows ? i0 + MC : m_rows;
            const int widen = wide != NULL && i1 - i0 >= WIDEN_MIN_ROWS;
            for (int64_t j = j0; j < j1; ++j) {
                const int64_t n = j * NR, cols = n_out - n < NR ? n_out - n : NR;
                const int8_t *panel = packed + j * k_in * NR;
                if (widen)
                    for (int64_t e = 0; e < k_in * NR; ++e) wide[e] = (float)panel[e];
                for (int64_t i = i0; i < i1; i += MR)
                    tile_rows(x + i * k_in, k_in, panel, widen ? wide : NULL, scale + n,
                              bias ? bias + n : NULL, y + i * n_out + n, n_out, cols,
                              (int)(i1 - i < MR ? i1 - i : MR));
            }
        }
        free(wide);
    }
}
