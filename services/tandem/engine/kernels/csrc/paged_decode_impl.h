/* Body of the paged decode kernel, included once per KV element type with
 * NAME (the exported symbol), KV_T (the cache element) and KV_LOAD (element
 * pointer -> float) defined. See paged_decode.c. */
#define TANDEM_CAT2(a, b) a##b
#define TANDEM_CAT(a, b) TANDEM_CAT2(a, b)
#define CHUNK TANDEM_CAT(NAME, _chunk)
#define PREFETCH_SPAN TANDEM_CAT(NAME, _prefetch_span)
#define ENTER_BLOCK TANDEM_CAT(NAME, _enter_block)

#define PREFETCH_BLOCKS 2 /* blocks a task prefetches ahead of the one it reads */

/* Touch the lines of ``span`` elements at ``at`` in a block PREFETCH_BLOCKS ahead (the same
 * keys' slice), so a block is in cache when the loop reaches it: blocks lie anywhere in the
 * cache, and the hardware prefetcher stops at each page. Into L2 (prefetcht1), not L1: L1
 * has too few miss buffers to keep a block's lines in flight (faster over batches of rows,
 * no slower at one short row). Two blocks ahead, with a task's first two blocks of K and V
 * touched before it starts, rather than one: a batch-1 step's attention, its K/V cold after
 * the weights' stream, ran faster per layer that way (four blocks ahead were slower again;
 * services/RESULTS.md). */
static inline void PREFETCH_SPAN(const KV_T *next, int64_t at, int64_t span) {
    if (next == NULL) return;
    const char *c = (const char *)(next + at);
    for (int64_t b = 0; b < span * (int64_t)sizeof(KV_T); b += 64) __builtin_prefetch(c + b, 0, 2);
}

/* At a block's first key: the block (``*base``) and the sequence's block PREFETCH_BLOCKS on
 * (``*next``, NULL past its last block ``last_blk``). */
static inline void ENTER_BLOCK(const KV_T *cache, const int64_t *table, int64_t blk, int64_t last_blk,
                               int64_t block_stride, const KV_T **base, const KV_T **next) {
    *base = cache + table[blk] * block_stride;
    *next = blk + PREFETCH_BLOCKS <= last_blk ? cache + table[blk + PREFETCH_BLOCKS] * block_stride : NULL;
}

/* Head sizes whose keys the AVX-512 path holds in registers (16 floats a vector). */
#define MAX_VECTORS 16
#define VECTOR_HEAD(D) ((D) % 16 == 0 && (D) <= 16 * MAX_VECTORS)

/* Row r's query heads of kv heads kh0 .. kh0 + kvh_per_task - 1 against ``n`` of its keys
 * from key ``first``, prefetching on up to block ``last_blk`` (the end of the task's keys).
 * With ``partial`` NULL those are all the row's keys and this writes the normalized output;
 * otherwise they are a chunk, and this writes its partial softmax there (PARTIAL_*) for
 * tandem_merge_chunks. Inlined into a parallel region of its own per head size (NAME below),
 * where ``D`` is a literal: GCC outlines a parallel region before it inlines, so a region in
 * a function that only receives ``D`` would run every loop over D at run time, its key in
 * memory. ``scores`` holds hpt * n floats, ``acc`` hpt * D; ``products`` (AVX-512, 64-byte
 * aligned) hpt * 16 vectors of 16: per head, the lane products of a group of 16 keys, summed
 * a group at a time (tandem_sum16x16), where one horizontal sum per key and head was slower. */
