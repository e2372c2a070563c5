/* bf16 linears on AVX-512 for CPUs with AVX-512 BF16 but without AMX tiles (Zen 4,
 * Cooper Lake, Xeons whose AMX the OS withholds): y = bf16(x W^T + b) written as fp32
 * (with round_output 0, the fp32 sum itself: an LM head's logits), x fp32 rounded to bf16
 * for the product.
 *
 * W is packed by tandem_amx_pack_linear (amx_linear.c): per 16-output block, the input
 * pairs in order, each pair of the block's 16 outputs one 64-byte vector
 *   wp[(nb * Kb * 16 + kp) * 32 + 2 n + e] = W[16 nb + n][2 kp + e]
 * Two kernels read it, each output one fp32 sum over the pairs in order, per pair the odd
 * input's product added first, then the even one's:
 *   - tandem_bf16_dot_linear: vdpbf16ps, a broadcast input pair times a weight vector
 *     (AMD: on a Zen 4, oneDNN's vdpbf16ps prompts ran faster than fp32);
 *   - tandem_bf16_fma_linear: fp32 FMAs on the weights widened in registers and x rounded
 *     to bf16 (Intel: vdpbf16ps ran slower than the FMAs on a Xeon; both in
 *     services/RESULTS.md). Products of bf16
 *     values are exact in fp32, so these are vdpbf16ps's sums as Intel defines them (two
 *     RNE FMAs a pair, odd input first), but for denormals, which vdpbf16ps flushes.
 * A call copies x rounded to bf16 (pairs for the dot products, widened for the FMAs,
 * zero-padded to Kb * 32 inputs), then each item accumulates up to MR rows x (NB_DOT,
 * NB_FMA, or for one or two rows NB_FMA_FEW: more chains in flight, each two FMAs deep a
 * pair) 16-output blocks over every pair, one accumulator per row and block: each
 * output is the same sum whatever the batch, so a row's result does not depend on its
 * batch. Items run by panels of rows whose copy fits in L2 (PANEL_BYTES), output-major
 * within a panel, so a prompt's row tiles reuse a weight group from cache and a decode
 * step's few rows read each weight once.
 */
#include <stdint.h>
#include <stdlib.h>

#include "kernels.h"
#include "team.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

#define MR 6      /* rows an item */
#define NB_DOT 4  /* 16-output blocks an item: 24 accumulators + 4 weight vectors */
#define NB_FMA 3  /* 18 accumulators + 6 widened weight vectors + 2 broadcasts */
#define NB_FMA_FEW 6  /* up to 2 rows: 12 accumulators + 12 widened weight vectors */
#define NB_MAX 6  /* the accumulators' and weight vectors' arrays */
#define PANEL_BYTES (512 * 1024)

int tandem_bf16_avx512_supported(void) { return 1; }

/* acc [mr][nb] for outputs of blocks nb0 .. into rows m0 .. of y: plus the bias, rounded
 * to bf16 (RNE) unless ``raw`` (outputs >= N left alone) */
static inline __attribute__((always_inline)) void store(
        __m512 acc[MR][NB_MAX], int mr, int nb, int64_t m0, int64_t nb0, const float *bias,
        float *y, int64_t N, int raw) {
    for (int j = 0; j < nb; ++j) {
        const int64_t n0 = (nb0 + j) * 16;
        if (n0 >= N) break;
        const __mmask16 keep = N - n0 >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (N - n0)) - 1);
        const __m512 b = bias != NULL ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
        for (int r = 0; r < mr; ++r) {
            __m512 v = acc[r][j];
            if (bias != NULL) v = _mm512_add_ps(v, b);
            if (!raw)
                v = _mm512_castsi512_ps(_mm512_slli_epi32(
                        _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
            _mm512_mask_storeu_ps(y + (m0 + r) * N + n0, keep, v);
        }
    }
}

