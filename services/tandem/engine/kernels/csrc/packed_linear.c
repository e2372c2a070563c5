/* fp32 linear on a packed weight, for every row count: y = x @ W.T + bias.
 *
 * The weight is packed once into panels of NR = 32 output channels, K-major: panel j
 * holds W[j*32 .. j*32+31][k] for k = 0 .. K-1 as K runs of 32 contiguous floats (the
 * last panel zero-padded). A micro-kernel multiplies up to MR = 14 input rows by one
 * panel with 28 vector accumulators: per k two loads of the panel, one broadcast per
 * row (AVX2, packed_avx2.h: up to 3 rows x 32 channels or 6 rows x 16, 12 accumulators
 * of 8 lanes). Rows are taken MC at a time (their inputs stay in L2) against every panel of
 * the thread's share (a panel stays in L2 across the block's micro-tiles), so:
 *   - a decode step of a few rows streams each panel from memory once, front to back;
 *   - a prompt of many rows runs at the core's FMA rate, like oneDNN's blocked layout.
 *     From PAIR_ROWS rows on, a second micro-kernel takes two adjacent panels (64
 *     channels) for MR2 = 6 rows: per k four panel loads and 6 broadcasts feed 24 FMAs
 *     (the 14 x 32 tile needs 16 loads for 28): faster on long prompts.
 *     A decode step streams one panel at a time, as the hardware prefetcher likes it:
 *     tiles of fewer than PREFETCH_MIN_ROWS rows issue no software prefetch, which at
 *     1-8 rows only took load slots from the stream (faster without, the product
 *     then reading at the rate of a plain streaming sum; two panels at once were slower
 *     still); tiles of more rows compute long enough per load that it helps.
 *   - AVX2: in blocks of NEXT_PANEL_MIN_ROWS rows and more, the tiles over one panel
 *     prefetch the next panel between them, a line every few k steps. Without it each
 *     panel's first pass waited on memory, and a weight read from memory took far longer
 *     at a few rows than at one; with it the time grows far less with the rows
 *     (services/RESULTS.md).
 * Threads take contiguous runs of panels.
 *
 * Each output is one accumulator's FMA chain over k = 0 .. K-1, then + bias: the same
 * sum in the same order whatever M is and whichever tile a row falls in, so a row's
 * result does not depend on the rest of its batch.
 *
 * tandem_packed_gate_up_silu_f32 runs an MLP's fused gate|up weight the same way, pairing
 * each gate panel with the up panel of the same channels, and applies SiLU·mul to each
 * tile: the [M, 2 * inter] product is never written out.
 *
 *   w      [N, K] fp32 contiguous        packed [ceil(N / 32), K, 32]
 *   x      [M, K] fp32 contiguous        bias [N] fp32 or NULL        y [M, N] fp32
 */
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"
#include "pack_panels.h"
#include "silu.h"
#include "team.h"

#define NR TANDEM_PACK_WIDTH /* output channels per panel */
#if defined(__AVX512F__)
#define MR 14                /* input rows per micro-tile: 28 of 32 zmm accumulate */
#else
#define MR 6                 /* AVX2: 6 rows x half a panel, 12 of 16 ymm accumulate */
#endif
#define MC 168               /* input rows per block */
#define MR2 6                /* input rows per two-panel micro-tile */
#define PAIR_ROWS 128        /* from this many rows on, two panels at a time */
#define PREFETCH_K 16        /* k steps ahead (2 KB of the panel) */
#define PREFETCH_MIN_ROWS 9      /* tiles of this many rows and more prefetch the panel */
#define NEXT_PANEL_MIN_ROWS 4    /* AVX2: blocks of this many rows and more prefetch the next panel */

/* A run of cache lines a tile may prefetch as it goes (the AVX2 tiles do; the others
 * ignore it): its share of the next panel. */
typedef struct {
    const char *at;
    int64_t lines;
} prefetch_span;

