/* bf16 linears on AMX tiles: y = bf16(x W^T + b) written as fp32, x fp32 (rounded to bf16
 * for the product, as oneDNN rounds a bf16 product's input), W bf16 packed once. With
 * round_output 0 (an LM head: logits) y is the fp32 sum itself, not rounded to bf16; an
 * MLP's gate|up product can end in its SiLU·mul instead (tandem_amx_gate_up_silu), and a
 * whole MLP run in one call (tandem_amx_mlp: the SiLU·mul goes straight into the down
 * product's bf16 input tiles, the down product run by the same threads).
 *
 * Packed weight: blocks of 16 outputs x 32 inputs in the tile product's pair-interleaved
 * layout, 1 KB each, input-major within an output block:
 *   wp[((nb * Kb + kb) * 16 + kp) * 32 + 2 n + e] = W[16 nb + n][32 kb + 2 kp + e]
 * (zero beyond N or K; Nb = ceil(N / 16) rounded up to even, Kb = ceil(K / 32)).
 * A call rounds x into a zero-padded bf16 copy in tiles (16 rows x 32 inputs, 1 KB each,
 * so a tile load reads 1 KB in a row), then each item (32 rows, 32 outputs) accumulates
 * 2 x 2 tiles over K. Items run by panels of rows whose bf16 copy fits in L2
 * (A_PANEL_BYTES), output-major within a panel: a decode step's few rows read each weight
 * block once in all, and a prompt's row blocks reuse a weight block from cache while their
 * panel stays in L2. An item's block is written out (bias, rounding) while the next item's
 * tiles compute.
 * Each output is the same accumulation over K whatever the batch: a row's result does
 * not depend on its batch.
 */
#define _GNU_SOURCE  /* syscall() in amx_tiles.h */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "silu.h"
#include "team.h"

/* Whether a gate|up product of 2 inter outputs can end in its SiLU·mul here: each half
 * starts on a 16-output block. */
int tandem_amx_fuses_gate_up(int64_t inter) { return inter > 0 && inter % 16 == 0; }

static inline int64_t tandem_amx_pairs(int64_t N) {  /* pairs of 16-output blocks of N outputs */
    return ((N + 15) / 16 + 1) / 2;
}

/* The packed layout (plain C: bf16_avx512_linear.c reads it too, on CPUs without AMX). */
void tandem_amx_pack_linear(const uint16_t *w, uint16_t *wp, int64_t N, int64_t K) {
    const int64_t Kb = (K + 31) / 32, Nb = 2 * tandem_amx_pairs(N);
#pragma omp parallel for num_threads(tandem_team(Nb)) schedule(static)
    for (int64_t nb = 0; nb < Nb; ++nb)
        for (int64_t kb = 0; kb < Kb; ++kb) {
            uint16_t *dst = wp + (nb * Kb + kb) * 512;
            for (int kp = 0; kp < 16; ++kp)
                for (int n = 0; n < 16; ++n)
                    for (int e = 0; e < 2; ++e) {
                        const int64_t row = nb * 16 + n, col = kb * 32 + 2 * kp + e;
                        dst[kp * 32 + n * 2 + e] = row < N && col < K ? w[row * K + col] : 0;
                    }
        }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512BW__)
#include "amx_tiles.h"

#define A_PANEL_BYTES (512 * 1024)

int tandem_amx_linear_supported(void) { return tandem_amx_permitted(); }

/* Where input (m, k) of a product's bf16 input tiles lies (Kb: 32-input blocks a row):
 * 16 rows x 32 inputs contiguous (1 KB) per tile, input-major within 16-row groups, so a
 * tile load reads 1 KB in a row. */
static inline int64_t tandem_amx_tile_at(int64_t m, int64_t k, int64_t Kb) {
    return (m / 16) * Kb * 512 + (k / 32) * 512 + (m % 16) * 32 + k % 32;
}

/* What an item's 32 x 32 fp32 block ``c`` becomes: ``out`` rows m0 .. (< M), ``ld`` apart
 * (or, SILU_TILES, rows of ``tiles``). */
