/* Weight-only int8 linear on CPU: y = (x @ W_q.T) * scale + bias, fp32 activations.
 *
 * W_q [N, K] int8, one fp32 scale per output channel (row); each weight row is
 * read once for all M input rows (M is small: decode steps), so the step reads
 * a quarter of the fp32 weight bytes. With several rows the weight row is
 * widened to fp32 once (into a per-thread buffer) and reused from L1. Output
 * channels are split over OpenMP threads in contiguous chunks.
 *
 *   x     [M, K] fp32 contiguous
 *   w     [N, K] int8 contiguous
 *   scale [N] fp32; bias [N] fp32 or NULL
 *   y     [M, N] fp32 contiguous
 * Returns 0, or -1 when a thread's buffer could not be allocated.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "team.h"

int tandem_int8_linear_f32(const float *x, const int8_t *w, const float *scale,
                           const float *bias, float *y, int64_t m_rows, int64_t n_out,
                           int64_t k_in) {
    int failed = 0;
#pragma omp parallel num_threads(tandem_team(n_out / 64)) reduction(| : failed)
    {
        float *wf = m_rows > 1 ? malloc(sizeof(float) * k_in) : NULL;
        if (m_rows > 1 && wf == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t n = 0; n < n_out; ++n) {
            if (failed) continue;
            const int8_t *wn = w + n * k_in;
            const float s = scale[n], b = bias != NULL ? bias[n] : 0.f;
            if (m_rows == 1) {
                float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                for (int64_t k = 0; k < k_in; ++k) acc += x[k] * (float)wn[k];
                y[n] = acc * s + b;
                continue;
            }
#pragma omp simd
            for (int64_t k = 0; k < k_in; ++k) wf[k] = (float)wn[k];
            for (int64_t m = 0; m < m_rows; ++m) {
                const float *xm = x + m * k_in;
                float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                for (int64_t k = 0; k < k_in; ++k) acc += xm[k] * wf[k];
                y[m * n_out + n] = acc * s + b;
            }
        }
        free(wf);
    }
    return failed ? -1 : 0;
}
