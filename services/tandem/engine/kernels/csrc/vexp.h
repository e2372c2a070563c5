/* exp(x) in plain float arithmetic (Cephes' expf polynomial), so loops that
 * call it vectorize (with -fno-trapping-math); relative error ~1e-7 over the range. */
#ifndef TANDEM_VEXP_H
#define TANDEM_VEXP_H
#include <math.h>
#include <stdint.h>

static inline float tandem_expf(float x) {
    x = x < -87.33654f ? -87.33654f : x;  /* ternaries, not fminf: they vectorize */
    x = x > 88.72283f ? 88.72283f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};  /* 2^n */
    return p * scale.f;
}
#endif