typedef struct {
    const float *bias;
    float *out;
    int64_t M, N, ld;
    int mode;  /* TANDEM_AMX_RAW, TANDEM_AMX_ROUND, TANDEM_AMX_SILU or TANDEM_AMX_SILU_TILES */
    uint16_t *tiles;  /* SILU_TILES: the result in bf16, in the input tiles of a product over
                       * N inputs (tandem_amx_to_tiles's layout; rows >= M left unwritten) */
} tandem_amx_epilogue;

enum { TANDEM_AMX_RAW, TANDEM_AMX_ROUND, TANDEM_AMX_SILU, TANDEM_AMX_SILU_TILES };

static inline __m512 tandem_amx_to_bf16(__m512 v) {  /* rounded to bf16, kept as fp32 */
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Rows r0 .. r1 - 1 (< 32) of block ``c``, whose outputs start at n0: plus the bias, rounded
 * to bf16 unless RAW, written out; SILU: columns 0-15 are gate outputs n0 .. n0 + 15 and
 * 16-31 the up outputs N + n0 .. (bias there), written as silu(gate) * up at n0 .. n0 + 15
 * (tandem_silu_mul1, as tandem_silu_mul_f32 computes it); SILU_TILES: that, rounded to bf16
 * as a product rounds its input, into ``tiles``. */
static inline void tandem_amx_store_rows(const float *c, const tandem_amx_epilogue *e,
                                         int64_t m0, int64_t n0, int64_t r0, int64_t r1) {
    if (e->mode == TANDEM_AMX_SILU || e->mode == TANDEM_AMX_SILU_TILES) {
        const int64_t Kb = (e->N + 31) / 32;
        for (int64_t r = r0; r < r1 && m0 + r < e->M; ++r) {
            __m512 g = _mm512_load_ps(c + r * 32), u = _mm512_load_ps(c + r * 32 + 16);
            if (e->bias != NULL) {
                g = _mm512_add_ps(g, _mm512_loadu_ps(e->bias + n0));
                u = _mm512_add_ps(u, _mm512_loadu_ps(e->bias + e->N + n0));
            }
            float gs[16] __attribute__((aligned(64))), us[16] __attribute__((aligned(64)));
            float act[16] __attribute__((aligned(64)));
            _mm512_store_ps(gs, tandem_amx_to_bf16(g));
            _mm512_store_ps(us, tandem_amx_to_bf16(u));
            for (int i = 0; i < 16; ++i) act[i] = tandem_silu_mul1(gs[i], us[i]);
            if (e->mode == TANDEM_AMX_SILU)
                _mm512_storeu_ps(e->out + (m0 + r) * e->ld + n0, _mm512_load_ps(act));
            else
                _mm256_store_si256((__m256i *)(e->tiles + tandem_amx_tile_at(m0 + r, n0, Kb)),
                                   (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(act)));
        }
        return;
    }
    const int64_t nn = e->N - n0 < 32 ? e->N - n0 : 32;
    for (int64_t r = r0; r < r1 && m0 + r < e->M; ++r)
        for (int64_t j0 = 0; j0 < nn; j0 += 16) {
            const __mmask16 keep = nn - j0 >= 16 ? (__mmask16)0xffff
                                                 : (__mmask16)((1u << (nn - j0)) - 1);
            __m512 v = _mm512_load_ps(c + r * 32 + j0);
            if (e->bias != NULL) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, e->bias + n0 + j0));
            if (e->mode == TANDEM_AMX_ROUND) v = tandem_amx_to_bf16(v);
            _mm512_mask_storeu_ps(e->out + (m0 + r) * e->ld + n0 + j0, keep, v);
        }
}

/* x [M, K] fp32 rounded to bf16 into ``a`` in tiles (tandem_amx_tile_at), zero-padded to
 * Mp x Kp (M and K rounded up to 32). Run by the calling OpenMP team. */
static void tandem_amx_to_tiles(const float *x, int64_t M, int64_t K, uint16_t *a) {
    const int64_t Kb = (K + 31) / 32, Kp = Kb * 32, Mp = (M + 31) / 32 * 32;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < Mp; ++m) {
        const float *src = x + (m < M ? m : 0) * K;  /* padding rows read nothing */
        for (int64_t k = 0; k < Kp; k += 16) {
            const int64_t left = m < M ? K - k : 0;
            const __mmask16 keep = left >= 16 ? (__mmask16)0xffff
                                 : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
            _mm256_store_si256((__m256i *)(a + tandem_amx_tile_at(m, k, Kb)),
                               (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(keep, src + k)));
        }
    }
}

