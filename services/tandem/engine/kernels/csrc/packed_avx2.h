/* The packed linear's AVX2 + FMA micro-kernels (included by packed_linear.c, which
 * defines NR): tile_rows for CPUs without AVX-512. Each output is the same FMA chain
 * over k as the AVX-512 tiles compute, so the results are bit-identical to theirs. */
#ifndef TANDEM_PACKED_AVX2_H
#define TANDEM_PACKED_AVX2_H
#include <immintrin.h>

#define PAIRS 0 /* one panel at a time */

/* Walks a tile's share of the next panel (see next_panel_share) over its k loop: one
 * cache line into L2 every ``every`` k steps, so the next panel arrives while this one
 * computes rather than each first pass over a panel waiting on memory. */
typedef struct {
    const char *at, *end;
    int64_t every, due;
} prefetch_walk;

static inline prefetch_walk prefetch_walk_start(prefetch_span span, int64_t k_in) {
    const int64_t every = span.lines > 0 && k_in / span.lines > 0 ? k_in / span.lines : 1;
    return (prefetch_walk){span.at, span.at + 64 * span.lines, every, 0};
}

static inline __attribute__((always_inline)) void prefetch_walk_step(prefetch_walk *w, int64_t k) {
    if (w->at < w->end && k == w->due) {
        _mm_prefetch(w->at, _MM_HINT_T1);
        w->at += 64;
        w->due += w->every;
    }
}

/* y[r][0 .. cols) = x[r] . panel (+ bias) for R <= 3 rows: a panel's 32 channels in four
 * ymm of 8, the same FMA chain per output as the AVX-512 tile. */
static inline __attribute__((always_inline)) void tile(
        const float *x, int64_t k_in, const float *panel, const float *bias, float *y,
        int64_t n_out, const __m256i *mask, const int full, prefetch_span next, const int R) {
    __m256 a0[3], a1[3], a2[3], a3[3];  /* one array per ymm column: kept in registers */
    _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) a0[r] = a1[r] = a2[r] = a3[r] = _mm256_setzero_ps();
    prefetch_walk walk = prefetch_walk_start(next, k_in);
    for (int64_t k = 0; k < k_in; ++k) {
        prefetch_walk_step(&walk, k);
        const float *b = panel + k * NR;
        const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
        const __m256 b2 = _mm256_loadu_ps(b + 16), b3 = _mm256_loadu_ps(b + 24);
        _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {
            const __m256 a = _mm256_broadcast_ss(x + r * k_in + k);
            a0[r] = _mm256_fmadd_ps(a, b0, a0[r]);
            a1[r] = _mm256_fmadd_ps(a, b1, a1[r]);
            a2[r] = _mm256_fmadd_ps(a, b2, a2[r]);
            a3[r] = _mm256_fmadd_ps(a, b3, a3[r]);
        }
    }
    __m256 bv[4];
    for (int c = 0; c < 4; ++c)
        bv[c] = bias ? _mm256_maskload_ps(bias + 8 * c, mask[c]) : _mm256_setzero_ps();
    _Pragma("GCC unroll 4") for (int r = 0; r < R; ++r) {
        float *out = y + r * n_out;
        const __m256 v[4] = {bias ? _mm256_add_ps(a0[r], bv[0]) : a0[r],
                             bias ? _mm256_add_ps(a1[r], bv[1]) : a1[r],
                             bias ? _mm256_add_ps(a2[r], bv[2]) : a2[r],
                             bias ? _mm256_add_ps(a3[r], bv[3]) : a3[r]};
        for (int c = 0; c < 4; ++c) {
            if (full) _mm256_storeu_ps(out + 8 * c, v[c]);  /* masked stores are slow on AMD */
            else _mm256_maskstore_ps(out + 8 * c, mask[c], v[c]);
        }
    }
}

/* y[r][0 .. 16) = x[r] . half (+ bias) for R <= 6 rows: one half of a panel (16 channels,
 * ``half`` = panel or panel + 16, rows of the panel NR apart) in two ymm, 12 accumulators
 * per 2 loads and R broadcasts. Tiles of 4 rows and more take a panel in two such halves:
 * half the panel's bytes per FMA of the 3 x 32 tile above. */
static inline __attribute__((always_inline)) void tile_half(
        const float *x, int64_t k_in, const float *half, const float *bias, float *y,
        int64_t n_out, const __m256i *mask, const int full, prefetch_span next, const int R) {
    __m256 a0[6], a1[6];
    _Pragma("GCC unroll 6") for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
    prefetch_walk walk = prefetch_walk_start(next, k_in);
    for (int64_t k = 0; k < k_in; ++k) {
        prefetch_walk_step(&walk, k);
        const __m256 b0 = _mm256_loadu_ps(half + k * NR), b1 = _mm256_loadu_ps(half + k * NR + 8);
        _Pragma("GCC unroll 6") for (int r = 0; r < R; ++r) {
            const __m256 a = _mm256_broadcast_ss(x + r * k_in + k);
            a0[r] = _mm256_fmadd_ps(a, b0, a0[r]);
            a1[r] = _mm256_fmadd_ps(a, b1, a1[r]);
        }
    }
    const __m256 bv0 = bias ? _mm256_maskload_ps(bias, mask[0]) : _mm256_setzero_ps();
    const __m256 bv1 = bias ? _mm256_maskload_ps(bias + 8, mask[1]) : _mm256_setzero_ps();
    _Pragma("GCC unroll 6") for (int r = 0; r < R; ++r) {
        const __m256 v0 = bias ? _mm256_add_ps(a0[r], bv0) : a0[r];
        const __m256 v1 = bias ? _mm256_add_ps(a1[r], bv1) : a1[r];
        if (full) {
            _mm256_storeu_ps(y + r * n_out, v0);
            _mm256_storeu_ps(y + r * n_out + 8, v1);
        } else {
            _mm256_maskstore_ps(y + r * n_out, mask[0], v0);
            _mm256_maskstore_ps(y + r * n_out + 8, mask[1], v1);
        }
    }
}

static void tile_rows(const float *x, int64_t k_in, const float *panel, const float *bias,
                      float *y, int64_t n_out, int64_t cols, prefetch_span next, int rows) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i mask[4];  /* lanes below ``cols``, per ymm column */
    for (int c = 0; c < 4; ++c)
        mask[c] = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)cols - 8 * c), lane);
    const int full = cols == NR;
    if (rows < 4) {  /* decode-sized: the whole panel streamed once */
        switch (rows) {
#define TILE(R) case R: tile(x, k_in, panel, bias, y, n_out, mask, full, next, R); break;
            TILE(1) TILE(2) default: TILE(3)
#undef TILE
        }
        return;
    }
    for (int h = 0; h < 2; ++h) {
        if (16 * h >= cols) break;  /* a partial last panel's empty half */
        const float *hb = bias ? bias + 16 * h : NULL;
        const int64_t lo = next.lines * h / 2;  /* each half walks half the share */
        const prefetch_span part = {next.at + 64 * lo, next.lines * (h + 1) / 2 - lo};
        switch (rows) {
#define TILE(R) case R: tile_half(x, k_in, panel + 16 * h, hb, y + 16 * h, n_out, mask + 2 * h, full, part, R); break;
            TILE(4) TILE(5) default: TILE(6)
#undef TILE
        }
    }
}

#endif