/* Tile ``t`` of ``tiles`` over one panel: its even share of the next panel's lines
 * (``next``: NULL at the thread's last panel, or in blocks too small to want it). */
static inline prefetch_span next_panel_share(const float *next, int64_t k_in, int64_t t, int64_t tiles) {
    if (next == NULL) return (prefetch_span){NULL, 0};
    const int64_t lines = k_in * NR * (int64_t)sizeof(float) / 64;  /* NR = 32: 2 a k step */
    const int64_t lo = lines * t / tiles, hi = lines * (t + 1) / tiles;
    return (prefetch_span){(const char *)next + 64 * lo, hi - lo};
}

void tandem_pack_linear_f32(const float *w, float *packed, int64_t n_out, int64_t k_in) {
    TANDEM_PACK_PANELS(w, packed, n_out, k_in);
}

#if defined(__AVX512F__)
#include <immintrin.h>

#define PAIRS 1 /* tile_pair_rows below */

/* y[r][0 .. cols) = x[r] . panel (+ bias) for R rows; ``cols`` <= 32 via the masks. */
static inline __attribute__((always_inline)) void tile(
        const float *x, int64_t k_in, const float *panel, const float *bias, float *y,
        int64_t n_out, __mmask16 lo, __mmask16 hi, const int R) {
    __m512 acc[MR][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t k = 0; k < k_in; ++k) {
        const float *b = panel + k * NR;
        const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16);
        if (R >= PREFETCH_MIN_ROWS) {  /* R is a constant: resolved at compile time */
            _mm_prefetch((const char *)(b + PREFETCH_K * NR), _MM_HINT_T0);
            _mm_prefetch((const char *)(b + PREFETCH_K * NR + 16), _MM_HINT_T0);
        }
        for (int r = 0; r < R; ++r) {
            const __m512 a = _mm512_set1_ps(x[r * k_in + k]);
            acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
        }
    }
    const __m512 bias0 = bias ? _mm512_maskz_loadu_ps(lo, bias) : _mm512_setzero_ps();
    const __m512 bias1 = bias ? _mm512_maskz_loadu_ps(hi, bias + 16) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
        _mm512_mask_storeu_ps(y + r * n_out, lo, bias ? _mm512_add_ps(acc[r][0], bias0) : acc[r][0]);
        _mm512_mask_storeu_ps(y + r * n_out + 16, hi, bias ? _mm512_add_ps(acc[r][1], bias1) : acc[r][1]);
    }
}

/* y[r][0 .. 32 + cols2) = x[r] . (panel p0 | panel p1) (+ bias) for R <= MR2 rows; the
 * second panel's ``cols2`` <= 32 via the masks. */
static inline __attribute__((always_inline)) void tile_pair(
        const float *x, int64_t k_in, const float *p0, const float *p1, const float *bias,
        float *y, int64_t n_out, __mmask16 lo, __mmask16 hi, const int R) {
    __m512 acc[MR2][4];
    for (int r = 0; r < R; ++r)
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < k_in; ++k) {
        const __m512 b0 = _mm512_loadu_ps(p0 + k * NR), b1 = _mm512_loadu_ps(p0 + k * NR + 16);
        const __m512 b2 = _mm512_loadu_ps(p1 + k * NR), b3 = _mm512_loadu_ps(p1 + k * NR + 16);
        for (int r = 0; r < R; ++r) {
            const __m512 a = _mm512_set1_ps(x[r * k_in + k]);
            acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
            acc[r][2] = _mm512_fmadd_ps(a, b2, acc[r][2]);
            acc[r][3] = _mm512_fmadd_ps(a, b3, acc[r][3]);
        }
    }
    const __mmask16 masks[4] = {(__mmask16)0xFFFF, (__mmask16)0xFFFF, lo, hi};
    for (int c = 0; c < 4; ++c) {
        const __m512 bc = bias ? _mm512_maskz_loadu_ps(masks[c], bias + 16 * c) : _mm512_setzero_ps();
        for (int r = 0; r < R; ++r)
            _mm512_mask_storeu_ps(y + r * n_out + 16 * c, masks[c], bias ? _mm512_add_ps(acc[r][c], bc)
                                                                        : acc[r][c]);
    }
}

