/* Weight-only int8 linear on CPU: y = (x @ W_q.T) * scale + bias, fp32 activations.
 *
 * W_q [N, K] int8, one fp32 scale per output channel (row); each weight row is
 * read once for all M input rows (M is small: decode steps), so the step reads
 * a quarter of the fp32 weight bytes. Output channels are split over OpenMP
 * threads in contiguous chunks.
 *
 *   x     [M, K] fp32 contiguous
 *   w     [N, K] int8 contiguous
 *   scale [N] fp32; bias [N] fp32 or NULL
 *   y     [M, N] fp32 contiguous
 */
#include <stddef.h>
#include <stdint.h>

#include "team.h"

void tandem_int8_linear_f32(const float *x, const int8_t *w, const float *scale,
                            const float *bias, float *y, int64_t m_rows, int64_t n_out,
                            int64_t k_in) {
#pragma omp parallel for num_threads(tandem_team(n_out / 64)) schedule(static)
    for (int64_t n = 0; n < n_out; ++n) {
        const int8_t *wn = w + n * k_in;
        const float s = scale[n], b = bias != NULL ? bias[n] : 0.f;
        for (int64_t m = 0; m < m_rows; ++m) {
            const float *xm = x + m * k_in;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t k = 0; k < k_in; ++k) acc += xm[k] * (float)wn[k];
            y[m * n_out + n] = acc * s + b;
        }
    }
}
