/* A row's sampling candidates without sorting it: every token whose logit lies above a
 * floor chosen per row, in token order, so that top-k and top-p can be decided among a
 * few tokens (services/tandem/engine/sampling_masks.py) rather than over a sort of the row.
 *
 * Each row's tokens fall into NB buckets by their distance below the row's maximum m,
 * in steps of 1 / (NB - 1) of the span down to its smallest finite logit: bucket b holds
 * d = (m - x) * scale in [b, b + 1), the last one also -inf. Bucket order is value
 * order: a token of a lower bucket is strictly larger than every token of a higher one,
 * and tokens of equal value share a bucket. The floor lies under the first bucket j at
 * which the buckets 0 .. j together hold ``need_count`` tokens and ``need_mass`` of the
 * row's softmax mass (summed here, over vexp.h's exp): the candidates are a prefix of
 * the row's descending order, every other token lies below all of them, and the
 * caller checks, in its own arithmetic, that they hold what the row's top-k or top-p
 * needs. No pass sorts: four over the row (its range, exp, the buckets, the candidates).
 *
 *   x          [rows, vocab] fp32 contiguous
 *   need_mass  [rows] fp32 in [0, 1]; need_count [rows] int64 (< 0: the row needs no candidates)
 *   vals [rows, cap] fp32, ids [rows, cap] int64: the candidates in token order, then
 *              -inf / ``vocab`` up to cap
 *   found      [rows] int64: how many; -1 where more than ``cap`` would be needed, the mass
 *              is not reached, or the row has a NaN, an infinity or no finite logit
 *              (such rows are decided over a full sort)
 * Returns 0, or -1 when a scratch row cannot be allocated (then every ``found`` is -1).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "team.h"
#include "vexp.h"

#define NB 1024  /* buckets per row */
#define CHUNK 32 /* tokens the candidates are collected from at a time */
#define WAYS 4   /* histograms a row's tokens are spread over (i % WAYS): a run of tokens in
                    one bucket updates different counters, not each other's just-stored one */

/* One row's candidates (see the file comment); ``e`` and ``bucket`` are scratch for vocab
 * values each. */
static int64_t row_candidates(const float *x, int64_t vocab, float need_mass, int64_t need_count,
                              int64_t cap, float *vals, int64_t *ids, float *e, int32_t *bucket) {
    float m = -INFINITY, lo = INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : m) reduction(min : lo) reduction(| : nan)
    for (int64_t i = 0; i < vocab; ++i) {
        m = x[i] > m ? x[i] : m;
        lo = x[i] < lo && x[i] > -INFINITY ? x[i] : lo;
        nan |= x[i] != x[i];
    }
    if (nan || m == -INFINITY || m == INFINITY) return -1;
    const float scale = m > lo ? (float)(NB - 1) / (m - lo) : 0.f;  /* 0: one value, one bucket */
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < vocab; ++i) {
        const float d = (m - x[i]) * scale;  /* -inf: d = inf, the last bucket */
        bucket[i] = d < (float)(NB - 1) ? (int32_t)d : NB - 1;
        e[i] = tandem_expf(x[i] - m);  /* -inf: exp of the clamped floor, tiny */
        total += e[i];
    }
    float mass[WAYS][NB] = {{0}};
    int32_t count[WAYS][NB] = {{0}};
    int64_t i = 0;
    for (; i + WAYS <= vocab; i += WAYS)
        for (int w = 0; w < WAYS; ++w) {
            mass[w][bucket[i + w]] += e[i + w];
            ++count[w][bucket[i + w]];
        }
    for (; i < vocab; ++i) {
        mass[0][bucket[i]] += e[i];
        ++count[0][bucket[i]];
    }
    double cum_mass = 0.;
    int64_t cum = 0;
    int32_t j = 0;
    for (;; ++j) {
        if (j == NB) return -1;  /* the mass is not reached (rounding, or a need of 1) */
        for (int w = 0; w < WAYS; ++w) {
            cum_mass += mass[w][j];
            cum += count[w][j];
        }
        if (cum > cap) return -1;
        if (cum_mass >= (double)need_mass * total && cum >= need_count) break;
    }
    int64_t n = 0;
    for (i = 0; i < vocab; i += CHUNK) {  /* most chunks hold no candidate: one vector test */
        const int64_t end = i + CHUNK < vocab ? i + CHUNK : vocab;
        int any = 0;
#pragma omp simd reduction(| : any)
        for (int64_t t = i; t < end; ++t) any |= bucket[t] <= j;
        for (int64_t t = i; any && t < end; ++t)
            if (bucket[t] <= j) {
                vals[n] = x[t];
                ids[n++] = t;
            }
    }
    return n;
}

int tandem_top_candidates_f32(const float *x, int64_t rows, int64_t vocab, const float *need_mass,
                              const int64_t *need_count, int64_t cap, float *vals, int64_t *ids,
                              int64_t *found) {
    int failed = 0;
#pragma omp parallel num_threads(tandem_team(rows)) reduction(| : failed)
    {
        float *e = malloc(sizeof(float) * (size_t)vocab);
        int32_t *bucket = malloc(sizeof(int32_t) * (size_t)vocab);
        if (e == NULL || bucket == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; ++r) {
            float *v = vals + r * cap;
            int64_t *t = ids + r * cap;
            found[r] = need_count[r] < 0 ? 0
                       : e == NULL || bucket == NULL ? -1
                       : row_candidates(x + r * vocab, vocab, need_mass[r], need_count[r], cap, v, t, e,
                                        bucket);
            for (int64_t i = found[r] > 0 ? found[r] : 0; i < cap; ++i) {
                v[i] = -INFINITY;
                t[i] = vocab;
            }
        }
        free(e);
        free(bucket);
    }
    return failed ? -1 : 0;
}