/* The product of the input tiles ``a`` (M rows, K inputs) with the 16-output blocks of
 * ``wp``: item (row block mb, pair p) accumulates blocks first(p) and first(p) + step, 32
 * rows x 32 outputs, into ``e`` at output 16 * p * (SILU ? 1 : 2). Pairs are (2p, 2p + 1)
 * unless SILU, where they are (p, p + npairs): a gate block and its up block. Run by the
 * calling OpenMP team; ends without a barrier. */
static void tandem_amx_items(const uint16_t *a, int64_t M, int64_t K, const uint16_t *wp,
                             int64_t npairs, const tandem_amx_epilogue *e) {
    const int silu = e->mode == TANDEM_AMX_SILU || e->mode == TANDEM_AMX_SILU_TILES;
    const int64_t Kb = (K + 31) / 32, Kp = Kb * 32, Mp = (M + 31) / 32 * 32;
    int64_t panel = A_PANEL_BYTES / (Kp * 2) / 32;  /* 32-row blocks a panel */
    if (panel < 1) panel = 1;
    const int64_t mblocks = Mp / 32, items = mblocks * npairs;
    const int64_t rows_a_step = (32 + Kb - 1) / Kb;  /* of the previous block, stored per kb */
    float c[32 * 32] __attribute__((aligned(64)));
    int64_t prev_m0 = -1, prev_n0 = 0;  /* the block in c not yet stored */
    tandem_amx_configure();
#pragma omp for schedule(static) nowait  /* a thread's last block goes out as others compute */
    for (int64_t it = 0; it < items; ++it) {
        /* panel p0 .. p0 + pn - 1 of the row blocks, then output pair, then row block */
        const int64_t p0 = it / (panel * npairs) * panel;
        const int64_t pn = mblocks - p0 < panel ? mblocks - p0 : panel;
        const int64_t in_panel = it - p0 * npairs, np = in_panel / pn, mb = p0 + in_panel % pn;
        const uint16_t *a0 = a + 2 * mb * Kb * 512, *a1 = a0 + Kb * 512;
        const uint16_t *b0 = wp + (silu ? np : 2 * np) * Kb * 512;
        const uint16_t *b1 = b0 + (silu ? npairs : 1) * Kb * 512;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < Kb; ++kb) {
            _tile_loadd(4, a0 + kb * 512, 64);
            _tile_loadd(5, a1 + kb * 512, 64);
            _tile_loadd(6, b0 + kb * 512, 64);
            _tile_loadd(7, b1 + kb * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
            /* the previous block's rows go out while the tiles compute */
            if (prev_m0 >= 0 && kb * rows_a_step < 32)
                tandem_amx_store_rows(c, e, prev_m0, prev_n0, kb * rows_a_step,
                                      (kb + 1) * rows_a_step < 32 ? (kb + 1) * rows_a_step : 32);
        }
        _tile_stored(0, c, 128);
        _tile_stored(1, c + 16, 128);
        _tile_stored(2, c + 16 * 32, 128);
        _tile_stored(3, c + 16 * 32 + 16, 128);
        prev_m0 = mb * 32;
        prev_n0 = np * (silu ? 16 : 32);
    }
    if (prev_m0 >= 0) tandem_amx_store_rows(c, e, prev_m0, prev_n0, 0, 32);
    _tile_release();
}

static int64_t tandem_amx_tiles_numel(int64_t M, int64_t K) {
    return (M + 31) / 32 * 32 * ((K + 31) / 32 * 32);
}

/* x [M, K] fp32 through the product (or products) ``e`` says, its input rounded into tiles
 * first. ``e2``: a second product, of the first's bf16 result (SILU_TILES) with ``wp2``. */
