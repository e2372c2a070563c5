/* Causal paged attention for prompt chunks over a bf16 cache, its products on AMX tiles
 * (CPUs with AMX-BF16; elsewhere tandem_paged_prefill_amx_supported says no). Same
 * arguments and result as tandem_paged_prefill_bf16 (paged_prefill.c): queries, softmax
 * and outputs fp32; the queries are rounded to bf16 for the score product and the
 * probabilities for the value product, each product accumulated in fp32, as torch's bf16
 * SDPA computes them.
 *
 * First every sequence's keys, per tile of AKT keys and kv head, are packed once into the
 * score product's pair-interleaved layout (Kp[d / 2][key][2]: a 16 x 16 transpose of
 * 32-bit pairs) and its values into the value product's (Vp[key / 2][d][2])
 * (amx_attention.h).
 * Then one task per (sequence, kv head, QT positions): M = QT * G score rows (row m = i * G
 * + g is position i of the task, query head kv_head * G + g), in blocks of 16 rows (a
 * tile's rows); for each key tile and each block of rows that reaches it:
 *   S [16][AKT] = Q K^T        (four accumulator tiles, D / 32 steps each)
 *   online softmax per row     (fp32; scale, causal/window mask, running max and sum;
 *                               the row's O rescaled by its factor; P rounded to bf16)
 *   O [16][D] += P V           (O's tiles loaded, AKT / 32 steps, stored)
 * and out = O / sum at the end.
 */
#define _GNU_SOURCE  /* syscall() */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "team.h"

#define TANDEM_AMX_PREFILL                                                                     \
    int tandem_paged_prefill_amx(                                                              \
        const float *q, int64_t q_stride, float *out, const int64_t *row0, const int64_t *pos0,  \
        const int64_t *num_queries, int64_t num_seqs, const uint16_t *k_cache,                 \
        const uint16_t *v_cache, const int64_t *block_table, int64_t table_stride,             \
        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,         \
        int64_t window, float scale)

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512BW__)
#include "amx_attention.h"
#include "vexp512.h"
#include "prefill_tasks.h"

int tandem_paged_prefill_amx_supported(int64_t head_dim) {
    return head_dim % 32 == 0 && head_dim <= AMX_MAX_D && tandem_amx_permitted();
}

/* 2^x on 16 floats, x <= 0, to a relative 3e-6 (P is rounded to bf16, a relative 4e-3,
 * and the row sums' error stays below it); exactly 0 below -126 (a masked score, -inf).
 * A degree-4 fit of 2^f on [-1/2, 1/2], scaled by 2^n. */
static inline __m512 tandem_amx_exp2(__m512 x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.f), _CMP_GE_OQ);
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(0.009560519829392433f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05591712146997452f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24024981260299683f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931219696998596f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999991655349731f));
    return _mm512_maskz_scalef_ps(live, p, n);  /* lanes below -126 (or -inf, NaN above) zero */
}

/* Online softmax of the block's 16 rows over keys k0 .. k0 + 16 nv - 1: P (bf16) from S,
 * the rows' max (of the unscaled scores) and sum moved on, their O rows rescaled. Every
 * row's max first, then every row's exponentials: no row waits on its own reductions. */
