/* Causal paged attention for prompt chunks on CPU, reading K/V blocks in place (fp32 or
 * bf16 cache; queries, scores and outputs fp32). Written in prefill_vec.h's vectors of VL
 * lanes: 16 with AVX-512, 8 with AVX2 + FMA (faster than torch's gather + SDPA on prompts:
 * `tandem bench attention --prompt`, services/RESULTS.md).
 *
 * Sequence b has n[b] query rows at the flat token rows row0[b] .. row0[b] + n[b] - 1,
 * at positions pos0[b] .. pos0[b] + n[b] - 1; a query at position p attends the keys
 * [max(0, p - window + 1), p] of its sequence (window 0: [0, p]), found through its
 * block table.
 *
 * Flash-attention order, one task per (sequence, kv head, tile of QT positions): the
 * G = H / KVH query heads sharing the kv head make M = QT * G score rows that every key
 * tile serves at once. The queries are transposed (and scaled) into Q^T once per task, and
 * the output is kept transposed too, O^T [D][M], so rows run along the vector lanes
 * throughout: the online softmax (running max and sum per row) is elementwise across keys,
 * with no horizontal reductions, and rescaling O by a row's factor is a lane-wise product.
 * Per tile of KT keys (fp32 rows read in the cache where they are, bf16 rows widened into
 * the thread's buffers; the next tile's rows prefetched), and per chunk of up to
 * MV_MAX * VL rows (64 with AVX-512, 16 with AVX2) while the chunk is in cache: S^T = K Q^T (keeping each row's max where no key is
 * masked), the mask on the tiles that need it, P^T = exp(S^T - max), then
 * O^T = alpha O^T + V^T P^T. O^T / sum is transposed back into ``out`` at the end.
 *
 * Shapes (row-major):
 *   q            [T, H, D], rows q_stride apart; out [T, H, D] contiguous
 *   k/v_cache    [num_blocks, block_size, KVH, D]
 *   block_table  [B, table_stride] int64
 * D must be a multiple of VL (tandem_paged_prefill_supported).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_load.h"
#include "team.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include "prefill_tasks.h"
#include "prefill_vec.h"

#define KT 64  /* keys per tile */
#define JB 4   /* keys per score micro-kernel */
#define DB 6   /* dims per value micro-kernel (the last call of a row chunk takes D % DB) */

/* Positions per task: M = QT * G rows a multiple of 128 where that keeps QT in 16..64 (each
 * key tile then serves two or more full 64-row chunks). */
static int64_t tandem_prefill_positions(int64_t G) {
    int64_t qt = 64;
    while (qt > 16 && (qt / 2 * G) % 128 == 0) qt /= 2;
    return qt;
}

/* Offset (in elements) of ``key``'s row for kv head ``kh`` in a [blocks, block_size, KVH, D]
 * cache, through its sequence's block table. */
static inline int64_t tandem_key_row(const int64_t *table, int64_t key, int64_t block_size,
                                     int64_t KVH, int64_t kh, int64_t D) {
    return ((table[key / block_size] * block_size + key % block_size) * KVH + kh) * D;
}

/* S^T[j][m] = sum_d K[j][d] * Qt[d][m] for JB keys and MV vectors of VL rows; with
 * ``tmax``, also tmax[VL c ..] = max(tmax[VL c ..], the JB keys' scores) per row. */
static inline __attribute__((always_inline)) void tandem_scores(
        const float *const *krow, const float *qt, float *st, float *tmax, int64_t D, int64_t Mp,
        int64_t m0, const int MV) {
    const float *kr[JB];
    for (int j = 0; j < JB; ++j) kr[j] = krow[j];
    vec acc[JB][MV_MAX];
    for (int j = 0; j < JB; ++j)
        for (int c = 0; c < MV; ++c) acc[j][c] = V_ZERO();
    for (int64_t d = 0; d < D; ++d) {
        vec qv[MV_MAX];
        for (int c = 0; c < MV; ++c) qv[c] = V_LOAD(qt + d * Mp + m0 + VL * c);
        for (int j = 0; j < JB; ++j) {
            const vec kb = V_SET1(kr[j][d]);
            for (int c = 0; c < MV; ++c) acc[j][c] = V_FMADD(kb, qv[c], acc[j][c]);
        }
    }
    for (int j = 0; j < JB; ++j)
        for (int c = 0; c < MV; ++c) V_STORE(st + j * Mp + m0 + VL * c, acc[j][c]);
    if (tmax != NULL)
        for (int c = 0; c < MV; ++c) {
            vec top = V_LOAD(tmax + VL * c);
            for (int j = 0; j < JB; ++j) top = V_MAX(top, acc[j][c]);
            V_STORE(tmax + VL * c, top);
        }
}

