/* KV cache element types: fp32 as is, bf16 widened to fp32 (its top 16 bits). */
#ifndef TANDEM_KV_LOAD_H
#define TANDEM_KV_LOAD_H
#include <stdint.h>
#include <string.h>

static inline float tandem_load_f32(const float *p) { return *p; }

static inline float tandem_load_bf16(const uint16_t *p) {
    const uint32_t bits = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#endif
