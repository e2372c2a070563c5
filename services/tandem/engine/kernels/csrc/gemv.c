/* Decode-sized linear on CPU: y = x @ W.T + bias for up to 16 input rows, with fp32
 * or bf16 weights and fp32 activations.
 *
 * A step of a few sequences is bound by reading the weight: each block of 4 rows of
 * W is streamed once from memory and multiplied with every input row while it sits in
 * registers, then in L1 (input rows in tiles of 4: one accumulator per input row and
 * weight row). Output channels are split over OpenMP threads in contiguous chunks, so
 * each thread streams its own part of W front to back. With AVX-512 (and with AVX2 +
 * FMA, gemv_avx2.h: 8 lanes, input rows in tiles of 2) each output is the same sum in
 * the same order whatever M is (the portable loop leaves that to the compiler's
 * vectorization).
 *
 *   x    [M, K] fp32 contiguous, 1 <= M <= TANDEM_GEMV_MAX_ROWS
 *   w    [N, K] fp32 or bf16 contiguous
 *   bias [N] fp32 or NULL
 *   y    [M, N] fp32 contiguous
 * Returns 0, or -1 when M is out of range.
 */
#include <stdint.h>

#include "kernels.h"
#include "kv_load.h"
#include "team.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#define PREFETCH_ROWS 8 /* rows ahead (a prefetch past the end of W is harmless) */

static inline __m512 load16_f32(const float *p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

static inline __m512 load16_bf16(const uint16_t *p, __mmask16 m) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));  /* bf16 = fp32's top half */
}

/* Rows n..n+R-1 of W (R <= 4) against M <= 4 input rows; W_T the element type. */
#define GEMV_BLOCK(NAME, W_T, LOAD16)                                                          \
    static inline __attribute__((always_inline)) void NAME(                                    \
        const float *x, const W_T *w, const float *bias, float *y, int64_t n, int64_t n_out,   \
        int64_t k_in, const int M, const int R) {                                              \
        __m512 acc[4][4];                                                                      \
        for (int m = 0; m < M; ++m)                                                            \
            for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();                       \
        for (int64_t k = 0; k < k_in; k += 16) {                                               \
            const __mmask16 mask = k + 16 <= k_in ? (__mmask16)0xFFFF                          \
                                                  : (__mmask16)((1u << (k_in - k)) - 1u);      \
            __m512 wv[4];                                                                      \
            for (int r = 0; r < R; ++r) {                                                      \
                const W_T *row = w + (n + r) * k_in + k;                                       \
                wv[r] = LOAD16(row, mask);                                                     \
                /* the same line of a later block: one software prefetch per load keeps     \
                 * enough reads in flight where hardware prefetchers stop at a page */       \
                _mm_prefetch((const char *)(row + PREFETCH_ROWS * k_in), _MM_HINT_T0);         \
            }                                                                                  \
            for (int m = 0; m < M; ++m) {                                                      \
                const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * k_in + k);               \
                for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(wv[r], xv, acc[m][r]); \
            }                                                                                  \
        }                                                                                      \
        for (int m = 0; m < M; ++m)                                                            \
            for (int r = 0; r < R; ++r)                                                        \
                y[m * n_out + n + r] =                                                         \
                    _mm512_reduce_add_ps(acc[m][r]) + (bias ? bias[n + r] : 0.f);              \
    }

GEMV_BLOCK(block_f32, float, load16_f32)
GEMV_BLOCK(block_bf16, uint16_t, load16_bf16)

#define TILE_M 4 /* input rows per block */
#define GEMV_TAIL_CASES(BLOCK, x, w, bias, y, n, n_out, k_in, m0, R)                           \
    case 2: BLOCK(x + m0 * k_in, w, bias, y + m0 * n_out, n, n_out, k_in, 2, R); break;        \
    case 3: BLOCK(x + m0 * k_in, w, bias, y + m0 * n_out, n, n_out, k_in, 3, R); break;

#elif defined(__AVX2__) && defined(__FMA__)
#include "gemv_avx2.h"
#endif

#if defined(TILE_M)
/* Input rows in tiles of TILE_M: a block of 4 weight rows (at most 4 x K elements, in L1
 * after the first tile streamed it in) against each tile in turn, so W is read from
 * memory once whatever M is. */