/* Rows m0 .. m0 + mr - 1 times blocks nb0 .. nb0 + nb - 1, over Kb * 16 input pairs:
 * on vdpbf16ps, ``a`` [M, pairs] x's bf16 pairs; or (``fma``) on FMAs, ``a`` [M, 2 pairs]
 * x rounded to bf16, as fp32, each weight vector widened into its odd inputs (the pairs'
 * high halves) and even ones. mr, nb and fma are constants where it is inlined: the
 * accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(
        const void *a, const uint16_t *wp, int64_t Kb, int64_t m0, int mr, int64_t nb0, int nb,
        const float *bias, float *y, int64_t N, int raw, int fma) {
    __m512 acc[MR][NB_MAX];
    for (int r = 0; r < mr; ++r)
        for (int j = 0; j < nb; ++j) acc[r][j] = _mm512_setzero_ps();
    const uint16_t *w = wp + nb0 * Kb * 512;
    const int64_t pairs = Kb * 16;
    const uint32_t *xp = (const uint32_t *)a + m0 * pairs;
    const float *xf = (const float *)a + m0 * 2 * pairs;
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    for (int64_t kp = 0; kp < pairs; ++kp) {
        __m512i wv[NB_MAX];
        for (int j = 0; j < nb; ++j) wv[j] = _mm512_loadu_si512(w + j * Kb * 512 + kp * 32);
        if (fma) {
            __m512 odd[NB_MAX], even[NB_MAX];
            for (int j = 0; j < nb; ++j) {
                odd[j] = _mm512_castsi512_ps(_mm512_and_si512(wv[j], high));
                even[j] = _mm512_castsi512_ps(_mm512_slli_epi32(wv[j], 16));
            }
            for (int r = 0; r < mr; ++r) {
                const __m512 xo = _mm512_set1_ps(xf[r * 2 * pairs + 2 * kp + 1]);
                const __m512 xe = _mm512_set1_ps(xf[r * 2 * pairs + 2 * kp]);
                for (int j = 0; j < nb; ++j) {
                    acc[r][j] = _mm512_fmadd_ps(xo, odd[j], acc[r][j]);
                    acc[r][j] = _mm512_fmadd_ps(xe, even[j], acc[r][j]);
                }
            }
        } else {
            for (int r = 0; r < mr; ++r) {
                const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[r * pairs + kp]);
                for (int j = 0; j < nb; ++j)
                    acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xv, (__m512bh)wv[j]);
            }
        }
    }
    store(acc, mr, nb, m0, nb0, bias, y, N, raw);
}

/* A tile with mr and nb as constants, for every (mr, nb) a kernel runs: full items, and
 * the last row tile and output group. */
#define TILE(FMA, MRC, NBC) tile(a, wp, Kb, m0, MRC, nb0, NBC, bias, y, N, raw, FMA); break;
#define TILE_NB3(F, MRC)                                                     \
    switch (nb) {                                                            \
        case 3: TILE(F, MRC, 3)                                              \
        case 2: TILE(F, MRC, 2)                                              \
        default: TILE(F, MRC, 1)                                             \
    }
#define TILE_NB4(F, MRC)                                                     \
    switch (nb) {                                                            \
        case 4: TILE(F, MRC, 4)                                              \
        default: TILE_NB3(F, MRC)                                            \
    }
#define TILE_NB6(F, MRC)                                                     \
    switch (nb) {                                                            \
        case 6: TILE(F, MRC, 6)                                              \
        case 5: TILE(F, MRC, 5)                                              \
        default: TILE_NB4(F, MRC)                                            \
    }

static void item_dot(const void *a, const uint16_t *wp, int64_t Kb, int64_t m0, int mr,
                     int64_t nb0, int nb, const float *bias, float *y, int64_t N, int raw) {
    switch (mr) {  /* NB_DOT blocks at most */
        case 6: TILE_NB4(0, 6) break;
        case 5: TILE_NB4(0, 5) break;
        case 4: TILE_NB4(0, 4) break;
        case 3: TILE_NB4(0, 3) break;
        case 2: TILE_NB4(0, 2) break;
        default: TILE_NB4(0, 1) break;
    }
}

static void item_fma(const void *a, const uint16_t *wp, int64_t Kb, int64_t m0, int mr,
                     int64_t nb0, int nb, const float *bias, float *y, int64_t N, int raw) {
    switch (mr) {  /* NB_FMA blocks at most, NB_FMA_FEW for one or two rows */
        case 6: TILE_NB3(1, 6) break;
        case 5: TILE_NB3(1, 5) break;
        case 4: TILE_NB3(1, 4) break;
        case 3: TILE_NB3(1, 3) break;
        case 2: TILE_NB6(1, 2) break;
        default: TILE_NB6(1, 1) break;
    }
}

