/* Causal paged attention for prompt chunks over a bf16 cache, its products on AMX tiles
 * (CPUs with AMX-BF16; elsewhere tandem_paged_prefill_amx_supported says no). Same
 * arguments and result as tandem_paged_prefill_bf16 (paged_prefill.c): queries, softmax
 * and outputs fp32; the queries are rounded to bf16 for the score product and the
 * probabilities for the value product, each product accumulated in fp32, as torch's bf16
 * SDPA computes them.
 *
 * One task per (sequence, kv head, QT positions): M = QT * G score rows (row m = i * G + g
 * is position i of the task, query head kv_head * G + g), in blocks of 16 rows (a tile's
 * rows). Per tile of AKT keys, K is packed once into the score product's pair-interleaved
 * layout (Kp[d / 2][key][2]: a 16 x 16 transpose of 32-bit pairs) and V into the value
 * product's (Vp[key / 2][d][2]); then for each block of rows that reaches the tile:
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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512BW__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "transpose16.h"
#include "vexp512.h"

#define AKT 256         /* keys per tile: each row's reductions and rescale once per tile */
#define ARB 16          /* score rows per block: a tile's rows */
#define AMX_MAX_D 256
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tandem_tile_config;

typedef struct {
    int64_t seq, kv_head, first, count;  /* positions first .. first + count - 1 of seq */
    int64_t keys;                        /* keys they attend (sort key: biggest first) */
} tandem_amx_task;

/* Linux hands out the tile state only on request, once per process. */
static int tandem_amx_permitted(void) {
    static int state;  /* 0 unknown, 1 granted, -1 refused */
    if (state == 0)
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}

int tandem_paged_prefill_amx_supported(int64_t head_dim) {
    return head_dim % 32 == 0 && head_dim <= AMX_MAX_D && tandem_amx_permitted();
}

static void tandem_amx_configure(void) {  /* every tile 16 rows x 64 bytes */
    tandem_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

static int tandem_amx_task_order(const void *a, const void *b) {
    const int64_t ka = ((const tandem_amx_task *)a)->keys, kb = ((const tandem_amx_task *)b)->keys;
    return (ka < kb) - (ka > kb);
}

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

/* Online softmax of the block's 16 rows over keys k0 .. k0 + 16 nv - 1: P (bf16) from S,
 * the rows' max (of the unscaled scores) and sum moved on, their O rows rescaled. Every
 * row's max first, then every row's exponentials: no row waits on its own reductions. */
static inline void tandem_amx_softmax(float *s, uint16_t *p, float *o, float *mx, float *l,
                                      const int32_t *pos, int64_t k0, int64_t nv, int masked,
                                      int64_t window, float scale, int64_t D) {
    const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    float base[ARB];
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
        const float now = fmaxf(mx[r], _mm512_reduce_max_ps(_mm512_max_ps(top[0], top[1])));
        base[r] = now == -INFINITY ? 0.f : now;
        const float alpha = mx[r] == -INFINITY ? 0.f : expf((mx[r] - base[r]) * scale);
        mx[r] = now;
        l[r] *= alpha;
        if (alpha != 1.f) {
            const __m512 a = _mm512_set1_ps(alpha);
            for (int64_t d = 0; d < D; d += 16)
                _mm512_storeu_ps(o + r * D + d, _mm512_mul_ps(a, _mm512_loadu_ps(o + r * D + d)));
        }
    }
    for (int r = 0; r < ARB; ++r) {  /* exp((s - max) scale) */
        const float *sr = s + r * AKT;
        const __m512 b = _mm512_set1_ps(base[r] * scale);
        __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t c = 0; c < nv; ++c) {
            const __m512 e = tandem_exp512(_mm512_fmsub_ps(_mm512_loadu_ps(sr + 16 * c), sc, b));
            sum[c & 1] = _mm512_add_ps(sum[c & 1], e);
            _mm256_storeu_si256((__m256i *)(p + r * AKT + 16 * c), (__m256i)_mm512_cvtneps_pbh(e));
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

static void tandem_amx_task_run(const tandem_amx_task *tk, const float *q, int64_t q_stride,
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

/* Positions per task: about 128 score rows, a multiple of 16 positions. */
static int64_t tandem_amx_positions(int64_t G) {
    const int64_t qt = 256 / G / 16 * 16;
    return qt < 16 ? 16 : qt;
}

int tandem_paged_prefill_amx(const float *q, int64_t q_stride, float *out, const int64_t *row0,
                             const int64_t *pos0, const int64_t *num_queries, int64_t num_seqs,
                             const uint16_t *k_cache, const uint16_t *v_cache,
                             const int64_t *block_table, int64_t table_stride, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                             int64_t window, float scale) {
    if (!tandem_paged_prefill_amx_supported(head_dim)) return -2;
    const int64_t G = num_heads / num_kv_heads, D = head_dim, KVH = num_kv_heads;
    const int64_t QT = tandem_amx_positions(G), Mmax = QT * G;  /* a multiple of 16 */
    int64_t num_tasks = 0;
    for (int64_t b = 0; b < num_seqs; ++b) num_tasks += KVH * ((num_queries[b] + QT - 1) / QT);
    tandem_amx_task *tasks = malloc(sizeof(tandem_amx_task) * (num_tasks > 0 ? num_tasks : 1));
    tandem_amx_packed pk = {NULL, NULL, malloc(sizeof(int64_t) * (num_seqs + 1)),
                            malloc(sizeof(int64_t) * (num_seqs > 0 ? num_seqs : 1))};
    int failed = tasks == NULL || pk.first == NULL || pk.tile0 == NULL;
    int64_t n = 0, tiles = 0;
    for (int64_t b = 0; !failed && b < num_seqs; ++b) {
        const int64_t lo = window > 0 && pos0[b] - window + 1 > 0 ? pos0[b] - window + 1 : 0;
        const int64_t keys = num_queries[b] > 0 ? pos0[b] + num_queries[b] : 0;
        pk.first[b] = tiles;
        pk.tile0[b] = lo / AKT;
        tiles += keys > 0 ? (keys + AKT - 1) / AKT - lo / AKT : 0;
        for (int64_t first = 0; first < num_queries[b]; first += QT)
            for (int64_t kh = 0; kh < KVH; ++kh) {
                const int64_t count = num_queries[b] - first < QT ? num_queries[b] - first : QT;
                const int64_t last = pos0[b] + first + count - 1, p = pos0[b] + first;
                const int64_t klo = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;
                tasks[n++] = (tandem_amx_task){b, kh, first, count, last - klo + 1};
            }
    }
    if (!failed) {
        pk.first[num_seqs] = tiles;
        pk.kp = aligned_alloc(64, (size_t)(tiles > 0 ? tiles : 1) * KVH * D * AKT * 2);
        pk.vp = aligned_alloc(64, (size_t)(tiles > 0 ? tiles : 1) * KVH * D * AKT * 2);
        failed = pk.kp == NULL || pk.vp == NULL;
    }
    if (!failed) qsort(tasks, (size_t)num_tasks, sizeof *tasks, tandem_amx_task_order);
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
        tandem_amx_scratch w;
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
int tandem_paged_prefill_amx(const float *q, int64_t q_stride, float *out, const int64_t *row0,
                             const int64_t *pos0, const int64_t *num_queries, int64_t num_seqs,
                             const uint16_t *k_cache, const uint16_t *v_cache,
                             const int64_t *block_table, int64_t table_stride, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                             int64_t window, float scale) {
    return -2;
}
#endif
