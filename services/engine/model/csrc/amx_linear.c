/* bf16 linears on AMX tiles: y = bf16(x W^T + b) written as fp32, x fp32 (rounded to bf16
 * for the product, as oneDNN rounds a bf16 product's input), W bf16 packed once. With
 * round_output 0 (an LM head: logits) y is the fp32 sum itself, not rounded to bf16.
 *
 * Packed weight: blocks of 16 outputs x 32 inputs in the tile product's pair-interleaved
 * layout, 1 KB each, input-major within an output block:
 *   wp[((nb * Kb + kb) * 16 + kp) * 32 + 2 n + e] = W[16 nb + n][32 kb + 2 kp + e]
 * (zero beyond N or K; Nb = ceil(N / 16) rounded up to even, Kb = ceil(K / 32)).
 * A call rounds x into a zero-padded bf16 copy [Mp][32 Kb] (Mp: M rounded up to 32), then
 * each item (32 rows, 32 outputs) accumulates 2 x 2 tiles over K. Items run by panels of
 * rows whose bf16 copy fits in L2 (A_PANEL_BYTES), output-major within a panel: a decode
 * step's few rows read each weight block once in all, and a prompt's row blocks reuse a
 * weight block from cache while their panel stays in L2.
 * Each output is the same accumulation over K whatever the batch: a row's result does
 * not depend on its batch.
 */
#define _GNU_SOURCE  /* syscall() in amx_tiles.h */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "kv_load.h"
#include "team.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512BW__)
#include "amx_tiles.h"

#define A_PANEL_BYTES (512 * 1024)

int tandem_amx_linear_supported(void) { return tandem_amx_permitted(); }

void tandem_amx_pack_linear(const uint16_t *w, uint16_t *wp, int64_t N, int64_t K) {
    const int64_t Kb = (K + 31) / 32, Nb = ((N + 15) / 16 + 1) / 2 * 2;
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

/* Rows m0 .. m0 + 31 of the item's 32 x 32 fp32 tile block ``c`` into ``out`` (rows < M,
 * outputs n0 .. n0 + nn - 1), plus the bias, rounded to bf16 if ``round_output``. */
static inline void tandem_amx_linear_store(const float *c, float *out, const float *bias,
                                           int64_t m0, int64_t M, int64_t n0, int64_t nn,
                                           int64_t N, int round_output) {
    for (int64_t r = 0; r < 32 && m0 + r < M; ++r)
        for (int64_t j0 = 0; j0 < nn; j0 += 16) {
            const __mmask16 keep = nn - j0 >= 16 ? (__mmask16)0xffff
                                                 : (__mmask16)((1u << (nn - j0)) - 1);
            __m512 v = _mm512_load_ps(c + r * 32 + j0);
            if (bias != NULL) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(keep, bias + n0 + j0));
            if (round_output) {
                const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
                v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            }
            _mm512_mask_storeu_ps(out + (m0 + r) * N + n0 + j0, keep, v);
        }
}

int tandem_amx_linear(const float *x, int64_t M, int64_t K, const uint16_t *wp, int64_t N,
                      const float *bias, float *out, int round_output) {
    if (!tandem_amx_permitted()) return -2;
    const int64_t Kb = (K + 31) / 32, Kp = Kb * 32, Nb = ((N + 15) / 16 + 1) / 2 * 2;
    const int64_t Mp = (M + 31) / 32 * 32, npairs = Nb / 2;
    int64_t panel = A_PANEL_BYTES / (Kp * 2) / 32;  /* 32-row blocks a panel */
    if (panel < 1) panel = 1;
    const int64_t mblocks = Mp / 32, items = mblocks * npairs;
    uint16_t *a = aligned_alloc(64, (size_t)(Mp * Kp * 2 + 63) / 64 * 64);
    if (a == NULL) return -1;
#pragma omp parallel num_threads(tandem_team(items))
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < Mp; ++m) {  /* x rounded to bf16, zero-padded */
            uint16_t *dst = a + m * Kp;
            int64_t k = 0;
            if (m < M) {
                const float *src = x + m * K;
                for (; k + 16 <= K; k += 16)
                    _mm256_storeu_si256((__m256i *)(dst + k),
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + k)));
                for (; k < K; ++k) dst[k] = tandem_round_bf16(src[k]);
            }
            memset(dst + k, 0, (size_t)(Kp - k) * 2);
        }
        float c[32 * 32] __attribute__((aligned(64)));
        tandem_amx_configure();
#pragma omp for schedule(static)
        for (int64_t it = 0; it < items; ++it) {
            /* panel p0 .. p0 + pn - 1 of the row blocks, then output pair, then row block */
            const int64_t p0 = it / (panel * npairs) * panel;
            const int64_t pn = mblocks - p0 < panel ? mblocks - p0 : panel;
            const int64_t in_panel = it - p0 * npairs, np = in_panel / pn, mb = p0 + in_panel % pn;
            const uint16_t *a0 = a + mb * 32 * Kp, *a1 = a0 + 16 * Kp;
            const uint16_t *b0 = wp + 2 * np * Kb * 512, *b1 = b0 + Kb * 512;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t kb = 0; kb < Kb; ++kb) {
                _tile_loadd(4, a0 + kb * 32, Kp * 2);
                _tile_loadd(5, a1 + kb * 32, Kp * 2);
                _tile_loadd(6, b0 + kb * 512, 64);
                _tile_loadd(7, b1 + kb * 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(0, c, 128);
            _tile_stored(1, c + 16, 128);
            _tile_stored(2, c + 16 * 32, 128);
            _tile_stored(3, c + 16 * 32 + 16, 128);
            const int64_t n0 = np * 32;
            tandem_amx_linear_store(c, out, bias, mb * 32, M, n0, N - n0 < 32 ? N - n0 : 32, N,
                                     round_output);
        }
        _tile_release();
    }
    free(a);
    return 0;
}

#else  /* no AMX-BF16: never called (tandem_amx_linear_supported says no) */
int tandem_amx_linear_supported(void) { return 0; }
void tandem_amx_pack_linear(const uint16_t *w, uint16_t *wp, int64_t N, int64_t K) {}
int tandem_amx_linear(const float *x, int64_t M, int64_t K, const uint16_t *wp, int64_t N,
                      const float *bias, float *out, int round_output) {
    return -2;
}
#endif
