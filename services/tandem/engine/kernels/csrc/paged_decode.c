/* Paged attention for decode rows on CPU, reading K/V blocks in place
 * (fp32 or bf16 cache; queries, scores and outputs fp32).
 *
 * One query token per row; row r attends the keys at positions
 * [max(0, pos[r] - window + 1), pos[r]] of its sequence, found through its
 * block table. Work is split into tasks run by OpenMP threads: a row's keys
 * into chunks (a long row's, see KEY_CHUNK), a chunk's kv heads into
 * ``head_splits`` pieces. A task scores its G = H / KVH query heads per kv head
 * against its keys once (two passes: scores, then softmax-weighted V), so each
 * K and V vector is read once; a chunked row's partial softmaxes are merged after.
 *
 * Shapes (all contiguous, row-major):
 *   q            [T, H, D], rows q_stride apart (row r reads token row rows[r])
 *   out          [T, H, D] contiguous (row r writes token row rows[r])
 *   k/v_cache    [num_blocks, block_size, KVH, D]
 *   block_table  [R, table_stride] int64
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "kv_load.h"
#include "team.h"
#include "vexp.h"

/* A row attending more than KEY_CHUNK keys is split into ceil(keys / KEY_CHUNK) chunks of
 * equal whole blocks (the last shorter), each with a softmax of its own, merged after. The
 * chunks depend on the row's key count alone, so a row's output has the same bits in any
 * batch and on any number of threads. What the batch and the threads decide is only how
 * many of a row's chunks one task attends, one after another (about TASKS_PER_THREAD tasks
 * a thread): a lone long row's chunks stream on every thread, where one thread alone reads
 * them markedly slower than two do (`tandem bench attention --rows 1`, services/RESULTS.md),
 * while a batch's rows mostly go whole, each task reading its keys front to back (chunks
 * of 256 a task were slower at 32 rows). */
#define KEY_CHUNK 256
#define TASKS_PER_THREAD 2

/* A chunk's partial softmax per query head h of its task (hpt heads): the maximum score,
 * the sum of exp(score - maximum), and the V rows weighted by those exps. */
#define PARTIAL_FLOATS(hpt, D) ((hpt) * ((D) + 2))
#define PARTIAL_MAX(hpt, h) (h)
#define PARTIAL_SUM(hpt, h) ((hpt) + (h))
#define PARTIAL_ACC(hpt, h, D) (2 * (hpt) + (h) * (D))

/* A row's keys [first, end) in ``chunks`` chunks of ``size`` keys (the last shorter), its
 * chunk c's partial of kv-head piece s at slot ``slot + c * head_splits + s`` (slot -1 for a
 * row of one chunk, which writes its output directly). */
typedef struct { int64_t first, end, size, chunks, slot; } tandem_decode_row;

/* One task: chunks chunk0 .. chunk0 + chunks - 1 of kv-head piece ``split`` of row ``row``. */
typedef struct { int64_t row, split, chunk0, chunks; } tandem_decode_task;

typedef struct {
    tandem_decode_row *rows;
    tandem_decode_task *tasks;
    int64_t num_tasks, head_splits;
    float *partials;
} tandem_decode_plan;

static void tandem_free_decode_plan(tandem_decode_plan *plan) {
    free(plan->rows);
    free(plan->tasks);
    free(plan->partials);
}

/* Chunks of row ``row`` one task takes: as many as fit in ``share`` keys, at least one. */
static inline int64_t chunks_per_task(const tandem_decode_row *row, int64_t share) {
    return share / row->size > 1 ? share / row->size : 1;
}

/* Plans ``num_rows`` rows' chunks and tasks, with ``partial_floats`` floats per partial. A
 * task takes as many of its row's chunks as fit in a share of all the keys, so each thread
 * gets about TASKS_PER_THREAD tasks' worth. Returns 0, or -1 when out of memory (nothing
 * left allocated). */