/* Online softmax of MV vectors of VL rows from m0 over nj keys: P^T overwrites S^T, the
 * rows' running max and sum move on, and alpha[m] is the factor their old sums were scaled
 * by. ``tmax``: the rows' max over these keys (from tandem_scores), or NULL to find it. */
static inline __attribute__((always_inline)) void tandem_softmax(
        float *st, float *mx, float *l, float *alpha, const float *tmax, int64_t nj, int64_t Mp,
        int64_t m0, const int MV) {
    vec old[MV_MAX], top[MV_MAX], base[MV_MAX], sum[MV_MAX];
    for (int c = 0; c < MV; ++c) {
        old[c] = V_LOAD(mx + m0 + VL * c);
        top[c] = tmax != NULL ? V_MAX(old[c], V_LOAD(tmax + VL * c)) : old[c];
    }
    if (tmax == NULL)
        for (int64_t j = 0; j < nj; ++j)
            for (int c = 0; c < MV; ++c)
                top[c] = V_MAX(top[c], V_LOAD(st + j * Mp + m0 + VL * c));
    for (int c = 0; c < MV; ++c) {
        base[c] = v_zero_neg_inf(top[c]);
        sum[c] = V_ZERO();
    }
    for (int64_t j = 0; j < nj; ++j)
        for (int c = 0; c < MV; ++c) {
            float *s = st + j * Mp + m0 + VL * c;
            const vec p = V_EXP(V_SUB(V_LOAD(s), base[c]));
            V_STORE(s, p);
            sum[c] = V_ADD(sum[c], p);
        }
    for (int c = 0; c < MV; ++c) {
        const vec a = V_EXP(V_SUB(old[c], base[c]));
        float *lc = l + m0 + VL * c;
        V_STORE(lc, V_FMADD(V_LOAD(lc), a, sum[c]));
        V_STORE(mx + m0 + VL * c, top[c]);
        V_STORE(alpha + m0 + VL * c, a);
    }
}

/* O^T[d0 + e][m] = alpha[m] * O^T[d0 + e][m] + sum_j V[j][d0 + e] * P^T[j][m] for DB dims
 * and MV vectors of VL rows from m0. */
static inline __attribute__((always_inline)) void tandem_values(
        const float *pt, const float *const *vrow, float *ot, const float *alpha, int64_t nk,
        int64_t Mp, int64_t m0, int64_t d0, const int MV, const int NDB) {
    vec acc[DB][MV_MAX], a[MV_MAX];
    for (int c = 0; c < MV; ++c) a[c] = V_LOAD(alpha + m0 + VL * c);
    for (int e = 0; e < NDB; ++e)
        for (int c = 0; c < MV; ++c)
            acc[e][c] = V_MUL(a[c], V_LOAD(ot + (d0 + e) * Mp + m0 + VL * c));
    for (int64_t j = 0; j < nk; ++j) {
        const float *vr = vrow[j] + d0;
        vec pv[MV_MAX];
        for (int c = 0; c < MV; ++c) pv[c] = V_LOAD(pt + j * Mp + m0 + VL * c);
        for (int e = 0; e < NDB; ++e) {
            const vec vb = V_SET1(vr[e]);
            for (int c = 0; c < MV; ++c) acc[e][c] = V_FMADD(vb, pv[c], acc[e][c]);
        }
    }
    for (int e = 0; e < NDB; ++e)
        for (int c = 0; c < MV; ++c) V_STORE(ot + (d0 + e) * Mp + m0 + VL * c, acc[e][c]);
}

#define NAME tandem_paged_prefill_f32
#define KV_T float
#define KV_LOADV V_LOAD_F32
#define KV_DIRECT 1  /* the kernels read fp32 rows in the cache */
#include "paged_prefill_impl.h"
#undef NAME
#undef KV_T
#undef KV_LOADV
#undef KV_DIRECT

#define NAME tandem_paged_prefill_bf16
#define KV_T uint16_t
#define KV_LOADV V_LOAD_BF16
#define KV_DIRECT 0
#include "paged_prefill_impl.h"

int tandem_paged_prefill_supported(int64_t head_dim) { return head_dim % VL == 0; }

#else  /* no AVX-512 or AVX2: callers keep the torch path (these are never called) */
int tandem_paged_prefill_supported(int64_t head_dim) { (void)head_dim; return 0; }
#define TANDEM_NO_PREFILL(NAME, KV_T)                                                            \
    int NAME(const float *q, int64_t q_stride, float *out, const int64_t *row0,                 \
             const int64_t *pos0, const int64_t *num_queries, int64_t num_seqs,                 \
             const KV_T *k_cache, const KV_T *v_cache, const int64_t *block_table,              \
             int64_t table_stride, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,   \
             int64_t block_size, int64_t window, float scale) {                                 \
        return -2;                                                                              \
    }
TANDEM_NO_PREFILL(tandem_paged_prefill_f32, float)
TANDEM_NO_PREFILL(tandem_paged_prefill_bf16, uint16_t)
#endif