static int tandem_amx_run(const float *x, int64_t M, int64_t K, const uint16_t *wp,
                          int64_t npairs, const tandem_amx_epilogue *e, const uint16_t *wp2,
                          int64_t npairs2, const tandem_amx_epilogue *e2) {
    if (!tandem_amx_permitted()) return -2;
    if (K < 1) return -3;
    if (M == 0) return 0;
    const int64_t items = (M + 31) / 32 * npairs;
    uint16_t *a = aligned_alloc(64, (size_t)tandem_amx_tiles_numel(M, K) * 2);
    if (a == NULL) return -1;
#pragma omp parallel num_threads(tandem_team(items))
    {
        tandem_amx_to_tiles(x, M, K, a);  /* its loop ends at a barrier */
        tandem_amx_items(a, M, K, wp, npairs, e);
        if (e2 != NULL) {
#pragma omp barrier
            tandem_amx_items(e->tiles, M, e->N, wp2, npairs2, e2);
        }
    }
    free(a);
    return 0;
}

int tandem_amx_linear(const float *x, int64_t M, int64_t K, const uint16_t *wp, int64_t N,
                      const float *bias, float *out, int round_output) {
    const tandem_amx_epilogue e = {bias, out, M, N, N,
                                   round_output ? TANDEM_AMX_ROUND : TANDEM_AMX_RAW, NULL};
    return tandem_amx_run(x, M, K, wp, tandem_amx_pairs(N), &e, NULL, 0, NULL);
}

/* out [M, inter] = silu(bf16(x Wg^T + bg)) * bf16(x Wu^T + bu) with the gate|up weight
 * [2 inter, K] packed by tandem_amx_pack_linear (inter a multiple of 16): the values
 * tandem_amx_linear then tandem_silu_mul_f32 give, the product not written out. */
int tandem_amx_gate_up_silu(const float *x, int64_t M, int64_t K, const uint16_t *wp,
                            int64_t inter, const float *bias, float *out) {
    if (!tandem_amx_fuses_gate_up(inter)) return -3;
    const tandem_amx_epilogue e = {bias, out, M, inter, inter, TANDEM_AMX_SILU, NULL};
    return tandem_amx_run(x, M, K, wp, inter / 16, &e, NULL, 0, NULL);
}

/* An MLP: out [M, N] = bf16(silu·mul(x [M, K] through gate|up) Wd^T + bd), Wd [N, inter]
 * packed by tandem_amx_pack_linear: the values tandem_amx_gate_up_silu then
 * tandem_amx_linear give, the SiLU·mul written once, in bf16, as the down product's input
 * tiles. */
int tandem_amx_mlp(const float *x, int64_t M, int64_t K, const uint16_t *wgu, int64_t inter,
                   const float *bgu, const uint16_t *wd, int64_t N, const float *bd, float *out) {
    if (!tandem_amx_fuses_gate_up(inter)) return -3;
    if (M == 0 || !tandem_amx_permitted()) return M == 0 ? 0 : -2;
    const int64_t kb = (inter + 31) / 32;
    uint16_t *act = aligned_alloc(64, (size_t)tandem_amx_tiles_numel(M, inter) * 2);
    if (act == NULL) return -1;
    if (inter % 32 != 0)  /* inputs inter .. 32 kb - 1 of the down product (16 of them): zero */
        for (int64_t m = 0; m < (M + 31) / 32 * 32; ++m)
            memset(act + tandem_amx_tile_at(m, inter, kb), 0, 32);
    const tandem_amx_epilogue gu = {bgu, NULL, M, inter, inter, TANDEM_AMX_SILU_TILES, act};
    const tandem_amx_epilogue down = {bd, out, M, N, N, TANDEM_AMX_ROUND, NULL};
    const int rc = tandem_amx_run(x, M, K, wgu, inter / 16, &gu, wd, tandem_amx_pairs(N), &down);
    free(act);
    return rc;
}

#else  /* no AMX-BF16: never called (tandem_amx_linear_supported says no) */
int tandem_amx_linear_supported(void) { return 0; }
int tandem_amx_linear(const float *x, int64_t M, int64_t K, const uint16_t *wp, int64_t N,
                      const float *bias, float *out, int round_output) {
    return -2;
}
int tandem_amx_gate_up_silu(const float *x, int64_t M, int64_t K, const uint16_t *wp,
                            int64_t inter, const float *bias, float *out) {
    return -2;
}
int tandem_amx_mlp(const float *x, int64_t M, int64_t K, const uint16_t *wgu, int64_t inter,
                   const float *bgu, const uint16_t *wd, int64_t N, const float *bd, float *out) {
    return -2;
}
#endif