#define GEMV_TILES(BLOCK, x, w, bias, y, n, n_out, k_in, M, R)                                 \
    do {                                                                                       \
        int m0 = 0;                                                                            \
        for (; m0 + TILE_M <= M; m0 += TILE_M)                                                 \
            BLOCK(x + m0 * k_in, w, bias, y + m0 * n_out, n, n_out, k_in, TILE_M, R);          \
        switch (M - m0) {                                                                      \
            case 1: BLOCK(x + m0 * k_in, w, bias, y + m0 * n_out, n, n_out, k_in, 1, R); break; \
            GEMV_TAIL_CASES(BLOCK, x, w, bias, y, n, n_out, k_in, m0, R)                       \
            default: break;                                                                    \
        }                                                                                      \
    } while (0)

#define GEMV_ROWS(NAME, BLOCK, W_T)                                                            \
    static inline __attribute__((always_inline)) void NAME(                                    \
        const float *x, const W_T *w, const float *bias, float *y, int64_t n0, int64_t n1,     \
        int64_t n_out, int64_t k_in, const int M) {                                            \
        int64_t n = n0;                                                                        \
        for (; n + 4 <= n1; n += 4) GEMV_TILES(BLOCK, x, w, bias, y, n, n_out, k_in, M, 4);    \
        for (; n < n1; ++n) GEMV_TILES(BLOCK, x, w, bias, y, n, n_out, k_in, M, 1);            \
    }

#else /* portable: the compiler vectorizes the inner products */

#define GEMV_ROWS(NAME, BLOCK, W_T)                                                            \
    static inline void NAME(const float *x, const W_T *w, const float *bias, float *y,         \
                            int64_t n0, int64_t n1, int64_t n_out, int64_t k_in, const int M) { \
        for (int64_t n = n0; n < n1; ++n) {                                                    \
            const W_T *wn = w + n * k_in;                                                      \
            for (int m = 0; m < M; ++m) {                                                      \
                const float *xm = x + m * k_in;                                                \
                float acc = 0.f;                                                               \
                _Pragma("omp simd reduction(+ : acc)")                                         \
                for (int64_t k = 0; k < k_in; ++k) acc += xm[k] * BLOCK(wn + k);              \
                y[m * n_out + n] = acc + (bias ? bias[n] : 0.f);                               \
            }                                                                                  \
        }                                                                                      \
    }
#define block_f32 tandem_load_f32
#define block_bf16 tandem_load_bf16
#endif

GEMV_ROWS(rows_f32, block_f32, float)
GEMV_ROWS(rows_bf16, block_bf16, uint16_t)

/* One exported entry per weight type: threads take contiguous chunks of 4-row blocks. */
#define GEMV_ENTRY(NAME, ROWS, W_T)                                                            \
    int NAME(const float *x, const W_T *w, const float *bias, float *y, int64_t m_rows,        \
             int64_t n_out, int64_t k_in) {                                                    \
        if (m_rows < 1 || m_rows > TANDEM_GEMV_MAX_ROWS) return -1;                            \
        /* pieces of at least 64 output channels: below that a thread costs more than it reads */ \
        _Pragma("omp parallel num_threads(tandem_team(n_out / 64))") {                         \
            const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();                \
            const int64_t blocks = (n_out + 3) / 4;                                            \
            const int64_t n0 = blocks * t / nt * 4;                                            \
            const int64_t n1 = blocks * (t + 1) / nt * 4 < n_out ? blocks * (t + 1) / nt * 4 : n_out; \
            switch (m_rows) {                                                                  \
                case 1: ROWS(x, w, bias, y, n0, n1, n_out, k_in, 1); break;                    \
                case 2: ROWS(x, w, bias, y, n0, n1, n_out, k_in, 2); break;                    \
                case 3: ROWS(x, w, bias, y, n0, n1, n_out, k_in, 3); break;                    \
                case 4: ROWS(x, w, bias, y, n0, n1, n_out, k_in, 4); break;                    \
                default: ROWS(x, w, bias, y, n0, n1, n_out, k_in, (int)m_rows); break;         \
            }                                                                                  \
        }                                                                                      \
        return 0;                                                                              \
    }

GEMV_ENTRY(tandem_gemv_f32, rows_f32, float)
GEMV_ENTRY(tandem_gemv_bf16, rows_bf16, uint16_t)