static inline void tandem_amx_softmax(float *s, uint16_t *p, float *o, float *mx, float *l,
                                      const int32_t *pos, int64_t k0, int64_t nv, int masked,
                                      int64_t window, float scale, int64_t D) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    float base[ARB], now[ARB], alpha[ARB];
    for (int r = 0; r < ARB; ++r) {
        float *sr = s + r * AKT;
        __m512 top[2] = {ninf, ninf};
        for (int64_t c = 0; c < nv; ++c) {
            __m512 v = _mm512_loadu_ps(sr + 16 * c);
            if (masked) {
                const __m512i key = _mm512_add_epi32(_mm512_set1_epi32((int32_t)(k0 + 16 * c)), iota);
                __mmask16 keep = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(pos[r]));
                if (window > 0)
                    keep &= _mm512_cmpgt_epi32_mask(
                        key, _mm512_set1_epi32((int32_t)(pos[r] - window)));
                v = _mm512_mask_mov_ps(ninf, keep, v);
                _mm512_storeu_ps(sr + 16 * c, v);
            }
            top[c & 1] = _mm512_max_ps(top[c & 1], v);
        }
        now[r] = _mm512_reduce_max_ps(_mm512_max_ps(top[0], top[1]));
    }
    {   /* the rows' new max and base, and the factor moving each row's O and sum on */
        /* max(now, old): a NaN in now leaves old (MAXPS returns its second operand then) */
        const __m512 old = _mm512_loadu_ps(mx), m = _mm512_max_ps(_mm512_loadu_ps(now), old);
        const __m512 bs = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(m, ninf, _CMP_NEQ_OQ), m);
        const __m512 a = tandem_exp512(_mm512_mul_ps(_mm512_sub_ps(old, bs), _mm512_set1_ps(scale)));
        _mm512_storeu_ps(mx, m);
        _mm512_storeu_ps(base, bs);
        _mm512_storeu_ps(alpha, a);
        _mm512_storeu_ps(l, _mm512_mul_ps(_mm512_loadu_ps(l), a));
    }
    for (int r = 0; r < ARB; ++r)
        if (alpha[r] != 1.f) {
            const __m512 a = _mm512_set1_ps(alpha[r]);
            for (int64_t d = 0; d < D; d += 16)
                _mm512_storeu_ps(o + r * D + d, _mm512_mul_ps(a, _mm512_loadu_ps(o + r * D + d)));
        }
    const float log2e = 1.44269504088896341f;
    const __m512 sc2 = _mm512_set1_ps(scale * log2e);
    for (int r = 0; r < ARB; ++r) {  /* exp((s - max) scale) = 2^((s - max) scale log2 e) */
        const float *sr = s + r * AKT;
        const __m512 b = _mm512_set1_ps(base[r] * scale * log2e);
        __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t c = 0; c < nv; c += 2) {  /* nv is even */
            const __m512 e0 = tandem_amx_exp2(_mm512_fmsub_ps(_mm512_loadu_ps(sr + 16 * c), sc2, b));
            const __m512 e1 = tandem_amx_exp2(_mm512_fmsub_ps(_mm512_loadu_ps(sr + 16 * c + 16), sc2, b));
            sum[0] = _mm512_add_ps(sum[0], e0);
            sum[1] = _mm512_add_ps(sum[1], e1);
            _mm512_storeu_si512(p + r * AKT + 16 * c, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        }
        l[r] += _mm512_reduce_add_ps(_mm512_add_ps(sum[0], sum[1]));
    }
}

typedef struct {
    uint16_t *q, *p;       /* Q [M][D], P [16][AKT] */
    float *o, *s, *mx, *l; /* O [M][D], S [16][AKT], running max and sum [M] */
    int32_t *pos;          /* [M]: each row's position */
} tandem_amx_scratch;

typedef struct {  /* every sequence's keys and values, packed once per call */
    uint32_t *kp;         /* per (tile, kv head): Kp [D / 2][AKT] */
    uint16_t *vp;         /* per (tile, kv head): Vp [AKT / 2][D][2] */
    int64_t *first;       /* [B + 1]: sequence b's packed tiles are first[b] .. first[b + 1] - 1 */
    int64_t *tile0;       /* [B]: the key tile (key / AKT) of sequence b's first packed tile */
} tandem_amx_packed;

/* Pack keys k0 .. k0 + nk - 1 of sequence ``table`` and kv head kh into one tile. */
static void tandem_amx_pack(uint32_t *kp, uint16_t *vp, const uint16_t *k_cache,
                            const uint16_t *v_cache, const int64_t *table, int64_t k0, int64_t nk,
                            int64_t kh, int64_t KVH, int64_t D, int64_t block_size) {
    const uint16_t *krow[AKT], *vrow[AKT];
    for (int64_t j = 0; j < nk; ++j) {
        const int64_t key = k0 + j;
        const int64_t at = ((table[key / block_size] * block_size + key % block_size) * KVH + kh) * D;
        krow[j] = k_cache + at;
        vrow[j] = v_cache + at;
    }
    tandem_pack_keys(kp, krow, nk, D);
    tandem_pack_values(vp, vrow, nk, D);
}

