/* Body of the paged prefill kernel, included once per KV element type with NAME (the
 * exported symbol), KV_T (the cache element) and KV_LOAD16 (16 elements -> floats)
 * defined. See paged_prefill.c. */
#define TANDEM_CAT2(a, b) a##b
#define TANDEM_CAT(a, b) TANDEM_CAT2(a, b)
#define RUN_TASK TANDEM_CAT(NAME, _task)

/* One task: rows ``tk`` of one sequence and kv head, every key tile they attend. ``buf``
 * is the thread's scratch (see NAME). */
static void RUN_TASK(const tandem_prefill_task *tk, const float *q, int64_t q_stride, float *out,
                     const int64_t *row0, const int64_t *pos0, const KV_T *k_cache,
                     const KV_T *v_cache, const int64_t *block_table, int64_t table_stride,
                     int64_t H, int64_t KVH, int64_t D, int64_t block_size, int64_t window,
                     float scale, float *buf, int64_t Mp_max) {
    const int64_t G = H / KVH, b = tk->seq, kh = tk->kv_head, cnt = tk->count;
    const int64_t M = cnt * G, Mp = (M + 15) / 16 * 16;
    const int64_t p_first = pos0[b] + tk->first, khi = p_first + cnt - 1;
    const int64_t klo = (window > 0 && p_first - window + 1 > 0) ? p_first - window + 1 : 0;
    const int64_t row_first = row0[b] + tk->first, block_stride = block_size * KVH * D;
    const int64_t *table = block_table + b * table_stride;
    float *qt = buf, *o = qt + D * Mp_max, *st = o + Mp_max * D, *kbuf = st + KT * Mp_max;
    float *vbuf = kbuf + KT * D, *mx = vbuf + KT * D, *l = mx + Mp_max, *alpha = l + Mp_max;
    int32_t *posm = (int32_t *)(alpha + Mp_max);

    /* Q^T [D][Mp], scaled; row m = i * G + g is position p_first + i, head kh * G + g */
    for (int64_t m = 0; m < Mp; ++m) {
        const int64_t i = m < M ? m / G : cnt - 1;
        posm[m] = (int32_t)(p_first + i);
        if (m >= M) {
            for (int64_t d = 0; d < D; ++d) qt[d * Mp + m] = 0.f;
            continue;
        }
        const float *src = q + (row_first + i) * q_stride + (kh * G + m % G) * D;
        for (int64_t d = 0; d < D; ++d) qt[d * Mp + m] = src[d] * scale;
    }
    for (int64_t m = 0; m < Mp; ++m) { mx[m] = -INFINITY; l[m] = 0.f; }
    memset(o, 0, sizeof(float) * Mp * D);

    for (int64_t k0 = klo; k0 <= khi; k0 += KT) {
        const int64_t nk = khi - k0 + 1 < KT ? khi - k0 + 1 : KT, nkp = (nk + JB - 1) / JB * JB;
        for (int64_t j = 0; j < nk; ++j) {  /* the tile's keys and values, widened to fp32 */
            const int64_t key = k0 + j;
            const int64_t at = table[key / block_size] * block_stride + ((key % block_size) * KVH + kh) * D;
            for (int64_t c = 0; c < D; c += 16) {
                _mm512_storeu_ps(kbuf + j * D + c, KV_LOAD16(k_cache + at + c));
                _mm512_storeu_ps(vbuf + j * D + c, KV_LOAD16(v_cache + at + c));
            }
        }
        memset(kbuf + nk * D, 0, sizeof(float) * (nkp - nk) * D);

        /* S^T [nkp][Mp]; the mask below covers what is skipped past a row chunk's last key */
        for (int64_t m0 = 0; m0 < Mp; m0 += 64) {
            const int64_t reach = posm[(m0 + 64 < Mp ? m0 + 64 : Mp) - 1] - k0 + 1;
            for (int64_t j0 = 0; j0 < nkp && j0 < reach; j0 += JB) {
                const float *kj = kbuf + j0 * D;
                float *sj = st + j0 * Mp;
                switch (Mp - m0 >= 64 ? 4 : (Mp - m0) / 16) {
                    case 4: tandem_scores(kj, qt, sj, D, Mp, m0, 4); break;
                    case 3: tandem_scores(kj, qt, sj, D, Mp, m0, 3); break;
                    case 2: tandem_scores(kj, qt, sj, D, Mp, m0, 2); break;
                    default: tandem_scores(kj, qt, sj, D, Mp, m0, 1); break;
                }
            }
        }

        /* causal (and window) mask, only where the tile reaches past a row's keys */
        if (k0 + nk - 1 > p_first || (window > 0 && k0 < khi - window + 1)) {
            const __m512 ninf = _mm512_set1_ps(-INFINITY);
            for (int64_t j = 0; j < nk; ++j) {
                const __m512i key = _mm512_set1_epi32((int32_t)(k0 + j));
                const int64_t past = k0 + j + window;  /* keys before a row at ``past`` fall out */
                const __m512i last = _mm512_set1_epi32(past > INT32_MAX ? INT32_MAX : (int32_t)past);
                for (int64_t m = 0; m < Mp; m += 16) {
                    const __m512i pos = _mm512_loadu_si512(posm + m);
                    __mmask16 ok = _mm512_cmpge_epi32_mask(pos, key);
                    if (window > 0) ok &= _mm512_cmplt_epi32_mask(pos, last);
                    float *s = st + j * Mp + m;
                    _mm512_storeu_ps(s, _mm512_mask_blend_ps(ok, ninf, _mm512_loadu_ps(s)));
                }
            }
        }

        /* online softmax, 16 rows at a time: P^T overwrites S^T */
        for (int64_t m = 0; m < Mp; m += 16) {
            const __m512 old = _mm512_loadu_ps(mx + m);
            __m512 top = old;
            for (int64_t j = 0; j < nk; ++j) top = _mm512_max_ps(top, _mm512_loadu_ps(st + j * Mp + m));
            const __mmask16 none = _mm512_cmp_ps_mask(top, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
            const __m512 base = _mm512_mask_blend_ps(none, top, _mm512_setzero_ps());
            __m512 sum = _mm512_setzero_ps();
            for (int64_t j = 0; j < nk; ++j) {
                float *s = st + j * Mp + m;
                const __m512 p = tandem_exp512(_mm512_sub_ps(_mm512_loadu_ps(s), base));
                _mm512_storeu_ps(s, p);
                sum = _mm512_add_ps(sum, p);
            }
            const __m512 a = tandem_exp512(_mm512_sub_ps(old, base));
            _mm512_storeu_ps(l + m, _mm512_fmadd_ps(_mm512_loadu_ps(l + m), a, sum));
            _mm512_storeu_ps(mx + m, top);
            _mm512_storeu_ps(alpha + m, a);
        }
        for (int64_t m = 0; m < Mp; ++m) {  /* rescale rows whose max moved */
            if (alpha[m] == 1.f) continue;
            const __m512 a = _mm512_set1_ps(alpha[m]);
            for (int64_t d = 0; d < D; d += 16)
                _mm512_storeu_ps(o + m * D + d, _mm512_mul_ps(a, _mm512_loadu_ps(o + m * D + d)));
        }

        for (int64_t m0 = 0; m0 < Mp; m0 += RB) {  /* O += P V, up to the rows' last key */
            const int64_t reach = posm[m0 + RB - 1] - k0 + 1, nj = reach < nk ? reach : nk;
            for (int64_t dc = 0; dc < D && nj > 0; dc += 64) {
                switch (D - dc >= 64 ? 4 : (D - dc) / 16) {
                    case 4: tandem_values(st, vbuf, o, nj, D, Mp, m0, dc, 4); break;
                    case 3: tandem_values(st, vbuf, o, nj, D, Mp, m0, dc, 3); break;
                    case 2: tandem_values(st, vbuf, o, nj, D, Mp, m0, dc, 2); break;
                    default: tandem_values(st, vbuf, o, nj, D, Mp, m0, dc, 1); break;
                }
            }
        }
    }

    for (int64_t m = 0; m < M; ++m) {
        const __m512 inv = _mm512_set1_ps(1.f / l[m]);
        float *dst = out + ((row_first + m / G) * H + kh * G + m % G) * D;
        for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(dst + d, _mm512_mul_ps(inv, _mm512_loadu_ps(o + m * D + d)));
    }
}

int NAME(const float *q, int64_t q_stride, float *out, const int64_t *row0, const int64_t *pos0,
         const int64_t *num_queries, int64_t num_seqs, const KV_T *k_cache, const KV_T *v_cache,
         const int64_t *block_table, int64_t table_stride, int64_t num_heads,
         int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t window,
         float scale) {
    const int64_t G = num_heads / num_kv_heads, D = head_dim, QT = tandem_prefill_positions(G);
    const int64_t Mp_max = (QT * G + 15) / 16 * 16;
    int64_t num_tasks = 0;
    for (int64_t b = 0; b < num_seqs; ++b) num_tasks += num_kv_heads * ((num_queries[b] + QT - 1) / QT);
    tandem_prefill_task *tasks = malloc(sizeof(tandem_prefill_task) * (num_tasks > 0 ? num_tasks : 1));
    if (tasks == NULL) return -1;
    int64_t n = 0;
    for (int64_t b = 0; b < num_seqs; ++b)
        for (int64_t first = 0; first < num_queries[b]; first += QT)
            for (int64_t kh = 0; kh < num_kv_heads; ++kh) {
                const int64_t count = num_queries[b] - first < QT ? num_queries[b] - first : QT;
                const int64_t last = pos0[b] + first + count - 1, p = pos0[b] + first;
                const int64_t lo = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;
                tasks[n++] = (tandem_prefill_task){b, kh, first, count, last - lo + 1};
            }
    qsort(tasks, (size_t)num_tasks, sizeof *tasks, tandem_prefill_task_order);
    /* per thread: Q^T, O, S^T, K and V tiles, max, sum, alpha, positions */
    const size_t floats = (size_t)(2 * D * Mp_max + KT * Mp_max + 2 * KT * D + 4 * Mp_max);
    int failed = 0;
#pragma omp parallel num_threads(tandem_team(num_tasks)) reduction(| : failed)
    {
        /* cache-line aligned: every vector access stays within one line */
        float *buf = aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64);
        if (buf == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < num_tasks; ++t) {
            if (buf == NULL) continue;
            RUN_TASK(tasks + t, q, q_stride, out, row0, pos0, k_cache, v_cache, block_table,
                     table_stride, num_heads, num_kv_heads, D, block_size, window, scale, buf,
                     Mp_max);
        }
        free(buf);
    }
    free(tasks);
    return failed ? -1 : 0;
}
#undef RUN_TASK