/* Rows of x rounded to bf16 into ``a``: pairs (the dot products) or widened to fp32
 * (the FMAs), Kb * 32 inputs a row, zero past K. Run by the calling OpenMP team. */
static void copy_input(const float *x, int64_t M, int64_t K, int64_t Kb, void *a, int fma) {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m)
        for (int64_t k = 0; k < Kb * 32; k += 32) {
            const int64_t left = K - k;
            const __mmask16 lo = left >= 16 ? (__mmask16)0xffff
                               : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
            const __mmask16 hi = left >= 32 ? (__mmask16)0xffff
                               : left > 16 ? (__mmask16)((1u << (left - 16)) - 1) : 0;
            /* cvtne2ps: the second operand's 16 values first */
            const __m512i pairs = (__m512i)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, x + m * K + k + 16),
                                                               _mm512_maskz_loadu_ps(lo, x + m * K + k));
            if (!fma) {
                _mm512_store_si512((uint32_t *)a + m * Kb * 16 + k / 2, pairs);
                continue;
            }
            float *row = (float *)a + m * Kb * 32 + k;
            _mm512_store_si512(row, _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(pairs)), 16));
            _mm512_store_si512(row + 16, _mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(pairs, 1)), 16));
        }
}

static int run(const float *x, int64_t M, int64_t K, const uint16_t *wp, int64_t N,
               const float *bias, float *y, int round_output, int fma) {
    if (K < 1 || N < 1) return -3;
    if (M == 0) return 0;
    const int64_t Kb = (K + 31) / 32;
    const int64_t row_bytes = fma ? Kb * 32 * 4 : Kb * 16 * 4;  /* of the input's copy */
    const int64_t nb = fma ? (M <= 2 ? NB_FMA_FEW : NB_FMA) : NB_DOT;
    const int64_t blocks = (N + 15) / 16, groups = (blocks + nb - 1) / nb;
    const int64_t tiles = (M + MR - 1) / MR;
    int64_t panel = PANEL_BYTES / (row_bytes * MR);  /* row tiles a panel */
    if (panel < 1) panel = 1;
    void *a = aligned_alloc(64, (size_t)(M * row_bytes));
    if (a == NULL) return -1;
    const int64_t items = tiles * groups;
    const int raw = !round_output;
#pragma omp parallel num_threads(tandem_team(items > M ? items : M))
    {
        copy_input(x, M, K, Kb, a, fma);  /* its loop ends at a barrier */
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; ++it) {
            /* panel t0 .. t0 + tn - 1 of the row tiles, then output group, then row tile */
            const int64_t t0 = it / (panel * groups) * panel;
            const int64_t tn = tiles - t0 < panel ? tiles - t0 : panel;
            const int64_t in_panel = it - t0 * groups, g = in_panel / tn, t = t0 + in_panel % tn;
            const int64_t m0 = t * MR, nb0 = g * nb;
            const int mr = (int)(M - m0 < MR ? M - m0 : MR), n = (int)(blocks - nb0 < nb ? blocks - nb0 : nb);
            if (fma)
                item_fma(a, wp, Kb, m0, mr, nb0, n, bias, y, N, raw);
            else
                item_dot(a, wp, Kb, m0, mr, nb0, n, bias, y, N, raw);
        }
    }
    free(a);
    return 0;
}

int tandem_bf16_dot_linear(const float *x, int64_t M, int64_t K, const uint16_t *wp, int64_t N,
                           const float *bias, float *y, int round_output) {
    return run(x, M, K, wp, N, bias, y, round_output, 0);
}

int tandem_bf16_fma_linear(const float *x, int64_t M, int64_t K, const uint16_t *wp, int64_t N,
                           const float *bias, float *y, int round_output) {
    return run(x, M, K, wp, N, bias, y, round_output, 1);
}

#else  /* no AVX-512 BF16: never called (tandem_bf16_avx512_supported says no) */
int tandem_bf16_avx512_supported(void) { return 0; }
int tandem_bf16_dot_linear(const float *x, int64_t M, int64_t K, const uint16_t *wp, int64_t N,
                           const float *bias, float *y, int round_output) {
    return -2;
}
int tandem_bf16_fma_linear(const float *x, int64_t M, int64_t K, const uint16_t *wp, int64_t N,
                           const float *bias, float *y, int round_output) {
    return -2;
}
#endif
