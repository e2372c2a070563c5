/* Row-wise argmax of fp32 logits on CPU, as torch's argmax picks it: the first maximal
 * value, or the first NaN where a row has one. torch's CPU argmax compares element by
 * element on one thread (slow over a step's rows of a large vocabulary: services/RESULTS.md);
 * this takes the row's maximum vectorized, then finds its first occurrence, rows split
 * over OpenMP threads.
 *
 *   x   [rows, cols] fp32 contiguous, cols >= 1
 *   out [rows] int64
 */
#include <math.h>
#include <stdint.h>

#include "team.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static int64_t argmax_row(const float *x, int64_t n) {
    float best = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
    for (int64_t i = 0; i < n; ++i) {
        best = x[i] > best ? x[i] : best;
        nan |= x[i] != x[i];
    }
    int64_t i = 0;
    if (nan) {
        while (x[i] == x[i]) ++i;
        return i;
    }
#if defined(__AVX512F__)
    const __m512 target = _mm512_set1_ps(best);
    for (; i + 16 <= n; i += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), target, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
#endif
    for (; i < n; ++i)
        if (x[i] == best) return i;
    return 0; /* unreachable: best is one of the row's values */
}

void tandem_argmax_f32(const float *x, int64_t rows, int64_t cols, int64_t *out) {
#pragma omp parallel for num_threads(tandem_team(rows)) schedule(static)
    for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * cols, cols);
}