static void tandem_amx_task_run(const tandem_prefill_task *tk, const float *q, int64_t q_stride,
                                float *out, const int64_t *row0, const int64_t *pos0,
                                const tandem_amx_packed *pk, int64_t H, int64_t KVH, int64_t D,
                                int64_t window, float scale, const tandem_amx_scratch *w) {
    const int64_t G = H / KVH, b = tk->seq, kh = tk->kv_head, cnt = tk->count;
    const int64_t M = cnt * G, Mp = (M + ARB - 1) / ARB * ARB;
    const int64_t p_first = pos0[b] + tk->first, khi = p_first + cnt - 1;
    const int64_t klo = (window > 0 && p_first - window + 1 > 0) ? p_first - window + 1 : 0;
    const int64_t row_first = row0[b] + tk->first;

    for (int64_t m = 0; m < Mp; ++m) {  /* Q rows in bf16; padding rows zero */
        w->pos[m] = (int32_t)(p_first + (m < M ? m / G : cnt - 1));
        w->mx[m] = -INFINITY;
        w->l[m] = 0.f;
        uint16_t *dst = w->q + m * D;
        const float *src = q + (row_first + m / G) * q_stride + (kh * G + m % G) * D;
        for (int64_t d = 0; d < D; d += 16)
            _mm256_storeu_si256((__m256i *)(dst + d),
                                m < M ? (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + d))
                                      : _mm256_setzero_si256());
    }
    memset(w->o, 0, sizeof(float) * Mp * D);

    /* tiles of the packed keys (their first may start before klo: the window masks those) */
    for (int64_t k0 = klo / AKT * AKT; k0 <= khi; k0 += AKT) {
        const int64_t nk = khi - k0 + 1 < AKT ? khi - k0 + 1 : AKT;
        const int64_t at = (pk->first[b] + k0 / AKT - pk->tile0[b]) * KVH + kh;
        const uint32_t *kp = pk->kp + at * (D / 2 * AKT);
        const uint16_t *vp = pk->vp + at * (AKT * D);
        for (int64_t r0 = 0; r0 < Mp; r0 += ARB) {
            const int32_t *pos = w->pos + r0;
            if (pos[ARB - 1] < k0) continue;  /* every row of the block is before the tile */
            /* the keys some row of the block reaches, in chunks of 64 */
            const int64_t reach = pos[ARB - 1] - k0 + 1, nj = reach < nk ? reach : nk;
            const int64_t nch = (nj + 63) / 64;
            const int masked = k0 + 64 * nch - 1 > pos[0] ||
                               (window > 0 && k0 <= pos[ARB - 1] - window);
            tandem_amx_scores(w->q + r0 * D, kp, w->s, D, nch);
            tandem_amx_softmax(w->s, w->p, w->o + r0 * D, w->mx + r0, w->l + r0, pos, k0, 4 * nch,
                               masked, window, scale, D);
            const int halves = (int)((nj + 31) / 32);
            for (int64_t d0 = 0; d0 < D; d0 += 64)
                tandem_amx_values(w->p, vp, w->o + r0 * D, D, d0, D - d0 >= 64 ? 4 : 2, halves);
        }
    }

    for (int64_t m = 0; m < M; ++m) {  /* out = O / sum */
        const __m512 inv = _mm512_set1_ps(1.f / w->l[m]);
        float *dst = out + ((row_first + m / G) * H + kh * G + m % G) * D;
        for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(dst + d, _mm512_mul_ps(inv, _mm512_loadu_ps(w->o + m * D + d)));
    }
}

/* Positions per task: about 256 score rows, a multiple of 16 positions. */
static int64_t tandem_amx_positions(int64_t G) {
    const int64_t qt = 256 / G / 16 * 16;
    return qt < 16 ? 16 : qt;
}

