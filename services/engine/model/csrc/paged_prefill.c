/* Causal paged attention for prompt chunks on CPU (AVX-512), reading K/V blocks in place
 * (fp32 or bf16 cache; queries, scores and outputs fp32).
 *
 * Sequence b has n[b] query rows at the flat token rows row0[b] .. row0[b] + n[b] - 1,
 * at positions pos0[b] .. pos0[b] + n[b] - 1; a query at position p attends the keys
 * [max(0, p - window + 1), p] of its sequence (window 0: [0, p]), found through its
 * block table.
 *
 * Flash-attention order, one task per (sequence, kv head, tile of QT positions): the
 * G = H / KVH query heads sharing the kv head make M = QT * G score rows that every key
 * tile serves at once. Per tile of KT keys: the keys and values are copied (widened)
 * into fp32 buffers; S^T = K Q^T is computed with the rows along the vector lanes, so
 * the online softmax (running max and sum per row) is elementwise across keys, with no
 * horizontal reductions; then O += P V with the values' dims along the lanes. The
 * queries are transposed (and scaled) once per task.
 *
 * Shapes (row-major):
 *   q            [T, H, D], rows q_stride apart; out [T, H, D] contiguous
 *   k/v_cache    [num_blocks, block_size, KVH, D]
 *   block_table  [B, table_stride] int64
 * D must be a multiple of 16 (tandem_paged_prefill_supported).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_load.h"
#include "team.h"

#if defined(__AVX512F__)
#include "vexp512.h"

#define KT 64  /* keys per tile */
#define JB 4   /* keys per score micro-kernel */
#define RB 4   /* rows per value micro-kernel */

typedef struct {
    int64_t seq, kv_head, first, count;  /* query rows first .. first + count - 1 of seq */
    int64_t keys;                        /* keys it attends (sort key: biggest first) */
} tandem_prefill_task;

static int tandem_prefill_task_order(const void *a, const void *b) {
    const int64_t ka = ((const tandem_prefill_task *)a)->keys;
    const int64_t kb = ((const tandem_prefill_task *)b)->keys;
    return (ka < kb) - (ka > kb);
}

/* Positions per task: M = QT * G rows a multiple of 128 where that keeps QT in 16..64 (each
 * key tile then serves two or more full 64-row chunks). */
static int64_t tandem_prefill_positions(int64_t G) {
    int64_t qt = 64;
    while (qt > 16 && (qt / 2 * G) % 128 == 0) qt /= 2;
    return qt;
}

/* S^T[j][m] = sum_d K[j][d] * Qt[d][m] for JB keys and MV vectors of 16 rows. */
static inline __attribute__((always_inline)) void tandem_scores(
        const float *kbuf, const float *qt, float *st, int64_t D, int64_t Mp, int64_t m0,
        const int MV) {
    __m512 acc[JB][4];
    for (int j = 0; j < JB; ++j)
        for (int c = 0; c < MV; ++c) acc[j][c] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
        __m512 qv[4];
        for (int c = 0; c < MV; ++c) qv[c] = _mm512_loadu_ps(qt + d * Mp + m0 + 16 * c);
        for (int j = 0; j < JB; ++j) {
            const __m512 kb = _mm512_set1_ps(kbuf[j * D + d]);
            for (int c = 0; c < MV; ++c) acc[j][c] = _mm512_fmadd_ps(kb, qv[c], acc[j][c]);
        }
    }
    for (int j = 0; j < JB; ++j)
        for (int c = 0; c < MV; ++c) _mm512_storeu_ps(st + j * Mp + m0 + 16 * c, acc[j][c]);
}

/* O[m][dc ..] += sum_j P^T[j][m] * V[j][dc ..] for RB rows and NV vectors of 16 dims. */
static inline __attribute__((always_inline)) void tandem_values(
        const float *pt, const float *vbuf, float *o, int64_t nk, int64_t D, int64_t Mp,
        int64_t m0, int64_t dc, const int NV) {
    __m512 acc[RB][4];
    for (int r = 0; r < RB; ++r)
        for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_loadu_ps(o + (m0 + r) * D + dc + 16 * c);
    for (int64_t j = 0; j < nk; ++j) {
        __m512 vv[4];
        for (int c = 0; c < NV; ++c) vv[c] = _mm512_loadu_ps(vbuf + j * D + dc + 16 * c);
        for (int r = 0; r < RB; ++r) {
            const __m512 pb = _mm512_set1_ps(pt[j * Mp + m0 + r]);
            for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_fmadd_ps(pb, vv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < RB; ++r)
        for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + (m0 + r) * D + dc + 16 * c, acc[r][c]);
}

#define NAME tandem_paged_prefill_f32
#define KV_T float
#define KV_LOAD16 tandem_load16_f32
#include "paged_prefill_impl.h"
#undef NAME
#undef KV_T
#undef KV_LOAD16

#define NAME tandem_paged_prefill_bf16
#define KV_T uint16_t
#define KV_LOAD16 tandem_load16_bf16
#include "paged_prefill_impl.h"

int tandem_paged_prefill_supported(int64_t head_dim) { return head_dim % 16 == 0; }

#else  /* no AVX-512: callers keep the torch path (these are never called) */
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
