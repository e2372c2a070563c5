/* Body of the paged prefill kernel, included once per KV element type with
 * NAME, KV_T and KV_LOAD defined. See paged_prefill.c. */
int NAME(const float *q, int64_t q_stride, float *out, const int64_t *first_row,
         const int64_t *start_pos, const int64_t *num_queries, const KV_T *k_cache,
         const KV_T *v_cache, const int64_t *block_table, int64_t table_stride,
         int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
         int64_t block_size, int64_t window, float scale) {
    const int64_t G = num_heads / num_kv_heads, D = head_dim, KVH = num_kv_heads, BS = block_size;
    const int64_t block_stride = BS * KVH * D, max_rows = (TILE * G + RB - 1) / RB * RB;
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
        /* qs [rows, D] scaled queries; kt [D, KC] a chunk of keys transposed;
         * m, l [rows] running max and sum; acc [rows, D] unnormalized outputs */
        float *qs = malloc(sizeof(float) * max_rows * D), *kt = malloc(sizeof(float) * D * KC);
        float *m = malloc(sizeof(float) * max_rows), *l = malloc(sizeof(float) * max_rows);
        float *acc = malloc(sizeof(float) * max_rows * D);
        if (!qs || !kt || !m || !l || !acc) failed = 1;
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
            const int64_t rows = (i1 - i0) * G, padded = (rows + RB - 1) / RB * RB;
            for (int64_t r = 0; r < padded; ++r) {  /* row r: query i0 + r / G, head kh*G + r % G */
                float *qr = qs + r * D;
                if (r < rows) {
                    const float *src = q + (first_row[s] + i0 + r / G) * q_stride + (kh * G + r % G) * D;
                    for (int64_t d = 0; d < D; ++d) qr[d] = src[d] * scale;
                } else {
                    memset(qr, 0, sizeof(float) * D);
                }
                m[r] = -INFINITY;
                l[r] = 0.f;
            }
            memset(acc, 0, sizeof(float) * padded * D);
            for (int64_t c0 = lo; c0 <= p1; c0 += KC) {
                const int64_t kn = p1 - c0 + 1 < KC ? p1 - c0 + 1 : KC;  /* keys in this chunk */
                const KV_T *vrow[KC];
                for (int64_t j = 0; j < KC; ++j) {
                    if (j >= kn) {
                        for (int64_t d = 0; d < D; ++d) kt[d * KC + j] = 0.f;
                        continue;
                    }
                    const int64_t pos = c0 + j, off = table[pos / BS] * block_stride
                                                       + (pos % BS) * KVH * D + kh * D;
                    const KV_T *kp = k_cache + off;
                    vrow[j] = v_cache + off;
                    for (int64_t d = 0; d < D; ++d) kt[d * KC + j] = KV_LOAD(kp + d);
                }
                for (int64_t r0 = 0; r0 < rows; r0 += RB) {
                    /* scores of RB rows against the chunk: RB independent vector accumulators */
                    float sc[RB][KC];
                    for (int64_t rr = 0; rr < RB; ++rr)
                        for (int64_t j = 0; j < KC; ++j) sc[rr][j] = 0.f;
                    for (int64_t d = 0; d < D; ++d) {
                        const float *kd = kt + d * KC;
                        for (int64_t rr = 0; rr < RB; ++rr) {
                            const float qd = qs[(r0 + rr) * D + d];
#pragma omp simd
                            for (int64_t j = 0; j < KC; ++j) sc[rr][j] += qd * kd[j];
                        }
                    }
                    for (int64_t rr = 0; rr < RB && r0 + rr < rows; ++rr) {
                        const int64_t r = r0 + rr, p = p0 + r / G;
                        const int64_t first = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;
                        const int64_t ja = first > c0 ? first - c0 : 0;
                        const int64_t jb = p - c0 + 1 < kn ? p - c0 + 1 : kn;  /* keys [ja, jb) */
                        if (ja >= jb) continue;
                        float bm = m[r];
                        for (int64_t j = ja; j < jb; ++j) bm = sc[rr][j] > bm ? sc[rr][j] : bm;
                        const float corr = m[r] == -INFINITY ? 0.f : tandem_expf(m[r] - bm);
                        float total = 0.f, w[KC];
#pragma omp simd reduction(+ : total)
                        for (int64_t j = 0; j < KC; ++j) {
                            w[j] = (j >= ja && j < jb) ? tandem_expf(sc[rr][j] - bm) : 0.f;
                            total += w[j];
                        }
                        m[r] = bm;
                        l[r] = l[r] * corr + total;
                        float *ar = acc + r * D;
                        if (corr != 1.f) {
#pragma omp simd
                            for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
                        }
                        for (int64_t j = ja; j < jb; ++j) {
                            const float wj = w[j];
                            const KV_T *vj = vrow[j];
#pragma omp simd
                            for (int64_t d = 0; d < D; ++d) ar[d] += wj * KV_LOAD(vj + d);
                        }
                    }
                }
            }
            for (int64_t r = 0; r < rows; ++r) {
                const float inv = 1.f / l[r], *ar = acc + r * D;
                float *o = out + (first_row[s] + i0 + r / G) * num_heads * D + (kh * G + r % G) * D;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) o[d] = ar[d] * inv;
            }
        }
        free(qs); free(kt); free(m); free(l); free(acc);
    }
    free(task_base);
    return failed ? -1 : 0;
}