TANDEM_AMX_PREFILL {
    if (!tandem_paged_prefill_amx_supported(head_dim)) return -2;
    const int64_t G = num_heads / num_kv_heads, D = head_dim, KVH = num_kv_heads;
    const int64_t QT = tandem_amx_positions(G), Mmax = QT * G;  /* a multiple of 16 */
    int64_t num_tasks;
    tandem_prefill_task *tasks = tandem_prefill_tasks(pos0, num_queries, num_seqs, KVH, QT, window,
                                                      &num_tasks);
    tandem_amx_packed pk = {NULL, NULL, malloc(sizeof(int64_t) * (num_seqs + 1)),
                            malloc(sizeof(int64_t) * (num_seqs > 0 ? num_seqs : 1))};
    int failed = tasks == NULL || pk.first == NULL || pk.tile0 == NULL;
    int64_t tiles = 0;
    for (int64_t b = 0; !failed && b < num_seqs; ++b) {
        const int64_t lo = window > 0 && pos0[b] - window + 1 > 0 ? pos0[b] - window + 1 : 0;
        const int64_t keys = num_queries[b] > 0 ? pos0[b] + num_queries[b] : 0;
        pk.first[b] = tiles;
        pk.tile0[b] = lo / AKT;
        tiles += keys > 0 ? (keys + AKT - 1) / AKT - lo / AKT : 0;
    }
    if (!failed) {
        pk.first[num_seqs] = tiles;
        pk.kp = aligned_alloc(64, (size_t)(tiles > 0 ? tiles : 1) * KVH * D * AKT * 2);
        pk.vp = aligned_alloc(64, (size_t)(tiles > 0 ? tiles : 1) * KVH * D * AKT * 2);
        failed = pk.kp == NULL || pk.vp == NULL;
    }
    const int64_t packs = failed ? 0 : tiles * KVH;
    const size_t bytes = (size_t)(Mmax * D * 2 + ARB * AKT * 2 + Mmax * D * 4 + ARB * AKT * 4 +
                                  3 * Mmax * 4);
#pragma omp parallel num_threads(tandem_team(num_tasks > packs ? num_tasks : packs)) \
    reduction(| : failed)
    {
#pragma omp for schedule(dynamic, 4)
        for (int64_t i = 0; i < packs; ++i) {  /* every (sequence tile, kv head) once */
            const int64_t t = i / KVH, kh = i % KVH;
            int64_t b = 0;
            while (pk.first[b + 1] <= t) ++b;
            const int64_t k0 = (pk.tile0[b] + t - pk.first[b]) * AKT;
            const int64_t keys = pos0[b] + num_queries[b];
            tandem_amx_pack(pk.kp + i * (D / 2 * AKT), pk.vp + i * (AKT * D), k_cache, v_cache,
                            block_table + b * table_stride, k0,
                            keys - k0 < AKT ? keys - k0 : AKT, kh, KVH, D, block_size);
        }
        char *buf = packs > 0 ? aligned_alloc(64, (bytes + 64 * 16 + 63) / 64 * 64) : NULL;
        if (packs > 0 && buf == NULL) failed = 1;
        tandem_amx_scratch w = {0};
        if (buf != NULL) {  /* each piece on its own 64-byte lines */
            char *at = buf;
#define TANDEM_TAKE(field, type, count)                                                        \
            w.field = (type *)at;                                                              \
            at += ((size_t)(count) * sizeof(type) + 63) / 64 * 64;
            TANDEM_TAKE(q, uint16_t, Mmax * D)
            TANDEM_TAKE(p, uint16_t, ARB * AKT)
            TANDEM_TAKE(o, float, Mmax * D)
            TANDEM_TAKE(s, float, ARB * AKT)
            TANDEM_TAKE(mx, float, Mmax)
            TANDEM_TAKE(l, float, Mmax)
            TANDEM_TAKE(pos, int32_t, Mmax)
#undef TANDEM_TAKE
            tandem_amx_configure();
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < num_tasks; ++t) {
            if (buf == NULL) continue;
            tandem_amx_task_run(tasks + t, q, q_stride, out, row0, pos0, &pk, num_heads, KVH, D,
                                window, scale, &w);
        }
        if (buf != NULL) _tile_release();
        free(buf);
    }
    free(pk.kp);
    free(pk.vp);
    free(pk.first);
    free(pk.tile0);
    free(tasks);
    return failed ? -1 : 0;
}

#else  /* no AMX-BF16: callers keep the other paths (this is never called) */
int tandem_paged_prefill_amx_supported(int64_t head_dim) { (void)head_dim; return 0; }
TANDEM_AMX_PREFILL {
    return -2;
}
#endif
