/* The prompt attention kernel's AMX pieces (paged_prefill_amx.c): K and V packed into the
 * tile products' pair-interleaved layouts, and S = Q K^T and O += P V on the tiles. */
#ifndef TANDEM_AMX_ATTENTION_H
#define TANDEM_AMX_ATTENTION_H
#include <immintrin.h>
#include <stdint.h>

#include "amx_tiles.h"
#include "transpose16.h"

#define AKT 256         /* keys per tile: each row's reductions and rescale once per tile */
#define ARB 16          /* score rows per block: a tile's rows */
#define AMX_MAX_D 256

/* Kp [D / 2][AKT] 32-bit pairs: Kp[dp][j] = the pair (K[j][2 dp], K[j][2 dp + 1]); keys
 * from nk on are zero. */
static void tandem_pack_keys(uint32_t *kp, const uint16_t *const *krow, int64_t nk, int64_t D) {
    for (int64_t j0 = 0; j0 < AKT; j0 += 16)
        for (int64_t p0 = 0; p0 < D / 2; p0 += 16) {
            __m512 r[16];
            for (int i = 0; i < 16; ++i)
                r[i] = j0 + i < nk ? _mm512_loadu_ps((const float *)(krow[j0 + i] + 2 * p0))
                                   : _mm512_setzero_ps();
            tandem_transpose16(r);
            for (int i = 0; i < 16; ++i) _mm512_storeu_ps((float *)(kp + (p0 + i) * AKT + j0), r[i]);
        }
}

/* Vp [AKT / 2][D][2]: Vp[jp][d] = (V[2 jp][d], V[2 jp + 1][d]); keys from nk on are zero. */
static void tandem_pack_values(uint16_t *vp, const uint16_t *const *vrow, int64_t nk, int64_t D) {
    __m512i lo_idx, hi_idx;
    {
        uint16_t lo[32], hi[32];
        for (int i = 0; i < 32; ++i) {
            lo[i] = (uint16_t)((i & 1 ? 32 : 0) + (i >> 1));
            hi[i] = (uint16_t)(lo[i] + 16);
        }
        lo_idx = _mm512_loadu_si512(lo);
        hi_idx = _mm512_loadu_si512(hi);
    }
    for (int64_t jp = 0; jp < AKT / 2; ++jp) {
        const int64_t a = 2 * jp, b = a + 1;
        for (int64_t d0 = 0; d0 < D; d0 += 32) {
            const __m512i va = a < nk ? _mm512_loadu_si512(vrow[a] + d0) : _mm512_setzero_si512();
            const __m512i vb = b < nk ? _mm512_loadu_si512(vrow[b] + d0) : _mm512_setzero_si512();
            uint16_t *dst = vp + (jp * D + d0) * 2;
            _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(va, lo_idx, vb));
            _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi16(va, hi_idx, vb));
        }
    }
}

/* S [16][64 nch] = Q[r0 ..] K^T over the packed tile's first 64 nch keys, four
 * accumulator tiles of 16 keys at a time. */
static inline void tandem_amx_scores(const uint16_t *qb, const uint32_t *kp, float *s, int64_t D,
                                     int64_t nch) {
    for (int64_t ch = 0; ch < nch; ++ch) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t dc = 0; dc < D / 32; ++dc) {
            const uint32_t *b = kp + dc * 16 * AKT + ch * 64;
            _tile_loadd(4, qb + dc * 32, D * 2);
            _tile_loadd(5, b, AKT * 4);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(5, b + 16, AKT * 4);
            _tile_dpbf16ps(1, 4, 5);
            _tile_loadd(5, b + 32, AKT * 4);
            _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(5, b + 48, AKT * 4);
            _tile_dpbf16ps(3, 4, 5);
        }
        float *sc = s + ch * 64;
        _tile_stored(0, sc, AKT * 4);
        _tile_stored(1, sc + 16, AKT * 4);
        _tile_stored(2, sc + 32, AKT * 4);
        _tile_stored(3, sc + 48, AKT * 4);
    }
}

/* O[r0 ..][d0 .. d0 + 16 nt) += P V over the packed tile (nt: 2 or 4 tiles of 16 dims). */
static inline void tandem_amx_values(const uint16_t *p, const uint16_t *vp, float *o, int64_t D,
                                     int64_t d0, int nt, int key_halves) {
    _tile_loadd(0, o + d0, D * 4);
    _tile_loadd(1, o + d0 + 16, D * 4);
    if (nt > 2) {
        _tile_loadd(2, o + d0 + 32, D * 4);
        _tile_loadd(3, o + d0 + 48, D * 4);
    }
    for (int kc = 0; kc < key_halves; ++kc) {
        const uint16_t *b = vp + (kc * 16 * D + d0) * 2;
        _tile_loadd(4, p + kc * 32, AKT * 2);
        _tile_loadd(5, b, D * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(5, b + 32, D * 4);
        _tile_dpbf16ps(1, 4, 5);
        if (nt > 2) {
            _tile_loadd(5, b + 64, D * 4);
            _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(5, b + 96, D * 4);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, o + d0, D * 4);
    _tile_stored(1, o + d0 + 16, D * 4);
    if (nt > 2) {
        _tile_stored(2, o + d0 + 32, D * 4);
        _tile_stored(3, o + d0 + 48, D * 4);
    }
}
#endif
