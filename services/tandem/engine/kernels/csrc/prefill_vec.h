/* The vector operations the paged prefill kernel is written in: VL lanes of fp32, 16
 * with AVX-512 and 8 with AVX2 + FMA, each a single instruction or a short fixed sequence,
 * so the kernel's loops are the same for both and a lane's arithmetic is too.
 *
 * MV_MAX: vectors of VL query rows a micro-kernel takes at once (its accumulators must
 * stay in registers: 32 zmm, 16 ymm). */
#ifndef TANDEM_PREFILL_VEC_H
#define TANDEM_PREFILL_VEC_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#if defined(__AVX512F__)
#include "transpose16.h"
#include "vexp512.h"

#define VL 16
#define MV_MAX 4
typedef __m512 vec;
#define V_LOAD(p) _mm512_loadu_ps(p)
#define V_STORE(p, v) _mm512_storeu_ps(p, v)
#define V_SET1(x) _mm512_set1_ps(x)
#define V_ZERO() _mm512_setzero_ps()
#define V_ADD(a, b) _mm512_add_ps(a, b)
#define V_SUB(a, b) _mm512_sub_ps(a, b)
#define V_MUL(a, b) _mm512_mul_ps(a, b)
#define V_DIV(a, b) _mm512_div_ps(a, b)
#define V_MAX(a, b) _mm512_max_ps(a, b)
#define V_FMADD(a, b, c) _mm512_fmadd_ps(a, b, c)
#define V_EXP(x) tandem_exp512(x)
#define V_TRANSPOSE(r) tandem_transpose16(r)
#define V_LOAD_F32 tandem_load16_f32
#define V_LOAD_BF16 tandem_load16_bf16

/* x, or 0 where x is -inf (a row no key reached yet: exp(s - 0) of its -inf scores is 0) */
static inline vec v_zero_neg_inf(vec x) {
    const __mmask16 none = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
    return _mm512_mask_blend_ps(none, x, _mm512_setzero_ps());
}

/* s where the row at position pos[i] sees ``key`` (pos >= key, and with a window
 * pos < past, past = key + window), else -inf */
static inline vec v_mask_key(vec s, const int32_t *pos, int32_t key, int32_t past, int window) {
    const __m512i p = _mm512_loadu_si512(pos);
    __mmask16 ok = _mm512_cmpge_epi32_mask(p, _mm512_set1_epi32(key));
    if (window) ok &= _mm512_cmplt_epi32_mask(p, _mm512_set1_epi32(past));
    return _mm512_mask_blend_ps(ok, _mm512_set1_ps(-INFINITY), s);
}

#elif defined(__AVX2__) && defined(__FMA__)
#include "transpose8.h"
#include "vexp256.h"

#define VL 8
#define MV_MAX 2
typedef __m256 vec;
#define V_LOAD(p) _mm256_loadu_ps(p)
#define V_STORE(p, v) _mm256_storeu_ps(p, v)
#define V_SET1(x) _mm256_set1_ps(x)
#define V_ZERO() _mm256_setzero_ps()
#define V_ADD(a, b) _mm256_add_ps(a, b)
#define V_SUB(a, b) _mm256_sub_ps(a, b)
#define V_MUL(a, b) _mm256_mul_ps(a, b)
#define V_DIV(a, b) _mm256_div_ps(a, b)
#define V_MAX(a, b) _mm256_max_ps(a, b)
#define V_FMADD(a, b, c) _mm256_fmadd_ps(a, b, c)
#define V_EXP(x) tandem_exp256(x)
#define V_TRANSPOSE(r) tandem_transpose8(r)
#define V_LOAD_F32 tandem_load8_f32
#define V_LOAD_BF16 tandem_load8_bf16

static inline vec v_zero_neg_inf(vec x) {
    const __m256 none = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
    return _mm256_andnot_ps(none, x);
}

static inline vec v_mask_key(vec s, const int32_t *pos, int32_t key, int32_t past, int window) {
    const __m256i p = _mm256_loadu_si256((const __m256i *)pos);
    __m256i ok = _mm256_cmpgt_epi32(p, _mm256_set1_epi32(key - 1));  /* key >= 0 */
    if (window) ok = _mm256_and_si256(ok, _mm256_cmpgt_epi32(_mm256_set1_epi32(past), p));
    return _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, _mm256_castsi256_ps(ok));
}
#endif
#endif
