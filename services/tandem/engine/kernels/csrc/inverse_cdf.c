/* Inverse-CDF draws over rows of probabilities, as sampler.draw_from computes them with
 * torch (a float64 cumulative sum, then the first token whose sum exceeds u * total), bit
 * for bit: the sums run in the same order in double, and skipping zeros, which most of a
 * row is after top-k/top-p, changes nothing (x + 0.0 == x). torch's cumsum runs on one
 * thread and writes the whole [R, V] float64 table; this reads each row twice (its total,
 * then up to the token), skipping 16 zeros at a time, rows split over OpenMP threads, and
 * never writes the table: faster than torch's with few tokens kept and with all of them
 * (services/RESULTS.md).
 *
 *   probs [rows, vocab] fp32 contiguous, u [rows] float64 in [0, 1)
 *   out   [rows] int64: the token; -1 where the row's total is not finite and positive
 *         (a NaN, an infinity, or all zeros: the caller decides those rows as torch does)
 */
#include <math.h>
#include <stdint.h>

#include "team.h"

#define SPAN 16 /* values tested for a nonzero at once */

/* Whether p[i .. end) holds a nonzero (or a NaN). */
static inline int any_nonzero(const float *p, int64_t i, int64_t end) {
    int any = 0;
#pragma omp simd reduction(| : any)
    for (int64_t t = i; t < end; ++t) any |= p[t] != 0.f;
    return any;
}

/* The sum of p[0 .. n) in double, in order, or with ``target`` >= 0 the first index where
 * that running sum exceeds it (-1: none). */
static double scan_row(const float *p, int64_t n, double target, int64_t *found) {
    double cum = 0.;
    for (int64_t i = 0; i < n; i += SPAN) {
        const int64_t end = i + SPAN < n ? i + SPAN : n;
        if (!any_nonzero(p, i, end)) continue;
        for (int64_t t = i; t < end; ++t) {  /* zeros too: adding one changes nothing */
            cum += (double)p[t];
            if (cum > target && target >= 0.) {
                *found = t;
                return cum;
            }
        }
    }
    *found = -1;
    return cum;
}

void tandem_inverse_cdf_f32(const float *probs, int64_t rows, int64_t vocab, const double *u,
                            int64_t *out) {
#pragma omp parallel for num_threads(tandem_team(rows)) schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; ++r) {
        const float *p = probs + r * vocab;
        int64_t token;
        const double total = scan_row(p, vocab, -1., &token);
        if (!(total > 0.) || !isfinite(total)) {
            out[r] = -1;
            continue;
        }
        scan_row(p, vocab, u[r] * total, &token);
        out[r] = token < 0 ? vocab - 1 : token;  /* none only for u >= 1: torch's clamp */
    }
}
