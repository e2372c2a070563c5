/* Fused elementwise steps of a decoder layer on CPU (fp32; SiLU·mul also bf16), one
 * pass each over memory where torch takes several. Rows are split over OpenMP threads.
 * Built with -std=c11 (no FMA contraction), so RoPE rounds as torch does. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels.h"
#include "kv_load.h"
#include "team.h"
#include "silu.h"

/* x[t] += delta[t] (when delta is given), then out[t] = w * (x[t] * rsqrt(mean(x[t]^2) + eps)).
 * x, delta, out: [T, dim] contiguous; w: [dim]. */
void tandem_add_rms_norm_f32(float *x, const float *delta, float *out, const float *w,
                             int64_t rows, int64_t dim, float eps) {
#pragma omp parallel for num_threads(tandem_team(rows)) schedule(static)
    for (int64_t t = 0; t < rows; ++t) {
        float *xt = x + t * dim, *ot = out + t * dim;
        float ss = 0.f;
        if (delta != NULL) {
            const float *dt = delta + t * dim;
#pragma omp simd
            for (int64_t i = 0; i < dim; ++i) xt[i] += dt[i];
        }
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < dim; ++i) ss += xt[i] * xt[i];
        const float inv = 1.f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) ot[i] = w[i] * (xt[i] * inv);
    }
}

/* Rotate-half RoPE in place: x[:h] = x1*c - x2*s, x[h:] = x2*c + x1*s.
 * q: [T, *, D] with row stride q_stride, nq heads; likewise k. cos/sin: [P, D]. */
void tandem_rope_f32(float *q, int64_t q_stride, int64_t nq, float *k, int64_t k_stride,
                     int64_t nk, const float *cos_t, const float *sin_t,
                     const int64_t *positions, int64_t rows, int64_t head_dim) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(tandem_team(rows)) schedule(static)
    for (int64_t t = 0; t < rows; ++t) {
        const float *c = cos_t + positions[t] * head_dim, *s = sin_t + positions[t] * head_dim;
        for (int64_t h = 0; h < nq + nk; ++h) {
            float *x = h < nq ? q + t * q_stride + h * head_dim : k + t * k_stride + (h - nq) * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float x1 = x[i], x2 = x[i + half];
                const float a = x1 * c[i], b = -x2 * s[i];
                const float e = x2 * c[i + half], f = x1 * s[i + half];
                x[i] = a + b;
                x[i + half] = e + f;
            }
        }
    }
}

/* Rows' new K and V into their cache slots: row t's k (k + t * k_stride, width values)
 * into slot slots[t] of k_cache, its v likewise; copied, or rounded to bf16 when ``bf16``.
 * Slots are distinct and in 0 .. num_slots - 1; returns -1, writing nothing, if one is not
 * in range. */
int tandem_store_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                    int64_t rows, int64_t width, const int64_t *slots, int64_t num_slots,
                    void *k_cache, void *v_cache, int bf16) {
    for (int64_t t = 0; t < rows; ++t)
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
#pragma omp parallel for num_threads(tandem_team(rows / 64 + 1)) schedule(static)
    for (int64_t t = 0; t < rows; ++t) {
        tandem_store_kv_row(k_cache, bf16, slots[t], k + t * k_stride, width);
        tandem_store_kv_row(v_cache, bf16, slots[t], v + t * v_stride, width);
    }
    return 0;
}

static inline float tandem_store_f32(float f) { return f; }

/* out[t, i] = silu(gu[t, i]) * gu[t, inter + i]; gu: [T, 2*inter], out: [T, inter], both
 * of element type T: fp32, or bf16 (each value widened, the fp32 math, the result rounded
 * once: what widening gu, the fp32 kernel and rounding its output give). */
#define SILU_MUL(name, T, load, store)                                                     \
    void name(const T *gu, T *out, int64_t rows, int64_t inter) {                         \
        _Pragma("omp parallel for num_threads(tandem_team(rows)) schedule(static)")       \
        for (int64_t t = 0; t < rows; ++t) {                                              \
            const T *restrict g = gu + t * 2 * inter, *restrict u = g + inter;            \
            T *restrict o = out + t * inter;                                              \
            _Pragma("omp simd")                                                           \
            for (int64_t i = 0; i < inter; ++i)                                           \
                o[i] = store(tandem_silu_mul1(load(g + i), load(u + i)));                 \
        }                                                                                 \
    }

SILU_MUL(tandem_silu_mul_f32, float, tandem_load_f32, tandem_store_f32)
SILU_MUL(tandem_silu_mul_bf16, uint16_t, tandem_load_bf16, tandem_round_bf16)
