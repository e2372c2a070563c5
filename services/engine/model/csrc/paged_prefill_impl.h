/* Body of the paged prefill kernel, included once per KV element type with
 * NAME, KV_T and KV_LOAD defined. See paged_prefill.c. */
int NAME(const float *q, int64_t q_stride, float *out, const int64_t *first_row,
         const int64_t *start_pos, const int64_t *num_queries, const KV_T *k_cache,
         const KV_T *v_cache, const int64_t *block_table, int64_t table_stride,
         int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
         int64_t block_size, int64_t window, float scale) {
    const int64_t G = num_heads / num_kv_heads, D = head_dim, KVH = num_kv_heads, BS = block_size;
    const int64_t block_stride = BS * KVH * D;
    /* task t -> (sequence, query tile, kv head); task_base[s] = first task of sequence s */
    int64_t *task_base = malloc(sizeof(int64_t) * (num_seqs + 1));
    if (task_base == NULL) return -1;
    task_base[0] = 0;
    for (int64_t s = 0; s < num_seqs; ++s)
        task_base[s + 1] = task_base[s] + KVH * ((num_queries[s] + TILE - 1) / TILE);
    const int64_t tasks = task_base[num_seqs];
    int failed = 0;
#pragma omp parallel num_threads(tandem_team(tasks)) reduction(| : failed)
    {
        /* kt [D, BS]: one block's keys transposed; sc [BS]; m, l [TILE*G]; acc [TILE*G, D] */
        float *kt = malloc(sizeof(float) * D * BS), *sc = malloc(sizeof(float) * BS);
        float *m = malloc(sizeof(float) * TILE * G), *l = malloc(sizeof(float) * TILE * G);
        float *acc = malloc(sizeof(float) * TILE * G * D);
        if (!kt || !sc || !m || !l || !acc) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; ++task) {
            if (failed) continue;
            int64_t s = 0;
            while (task_base[s + 1] <= task) ++s;
            const int64_t local = task - task_base[s], kh = local % KVH;
            const int64_t i0 = (local / KVH) * TILE;
            const int64_t i1 = i0 + TILE < num_queries[s] ? i0 + TILE : num_queries[s];
            const int64_t p0 = start_pos[s] + i0, p1 = start_pos[s] + i1 - 1;  /* positions */
            const int64_t lo = (window > 0 && p0 - window + 1 > 0) ? p0 - window + 1 : 0;
            const int64_t *table = block_table + s * table_stride;
            const int64_t rows = (i1 - i0) * G;
            for (int64_t r = 0; r < rows; ++r) { m[r] = -INFINITY; l[r] = 0.f; }
            memset(acc, 0, sizeof(float) * rows * D);
            for (int64_t blk = lo / BS; blk <= p1 / BS; ++blk) {
                const KV_T *kb = k_cache + table[blk] * block_stride + kh * D;
                const KV_T *vb = v_cache + table[blk] * block_stride + kh * D;
                const int64_t kb0 = blk * BS;
                const int64_t jn = p1 - kb0 + 1 < BS ? p1 - kb0 + 1 : BS;  /* keys used here */
                for (int64_t j = 0; j < jn; ++j)
                    for (int64_t d = 0; d < D; ++d) kt[d * BS + j] = KV_LOAD(kb + j * KVH * D + d);
                for (int64_t i = i0; i < i1; ++i) {
                    const int64_t p = start_pos[s] + i;
                    const int64_t first = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;
                    const int64_t ja = first > kb0 ? first - kb0 : 0;
                    const int64_t jb = p - kb0 + 1 < jn ? p - kb0 + 1 : jn;  /* keys [ja, jb) */
                    if (ja >= jb) continue;
                    for (int64_t g = 0; g < G; ++g) {
                        const int64_t r = (i - i0) * G + g;
                        const float *qr = q + (first_row[s] + i) * q_stride + (kh * G + g) * D;
                        for (int64_t j = ja; j < jb; ++j) sc[j] = 0.f;
                        for (int64_t d = 0; d < D; ++d) {
                            const float qd = qr[d] * scale, *kd = kt + d * BS;
#pragma omp simd
                            for (int64_t j = ja; j < jb; ++j) sc[j] += qd * kd[j];
                        }
                        float bm = m[r];
#pragma omp simd reduction(max : bm)
                        for (int64_t j = ja; j < jb; ++j) bm = sc[j] > bm ? sc[j] : bm;
                        const float corr = m[r] == -INFINITY ? 0.f : tandem_expf(m[r] - bm);
                        float total = 0.f;
#pragma omp simd reduction(+ : total)
                        for (int64_t j = ja; j < jb; ++j) {
                            sc[j] = tandem_expf(sc[j] - bm);
                            total += sc[j];
                        }
                        m[r] = bm;
                        l[r] = l[r] * corr + total;
                        float *ar = acc + r * D;
                        if (corr != 1.f) {
#pragma omp simd
                            for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
                        }
                        for (int64_t j = ja; j < jb; ++j) {
                            const float w = sc[j];
                            const KV_T *vj = vb + j * KVH * D;
#pragma omp simd
                            for (int64_t d = 0; d < D; ++d) ar[d] += w * KV_LOAD(vj + d);
                        }
                    }
                }
            }
            for (int64_t i = i0; i < i1; ++i)
                for (int64_t g = 0; g < G; ++g) {
                    const int64_t r = (i - i0) * G + g;
                    const float inv = 1.f / l[r], *ar = acc + r * D;
                    float *o = out + ((first_row[s] + i) * num_heads + kh * G + g) * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) o[d] = ar[d] * inv;
                }
        }
        free(kt); free(sc); free(m); free(l); free(acc);
    }
    free(task_base);
    return failed ? -1 : 0;
}