static inline __attribute__((always_inline)) void CHUNK(
        const float *q, int64_t q_stride, float *out, const int64_t *rows, const KV_T *k_cache,
        const KV_T *v_cache, const int64_t *block_table, int64_t table_stride,
        int64_t num_heads, int64_t num_kv_heads, const int64_t D, int64_t block_size,
        float scale, int64_t head_splits, int64_t r, int64_t split, int64_t first, int64_t n,
        int64_t last_blk, float *partial, float *scores, float *acc, float *products) {
    const int64_t G = num_heads / num_kv_heads, KVH = num_kv_heads;
    const int64_t kvh_per_task = KVH / head_splits, hpt = kvh_per_task * G, span = kvh_per_task * D;
    const int64_t block_stride = block_size * KVH * D;
    const int64_t kh0 = split * kvh_per_task;
    const int64_t *table = block_table + r * table_stride;
    const KV_T *kbase = NULL, *vbase = NULL, *knext = NULL, *vnext = NULL;
    const float *qr = q + rows[r] * q_stride + kh0 * G * D;
    float *o = out + (rows[r] * num_heads + kh0 * G) * D;
    /* the blocks no earlier key prefetches: the chunk's first PREFETCH_BLOCKS of K and V */
    for (int64_t b = first / block_size; b < first / block_size + PREFETCH_BLOCKS && b <= last_blk; ++b)
        for (int64_t off = 0; off < block_size; ++off) {
            PREFETCH_SPAN(k_cache + table[b] * block_stride, (off * KVH + kh0) * D, span);
            PREFETCH_SPAN(v_cache + table[b] * block_stride, (off * KVH + kh0) * D, span);
        }
    /* pass 1: scores[h][j] = q_h . k_j * scale, key rows read in cache order */
    for (int64_t j = 0, blk = first / block_size, off = first % block_size; j < n; ++j, ++off) {
        if (off == block_size) { off = 0; ++blk; }
        if (j == 0 || off == 0) ENTER_BLOCK(k_cache, table, blk, last_blk, block_stride, &kbase, &knext);
        const int64_t at = (off * KVH + kh0) * D;
        PREFETCH_SPAN(knext, at, span);
        for (int64_t kh = 0; kh < kvh_per_task; ++kh) {
            const KV_T *kv = kbase + at + kh * D;
#if defined(__AVX512F__)
            if (VECTOR_HEAD(D)) {  /* the key once in registers, a vector of products per head */
                __m512 key[MAX_VECTORS];
                for (int64_t i = 0; i < D / 16; ++i) key[i] = KV_LOAD16(kv + 16 * i);
                for (int64_t g = 0; g < G; ++g) {
                    const int64_t h = kh * G + g;
                    const float *qh = qr + h * D;
                    __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qh), key[0]);
                    for (int64_t i = 1; i < D / 16; ++i)
                        s = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * i), key[i], s);
                    _mm512_store_ps(products + (h * 16 + j % 16) * 16, s);
                }
                continue;
            }
#endif
            for (int64_t g = 0; g < G; ++g) {
                const int64_t h = kh * G + g;
                const float *qh = qr + h * D;
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < D; ++d) s += qh[d] * KV_LOAD(kv + d);
                scores[h * n + j] = s * scale;
            }
        }
#if defined(__AVX512F__)
        if (VECTOR_HEAD(D) && (j % 16 == 15 || j == n - 1)) {  /* a group's 16 sums at once */
            const int64_t j0 = j - j % 16;
            const __mmask16 keep = (__mmask16)((1u << (j - j0 + 1)) - 1u);
            for (int64_t h = 0; h < hpt; ++h)
                _mm512_mask_storeu_ps(scores + h * n + j0, keep,
                                      _mm512_mul_ps(tandem_sum16x16(products + h * 256),
                                                    _mm512_set1_ps(scale)));
        }
#endif
    }
    for (int64_t h = 0; h < hpt; ++h) {
        float *sh = scores + h * n, m = -INFINITY, total = 0.f;
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < n; ++j) m = sh[j] > m ? sh[j] : m;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) sh[j] = tandem_expf(sh[j] - m);
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < n; ++j) total += sh[j];
        if (partial != NULL) {  /* a chunk: its exps stay unnormalized */
            partial[PARTIAL_MAX(hpt, h)] = m;
            partial[PARTIAL_SUM(hpt, h)] = total;
            continue;
        }
        const float inv = 1.f / total;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) sh[j] *= inv;
    }
    /* pass 2: out_h = sum_j p[h][j] * v_j, keys in cache order; the sums in ``acc`` (L1) */
    memset(acc, 0, sizeof(float) * hpt * D);
    for (int64_t j = 0, blk = first / block_size, off = first % block_size; j < n; ++j, ++off) {
        if (off == block_size) { off = 0; ++blk; }
        if (j == 0 || off == 0) ENTER_BLOCK(v_cache, table, blk, last_blk, block_stride, &vbase, &vnext);
        const int64_t at = (off * KVH + kh0) * D;
        PREFETCH_SPAN(vnext, at, span);
        for (int64_t kh = 0; kh < kvh_per_task; ++kh) {
            const KV_T *vv = vbase + at + kh * D;
#if defined(__AVX512F__)
            if (VECTOR_HEAD(D)) {  /* the value widened once, into registers, for its G heads */
                __m512 val[MAX_VECTORS];
                for (int64_t i = 0; i < D / 16; ++i) val[i] = KV_LOAD16(vv + 16 * i);
                for (int64_t g = 0; g < G; ++g) {
                    const int64_t h = kh * G + g;
                    const __m512 w = _mm512_set1_ps(scores[h * n + j]);
                    float *ah = acc + h * D;
                    for (int64_t i = 0; i < D / 16; ++i)
                        _mm512_storeu_ps(ah + 16 * i, _mm512_fmadd_ps(w, val[i], _mm512_loadu_ps(ah + 16 * i)));
                }
                continue;
            }
#endif
            for (int64_t g = 0; g < G; ++g) {
                const int64_t h = kh * G + g;
                const float w = scores[h * n + j];
                float *ah = acc + h * D;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) ah[d] += w * KV_LOAD(vv + d);
            }
        }
    }
    memcpy(partial != NULL ? partial + PARTIAL_ACC(hpt, 0, D) : o, acc, sizeof(float) * hpt * D);
}