static __mmask16 lanes(int64_t n) {  /* the first n (0..16) of 16 lanes */
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}

static void tile_pair_rows(const float *x, int64_t k_in, const float *p0, const float *p1,
                           const float *bias, float *y, int64_t n_out, int64_t cols2, int rows) {
    const __mmask16 lo = lanes(cols2), hi = lanes(cols2 - 16);
    switch (rows) {
#define TILE(R) case R: tile_pair(x, k_in, p0, p1, bias, y, n_out, lo, hi, R); break;
        TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) default: TILE(6)
#undef TILE
    }
}

static void tile_rows(const float *x, int64_t k_in, const float *panel, const float *bias,
                      float *y, int64_t n_out, int64_t cols, prefetch_span next, int rows) {
    (void)next;
    const __mmask16 lo = lanes(cols), hi = lanes(cols - 16);
    switch (rows) {
#define TILE(R) case R: tile(x, k_in, panel, bias, y, n_out, lo, hi, R); break;
        TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6) TILE(7)
        TILE(8) TILE(9) TILE(10) TILE(11) TILE(12) TILE(13) default: TILE(14)
#undef TILE
    }
}

#elif defined(__AVX2__) && defined(__FMA__)
#include "packed_avx2.h"

#else /* portable: the same sums in the same order; the compiler vectorizes over lanes */

#define PAIRS 0 /* one panel at a time */

static void tile_rows(const float *x, int64_t k_in, const float *panel, const float *bias,
                      float *y, int64_t n_out, int64_t cols, prefetch_span next, int rows) {
    (void)next;
    for (int r = 0; r < rows; ++r) {
        float acc[NR] = {0.f};
        for (int64_t k = 0; k < k_in; ++k) {
            const float a = x[r * k_in + k];
            for (int c = 0; c < NR; ++c) acc[c] += a * panel[k * NR + c];
        }
        for (int64_t c = 0; c < cols; ++c) y[r * n_out + c] = acc[c] + (bias ? bias[c] : 0.f);
    }
}
#endif

void tandem_packed_linear_f32(const float *x, const float *packed, const float *bias, float *y,
                              int64_t m_rows, int64_t n_out, int64_t k_in) {
    const int64_t panels = (n_out + NR - 1) / NR;
#if PAIRS
    const int pairs = m_rows >= PAIR_ROWS;
#endif
#pragma omp parallel num_threads(tandem_team(panels))
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t j0 = panels * t / nt, j1 = panels * (t + 1) / nt;
        for (int64_t i0 = 0; i0 < m_rows; i0 += MC) {
            const int64_t i1 = i0 + MC < m_rows ? i0 + MC : m_rows;
            for (int64_t j = j0; j < j1; ++j) {
                const int64_t n = j * NR, cols = n_out - n < NR ? n_out - n : NR;
#if PAIRS
                if (pairs && j + 1 < j1) {  /* panels j and j + 1 */
                    const int64_t cols2 = n_out - n - NR < NR ? n_out - n - NR : NR;
                    for (int64_t i = i0; i < i1; i += MR2)
                        tile_pair_rows(x + i * k_in, k_in, packed + j * k_in * NR, packed + (j + 1) * k_in * NR,
                                       bias ? bias + n : NULL, y + i * n_out + n, n_out, cols2,
                                       (int)(i1 - i < MR2 ? i1 - i : MR2));
                    ++j;
                    continue;
                }
#endif
                const float *next = j + 1 < j1 && i1 - i0 >= NEXT_PANEL_MIN_ROWS
                                        ? packed + (j + 1) * k_in * NR : NULL;
                const int64_t tiles = (i1 - i0 + MR - 1) / MR;
                for (int64_t i = i0; i < i1; i += MR)
                    tile_rows(x + i * k_in, k_in, packed + j * k_in * NR, bias ? bias + n : NULL,
                              y + i * n_out + n, n_out, cols,
                              next_panel_share(next, k_in, (i - i0) / MR, tiles),
                              (int)(i1 - i < MR ? i1 - i : MR));
            }
        }
    }
}

