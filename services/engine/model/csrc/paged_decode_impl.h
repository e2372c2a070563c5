/* Body of the paged decode kernel, included once per KV element type with
 * NAME (the exported symbol), KV_T (the cache element) and KV_LOAD (element
 * pointer -> float) defined. See paged_decode.c. */
int NAME(const float *q, int64_t q_stride, float *out, const int64_t *rows,
         const KV_T *k_cache, const KV_T *v_cache, const int64_t *block_table,
         int64_t table_stride, const int64_t *positions, int64_t num_rows, int64_t num_heads,
         int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t window,
         float scale, int64_t head_splits) {
    const int64_t G = num_heads / num_kv_heads, D = head_dim, KVH = num_kv_heads;
    const int64_t kvh_per_task = KVH / head_splits, hpt = kvh_per_task * G;
    const int64_t block_stride = block_size * KVH * D;
    const int64_t tasks = num_rows * head_splits;
    int failed = 0;
#pragma omp parallel num_threads(tandem_team(tasks)) reduction(| : failed)
    {
        float *scores = NULL, *acc = malloc(sizeof(float) * hpt * D);
        int64_t cap = 0;
        if (acc == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; ++task) {
            if (failed) continue;
            const int64_t r = task / head_splits, kh0 = (task % head_splits) * kvh_per_task;
            const int64_t pos = positions[r];
            const int64_t first = (window > 0 && pos - window + 1 > 0) ? pos - window + 1 : 0;
            const int64_t n = pos - first + 1;
            if (hpt * n > cap) {
                float *grown = realloc(scores, sizeof(float) * hpt * n);
                if (grown == NULL) { failed = 1; continue; }
                scores = grown;
                cap = hpt * n;
            }
            const int64_t *table = block_table + r * table_stride;
            const KV_T *kbase = NULL, *vbase = NULL;
            const float *qr = q + rows[r] * q_stride + kh0 * G * D;
            /* pass 1: scores[h][j] = q_h . k_j * scale, key rows read in cache order */
            for (int64_t j = 0, blk = first / block_size, off = first % block_size; j < n; ++j, ++off) {
                if (off == block_size) { off = 0; ++blk; }
                if (j == 0 || off == 0) kbase = k_cache + table[blk] * block_stride;
                const KV_T *kp = kbase + (off * KVH + kh0) * D;
                for (int64_t h = 0; h < hpt; ++h) {
                    const float *qh = qr + h * D;
                    const KV_T *kh = kp + (h / G) * D;
                    float s = 0.f;
#pragma omp simd reduction(+ : s)
                    for (int64_t d = 0; d < D; ++d) s += qh[d] * KV_LOAD(kh + d);
                    scores[h * n + j] = s * scale;
                }
            }
            for (int64_t h = 0; h < hpt; ++h) {
                float *sh = scores + h * n, m = -INFINITY, total = 0.f;
#pragma omp simd reduction(max : m)
                for (int64_t j = 0; j < n; ++j) m = sh[j] > m ? sh[j] : m;
#pragma omp simd
                for (int64_t j = 0; j < n; ++j) sh[j] = tandem_expf(sh[j] - m);
#pragma omp simd reduction(+ : total)
                for (int64_t j = 0; j < n; ++j) total += sh[j];
                const float inv = 1.f / total;
#pragma omp simd
                for (int64_t j = 0; j < n; ++j) sh[j] *= inv;
            }
            /* pass 2: out_h = sum_j p[h][j] * v_j */
            memset(acc, 0, sizeof(float) * hpt * D);
            for (int64_t j = 0, blk = first / block_size, off = first % block_size; j < n; ++j, ++off) {
                if (off == block_size) { off = 0; ++blk; }
                if (j == 0 || off == 0) vbase = v_cache + table[blk] * block_stride;
                const KV_T *vp = vbase + (off * KVH + kh0) * D;
                for (int64_t h = 0; h < hpt; ++h) {
                    const float w = scores[h * n + j];
                    const KV_T *vh = vp + (h / G) * D;
                    float *ah = acc + h * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) ah[d] += w * KV_LOAD(vh + d);
                }
            }
            memcpy(out + (rows[r] * num_heads + kh0 * G) * D, acc, sizeof(float) * hpt * D);
        }
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}