/* Every task of ``plan`` over a team of threads, a task's chunks one after another, then
 * every chunked row's merge; ``D_ARG`` the head size (a literal in the common cases); each
 * thread's scratch grows to its longest chunk. */
#define PARALLEL_TASKS(D_ARG)                                                                   \
    do {                                                                                        \
        _Pragma("omp parallel num_threads(tandem_team(plan.num_tasks)) reduction(| : failed)")  \
        {                                                                                       \
            float *scores = NULL, *acc = malloc(sizeof(float) * hpt * (D_ARG));                 \
            float *products = aligned_alloc(64, sizeof(float) * hpt * 256);                     \
            int64_t cap = 0;                                                                    \
            if (acc == NULL || products == NULL) failed = 1;                                    \
            _Pragma("omp for schedule(dynamic, 1)")                                             \
            for (int64_t i = 0; i < plan.num_tasks; ++i) {                                      \
                const tandem_decode_task *t = plan.tasks + i;                                   \
                const tandem_decode_row *row = plan.rows + t->row;                              \
                const int64_t end = row->first + (t->chunk0 + t->chunks) * row->size;           \
                const int64_t last_blk = ((end < row->end ? end : row->end) - 1) / block_size;  \
                if (!failed && hpt * row->size > cap) {                                         \
                    float *grown = realloc(scores, sizeof(float) * hpt * row->size);            \
                    if (grown == NULL) failed = 1;                                              \
                    else { scores = grown; cap = hpt * row->size; }                             \
                }                                                                               \
                for (int64_t c = t->chunk0; !failed && c < t->chunk0 + t->chunks; ++c) {        \
                    const int64_t first = row->first + c * row->size;                           \
                    float *partial = row->slot < 0 ? NULL : plan.partials                       \
                        + (row->slot + c * head_splits + t->split) * PARTIAL_FLOATS(hpt, D_ARG); \
                    CHUNK(q, q_stride, out, rows, k_cache, v_cache, block_table, table_stride, \
                          num_heads, num_kv_heads, (D_ARG), block_size, scale, head_splits,     \
                          t->row, t->split, first,                                              \
                          row->end - first < row->size ? row->end - first : row->size,          \
                          last_blk, partial, scores, acc, products);                            \
                }                                                                               \
            }                                                                                   \
            _Pragma("omp for schedule(dynamic, 1)")                                             \
            for (int64_t r = 0; r < num_rows; ++r)                                              \
                if (!failed && plan.rows[r].slot >= 0)                                          \
                    tandem_merge_chunks(&plan, r, hpt, (D_ARG),                                 \
                                        out + rows[r] * num_heads * (D_ARG));                   \
            free(scores);                                                                       \
            free(acc);                                                                          \
            free(products);                                                                     \
        }                                                                                       \
    } while (0)

int NAME(const float *q, int64_t q_stride, float *out, const int64_t *rows,
         const KV_T *k_cache, const KV_T *v_cache, const int64_t *block_table,
         int64_t table_stride, const int64_t *positions, int64_t num_rows, int64_t num_heads,
         int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t window,
         float scale, int64_t head_splits) {
    const int64_t hpt = num_kv_heads / head_splits * (num_heads / num_kv_heads);
    tandem_decode_plan plan;
    if (tandem_plan_decode(positions, num_rows, window, block_size, head_splits,
                           PARTIAL_FLOATS(hpt, head_dim), &plan) != 0)
        return -1;
    int failed = 0;
    switch (head_dim) {
        case 64: PARALLEL_TASKS(64); break;
        case 128: PARALLEL_TASKS(128); break;
        default: PARALLEL_TASKS(head_dim); break;
    }
    tandem_free_decode_plan(&plan);
    return failed ? -1 : 0;
}
#undef PARALLEL_TASKS
#undef PREFETCH_BLOCKS
#undef CHUNK
#undef PREFETCH_SPAN
#undef ENTER_BLOCK
#undef MAX_VECTORS
#undef VECTOR_HEAD