/* out[r][i] = silu(g[r][i]) * u[r][i] for r < rows, i < NR: ``gu`` holds a tile's [rows][2 * NR],
 * gate then up. */
static void silu_mul_rows(const float *gu, float *out, int64_t out_stride, int rows) {
    for (int r = 0; r < rows; ++r) {
        const float *g = gu + r * 2 * NR, *u = g + NR;
        float *o = out + r * out_stride;
#pragma omp simd
        for (int c = 0; c < NR; ++c) o[c] = tandem_silu_mul1(g[c], u[c]);
    }
}

/* The MLP's SiLU·mul on the fused gate|up product, without writing the product out:
 * ``packed`` is the packed [2 * inter, K] gate|up weight (inter a multiple of 32, so gate
 * panel j and up panel j + inter / 32 hold the same channels), ``bias`` [2 * inter] or NULL,
 * out [M, inter] = silu(x @ Wg.T + bg) * (x @ Wu.T + bu). Each product is the FMA chain
 * tandem_packed_linear_f32 computes and the SiLU·mul tandem_silu_mul_f32's, so the result
 * is bit-identical to those two calls; threads take contiguous runs of gate panels. */
void tandem_packed_gate_up_silu_f32(const float *x, const float *packed, const float *bias, float *out,
                                    int64_t m_rows, int64_t inter, int64_t k_in) {
    const int64_t panels = inter / NR;
#pragma omp parallel num_threads(tandem_team(panels))
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t j0 = panels * t / nt, j1 = panels * (t + 1) / nt;
        float gu[MR * 2 * NR], b[2 * NR];  /* one micro-tile's gate | up; their biases */
        for (int64_t i0 = 0; i0 < m_rows; i0 += MC) {
            const int64_t i1 = i0 + MC < m_rows ? i0 + MC : m_rows;
            for (int64_t j = j0; j < j1; ++j) {
                const float *gate = packed + j * k_in * NR, *up = packed + (j + panels) * k_in * NR;
                for (int c = 0; bias && c < NR; ++c) {
                    b[c] = bias[j * NR + c];
                    b[NR + c] = bias[inter + j * NR + c];
                }
#if PAIRS
                for (int64_t i = i0; i < i1; i += MR2) {
                    const int rows = (int)(i1 - i < MR2 ? i1 - i : MR2);
                    tile_pair_rows(x + i * k_in, k_in, gate, up, bias ? b : NULL, gu, 2 * NR, NR, rows);
                    silu_mul_rows(gu, out + i * inter + j * NR, inter, rows);
                }
#else
                const int want = j + 1 < j1 && i1 - i0 >= NEXT_PANEL_MIN_ROWS;
                const int64_t tiles = (i1 - i0 + MR - 1) / MR;
                for (int64_t i = i0; i < i1; i += MR) {
                    const int rows = (int)(i1 - i < MR ? i1 - i : MR), t = (int)((i - i0) / MR);
                    tile_rows(x + i * k_in, k_in, gate, bias ? b : NULL, gu, 2 * NR, NR,
                              next_panel_share(want ? gate + k_in * NR : NULL, k_in, t, tiles), rows);
                    tile_rows(x + i * k_in, k_in, up, bias ? b + NR : NULL, gu + NR, 2 * NR, NR,
                              next_panel_share(want ? up + k_in * NR : NULL, k_in, t, tiles), rows);
                    silu_mul_rows(gu, out + i * inter + j * NR, inter, rows);
                }
#endif
            }
        }
    }
}