static int tandem_plan_decode(const int64_t *positions, int64_t num_rows, int64_t window,
                              int64_t block_size, int64_t head_splits, int64_t partial_floats,
                              tandem_decode_plan *plan) {
    int64_t slots = 0, keys = 0;
    memset(plan, 0, sizeof(*plan));
    plan->head_splits = head_splits;
    plan->rows = malloc(sizeof(tandem_decode_row) * (num_rows > 0 ? num_rows : 1));
    if (plan->rows == NULL) goto oom;
    for (int64_t r = 0; r < num_rows; ++r) {
        tandem_decode_row *row = plan->rows + r;
        const int64_t pos = positions[r];
        row->first = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;
        row->end = pos + 1;
        const int64_t n = row->end - row->first, chunks = (n + KEY_CHUNK - 1) / KEY_CHUNK;
        row->size = n <= KEY_CHUNK ? n
                    : ((n + chunks - 1) / chunks + block_size - 1) / block_size * block_size;
        row->chunks = (n + row->size - 1) / row->size;
        row->slot = row->chunks > 1 ? slots : -1;
        slots += row->chunks > 1 ? row->chunks * head_splits : 0;
        keys += n;
    }
    const int64_t share = keys / (TASKS_PER_THREAD * omp_get_max_threads());
    for (int64_t r = 0; r < num_rows; ++r) {
        const int64_t per_task = chunks_per_task(plan->rows + r, share);
        plan->num_tasks += (plan->rows[r].chunks + per_task - 1) / per_task * head_splits;
    }
    plan->tasks = malloc(sizeof(tandem_decode_task) * (plan->num_tasks > 0 ? plan->num_tasks : 1));
    plan->partials = slots > 0 ? malloc(sizeof(float) * slots * partial_floats) : NULL;
    if (plan->tasks == NULL || (slots > 0 && plan->partials == NULL)) goto oom;
    tandem_decode_task *t = plan->tasks;
    for (int64_t r = 0; r < num_rows; ++r) {
        const tandem_decode_row *row = plan->rows + r;
        const int64_t per_task = chunks_per_task(row, share);
        for (int64_t c = 0; c < row->chunks; c += per_task)
            for (int64_t s = 0; s < head_splits; ++s, ++t) {
                t->row = r;
                t->split = s;
                t->chunk0 = c;
                t->chunks = row->chunks - c < per_task ? row->chunks - c : per_task;
            }
    }
    return 0;
oom:
    tandem_free_decode_plan(plan);
    return -1;
}

/* Row r's output heads ``o [H, D]`` from its chunks' partials, merged in chunk order: per
 * head, o = sum_c e_c acc_c / sum_c e_c sum_c with e_c = exp(max_c - max over chunks). */
static void tandem_merge_chunks(const tandem_decode_plan *plan, int64_t r, int64_t hpt,
                                int64_t D, float *o) {
    const int64_t chunks = plan->rows[r].chunks, splits = plan->head_splits;
    const int64_t stride = splits * PARTIAL_FLOATS(hpt, D);  /* from one chunk's to the next */
    for (int64_t s = 0; s < splits; ++s) {
        const float *p = plan->partials + (plan->rows[r].slot + s) * PARTIAL_FLOATS(hpt, D);
        for (int64_t h = 0; h < hpt; ++h) {
            float m = -INFINITY, total = 0.f, *oh = o + (s * hpt + h) * D;
            for (int64_t c = 0; c < chunks; ++c) {
                const float mc = p[c * stride + PARTIAL_MAX(hpt, h)];
                m = mc > m ? mc : m;
            }
            for (int64_t c = 0; c < chunks; ++c)
                total += tandem_expf(p[c * stride + PARTIAL_MAX(hpt, h)] - m)
                         * p[c * stride + PARTIAL_SUM(hpt, h)];
            const float inv = 1.f / total;
            memset(oh, 0, sizeof(float) * D);
            for (int64_t c = 0; c < chunks; ++c) {
                const float *acc = p + c * stride + PARTIAL_ACC(hpt, h, D);
                const float w = tandem_expf(p[c * stride + PARTIAL_MAX(hpt, h)] - m) * inv;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) oh[d] += w * acc[d];
            }
        }
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* v[j] = the sum of the 16 lanes of vector j of ``a`` (16 x 16 floats, 64-byte aligned): a
 * transpose-and-add in 30 shuffles and 15 adds, where 16 horizontal sums take about 64 and 64.
 * Lane j's sum takes only vector j's lanes, in an order fixed whatever the other vectors hold. */
static inline __m512 tandem_sum16x16(const float *a) {
    __m512 b[8], c[4];
    for (int k = 0; k < 8; ++k) {  /* per 128-bit lane: pairs of a[2k] and of a[2k + 1] */
        const __m512 x = _mm512_load_ps(a + 32 * k), y = _mm512_load_ps(a + 32 * k + 16);
        b[k] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
    }
    for (int k = 0; k < 4; ++k) {  /* per 128-bit lane: the lane's sums of a[4k .. 4k + 3] */
        const __m512d x = _mm512_castps_pd(b[2 * k]), y = _mm512_castps_pd(b[2 * k + 1]);
        c[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* across the 128-bit lanes: 0 + 1 and 2 + 3, then those two */
    const __m512 f0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 f1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(c[2], c[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(f0, f1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(f0, f1, _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

#define NAME tandem_paged_decode_f32
#define KV_T float
#define KV_LOAD tandem_load_f32
#define KV_LOAD16 tandem_load16_f32
#include "paged_decode_impl.h"
#undef NAME
#undef KV_T
#undef KV_LOAD
#undef KV_LOAD16

#define NAME tandem_paged_decode_bf16
#define KV_T uint16_t
#define KV_LOAD tandem_load_bf16
#define KV_LOAD16 tandem_load16_bf16
#include "paged_decode_impl.h"
