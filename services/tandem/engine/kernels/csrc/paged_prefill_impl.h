/* Body of the paged prefill kernel, included once per KV element type with NAME (the
 * exported symbol), KV_T (the cache element) and KV_LOADV (VL elements -> floats)
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
    const int64_t M = cnt * G, Mp = (M + VL - 1) / VL * VL;
    const int64_t p_first = pos0[b] + tk->first, khi = p_first + cnt - 1;
    const int64_t klo = (window > 0 && p_first - window + 1 > 0) ? p_first - window + 1 : 0;
    const int64_t row_first = row0[b] + tk->first;
    const int64_t *table = block_table + b * table_stride;
    float *qt = buf, *ot = qt + D * Mp_max, *st = ot + D * Mp_max, *kbuf = st + KT * Mp_max;
    float *vbuf = kbuf + KT * D, *mx = vbuf + KT * D, *l = mx + Mp_max, *alpha = l + Mp_max;
    float *tmax = alpha + Mp_max;
    float *zeros = tmax + Mp_max;  /* D zeros */
    int32_t *posm = (int32_t *)(zeros + D);

    /* Q^T [D][Mp], scaled; row m = i * G + g is position p_first + i, head kh * G + g */
    for (int64_t m = 0; m < Mp; ++m) posm[m] = (int32_t)(p_first + (m < M ? m / G : cnt - 1));
    const vec sc = V_SET1(scale);
    for (int64_t m0 = 0; m0 < Mp; m0 += VL)
        for (int64_t d0 = 0; d0 < D; d0 += VL) {
            vec r[VL];
            for (int i = 0; i < VL; ++i) {
                const int64_t m = m0 + i;
                const float *src = q + (row_first + m / G) * q_stride + (kh * G + m % G) * D + d0;
                r[i] = m < M ? V_MUL(sc, V_LOAD(src)) : V_ZERO();
            }
            V_TRANSPOSE(r);
            for (int k = 0; k < VL; ++k) V_STORE(qt + (d0 + k) * Mp + m0, r[k]);
        }
    for (int64_t m = 0; m < Mp; ++m) { mx[m] = -INFINITY; l[m] = 0.f; }
    memset(ot, 0, sizeof(float) * D * Mp);
    memset(zeros, 0, sizeof(float) * D);

    for (int64_t k0 = klo; k0 <= khi; k0 += KT) {
        const int64_t nk = khi - k0 + 1 < KT ? khi - k0 + 1 : KT, nkp = (nk + JB - 1) / JB * JB;
        const float *krow[KT], *vrow[KT];  /* the tile's key and value rows, as fp32 */
        for (int64_t j = 0; j < nk; ++j) {
            const int64_t key = k0 + j;
            const int64_t at = tandem_key_row(table, key, block_size, KVH, kh, D);
#if KV_DIRECT
            krow[j] = (const float *)(k_cache + at);
            vrow[j] = (const float *)(v_cache + at);
#else
            for (int64_t c = 0; c < D; c += VL) {  /* widened into the thread's buffers */
                V_STORE(kbuf + j * D + c, KV_LOADV(k_cache + at + c));
                V_STORE(vbuf + j * D + c, KV_LOADV(v_cache + at + c));
            }
            krow[j] = kbuf + j * D;
            vrow[j] = vbuf + j * D;
#endif
        }
        for (int64_t j = nk; j < nkp; ++j) krow[j] = zeros;  /* padding keys score 0, masked */
        for (int64_t key = k0 + KT; key < k0 + 2 * KT && key <= khi; ++key) {  /* the next tile */
            const int64_t at = tandem_key_row(table, key, block_size, KVH, kh, D);
            for (int64_t c = 0; c < D * (int64_t)sizeof(KV_T); c += 64) {
                _mm_prefetch((const char *)(k_cache + at) + c, _MM_HINT_T1);
                _mm_prefetch((const char *)(v_cache + at) + c, _MM_HINT_T1);
            }
        }
        /* causal (or window) mask needed: the tile reaches past a row's keys */
        const int masked = k0 + nk - 1 > p_first || (window > 0 && k0 < khi - window + 1);

        /* chunks of up to MV_MAX * VL rows: scores, softmax and values while the chunk is in
         * cache */
        for (int64_t m0 = 0; m0 < Mp; m0 += MV_MAX * VL) {
            const int mv = Mp - m0 >= MV_MAX * VL ? MV_MAX : (int)((Mp - m0) / VL), rows = VL * mv;
            const int64_t reach = posm[m0 + rows - 1] - k0 + 1, nj = reach < nk ? reach : nk;
            if (nj <= 0) continue;  /* every row of the chunk is before the tile */
            /* the scores' running max per row is kept where nothing is masked or padded */
            float *tm = masked || nk != nkp ? NULL : tmax + m0;
            for (int64_t m = 0; tm != NULL && m < rows; m += VL) V_STORE(tm + m, V_SET1(-INFINITY));
            for (int64_t j0 = 0; j0 < nj; j0 += JB) {  /* S^T [nj][rows] */
                const float *const *kj = krow + j0;
                float *sj = st + j0 * Mp;
                switch (mv) {
#if MV_MAX > 2
                    case 4: tandem_scores(kj, qt, sj, tm, D, Mp, m0, 4); break;
                    case 3: tandem_scores(kj, qt, sj, tm, D, Mp, m0, 3); break;
#endif
                    case 2: tandem_scores(kj, qt, sj, tm, D, Mp, m0, 2); break;
                    default: tandem_scores(kj, qt, sj, tm, D, Mp, m0, 1); break;
                }
            }
            if (masked)
                for (int64_t j = 0; j < nj; ++j) {
                    const int32_t key = (int32_t)(k0 + j);
                    const int64_t past = k0 + j + window;  /* keys before a row at ``past`` fall out */
                    const int32_t last = past > INT32_MAX ? INT32_MAX : (int32_t)past;
                    for (int64_t m = m0; m < m0 + rows; m += VL) {
                        float *s = st + j * Mp + m;
                        V_STORE(s, v_mask_key(V_LOAD(s), posm + m, key, last, window > 0));
                    }
                }

            switch (mv) {  /* online softmax: P^T overwrites S^T */
#if MV_MAX > 2
                case 4: tandem_softmax(st, mx, l, alpha, tm, nj, Mp, m0, 4); break;
                case 3: tandem_softmax(st, mx, l, alpha, tm, nj, Mp, m0, 3); break;
#endif
                case 2: tandem_softmax(st, mx, l, alpha, tm, nj, Mp, m0, 2); break;
                default: tandem_softmax(st, mx, l, alpha, tm, nj, Mp, m0, 1); break;
            }
            for (int64_t d0 = 0; d0 < D; ) {  /* O^T = alpha O^T + V^T P^T, DB dims a call */
                const int ndb = D - d0 >= DB ? DB : (int)(D - d0);  /* D % 8 == 0: 2 or 4 */
#define TANDEM_VALUES(MV)                                                                        \
                (ndb == DB  ? tandem_values(st, vrow, ot, alpha, nj, Mp, m0, d0, MV, DB)         \
                 : ndb == 4 ? tandem_values(st, vrow, ot, alpha, nj, Mp, m0, d0, MV, 4)          \
                            : tandem_values(st, vrow, ot, alpha, nj, Mp, m0, d0, MV, 2))
                switch (mv) {
#if MV_MAX > 2
                    case 4: TANDEM_VALUES(4); break;
                    case 3: TANDEM_VALUES(3); break;
#endif
                    case 2: TANDEM_VALUES(2); break;
                    default: TANDEM_VALUES(1); break;
                }
#undef TANDEM_VALUES
                d0 += ndb;
            }
        }
    }

    for (int64_t m0 = 0; m0 < M; m0 += VL) {  /* out = O / l, transposed back */
        const vec inv = V_DIV(V_SET1(1.f), V_LOAD(l + m0));
        for (int64_t d0 = 0; d0 < D; d0 += VL) {
            vec r[VL];
            for (int k = 0; k < VL; ++k) r[k] = V_MUL(inv, V_LOAD(ot + (d0 + k) * Mp + m0));
            V_TRANSPOSE(r);
            for (int64_t i = 0; i < VL && m0 + i < M; ++i) {
                const int64_t m = m0 + i;
                V_STORE(out + ((row_first + m / G) * H + kh * G + m % G) * D + d0, r[i]);
            }
        }
    }
}

int NAME(const float *q, int64_t q_stride, float *out, const int64_t *row0, const int64_t *pos0,
         const int64_t *num_queries, int64_t num_seqs, const KV_T *k_cache, const KV_T *v_cache,
         const int64_t *block_table, int64_t table_stride, int64_t num_heads,
         int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t window,
         float scale) {
    const int64_t G = num_heads / num_kv_heads, D = head_dim, QT = tandem_prefill_positions(G);
    const int64_t Mp_max = (QT * G + VL - 1) / VL * VL;
    int64_t num_tasks;
    tandem_prefill_task *tasks = tandem_prefill_tasks(pos0, num_queries, num_seqs, num_kv_heads, QT,
                                                      window, &num_tasks);
    if (tasks == NULL) return -1;
    /* per thread: Q^T, O^T, S^T, K and V tiles, max, sum, alpha, tile max, positions */
    const size_t floats = (size_t)(2 * D * Mp_max + KT * Mp_max + 2 * KT * D + D + 5 * Mp_max);
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
