/* The kernels one file calls from another (decode_stack.c chains them): their
 * signatures, checked against the definitions where those include this header. */
#ifndef TANDEM_KERNELS_H
#define TANDEM_KERNELS_H
#include <stdint.h>

#define TANDEM_GEMV_MAX_ROWS 16 /* input rows the GEMV (and so the decode stack) takes */
#define TANDEM_PACK_WIDTH 32    /* output channels per panel of a packed weight */

/* fused_ops.c */
void tandem_add_rms_norm_f32(float *x, const float *delta, float *out, const float *w,
                             int64_t rows, int64_t dim, float eps);
int tandem_store_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride,
                    int64_t rows, int64_t width, const int64_t *slots, int64_t num_slots,
                    void *k_cache, void *v_cache, int bf16);
void tandem_rope_f32(float *q, int64_t q_stride, int64_t nq, float *k, int64_t k_stride,
                     int64_t nk, const float *cos_t, const float *sin_t,
                     const int64_t *positions, int64_t rows, int64_t head_dim);
void tandem_silu_mul_f32(const float *gu, float *out, int64_t rows, int64_t inter);
void tandem_silu_mul_bf16(const uint16_t *gu, uint16_t *out, int64_t rows, int64_t inter);

/* gemv.c */
int tandem_gemv_f32(const float *x, const float *w, const float *bias, float *y, int64_t m_rows,
                    int64_t n_out, int64_t k_in);
int tandem_gemv_bf16(const float *x, const uint16_t *w, const float *bias, float *y,
                     int64_t m_rows, int64_t n_out, int64_t k_in);

/* int8_linear.c: int8 weights packed like packed_linear.c's, in int8 */
void tandem_pack_int8(const int8_t *w, int8_t *packed, int64_t n_out, int64_t k_in);
void tandem_int8_linear_f32(const float *x, const int8_t *packed, const float *scale,
                            const float *bias, float *y, int64_t m_rows, int64_t n_out,
                            int64_t k_in);

/* amx_linear.c (returns -2 where the CPU or the process has no AMX tiles) */
int tandem_amx_linear(const float *x, int64_t M, int64_t K, const uint16_t *wp, int64_t N,
                      const float *bias, float *out, int round_output);
int tandem_amx_fuses_gate_up(int64_t inter);
int tandem_amx_gate_up_silu(const float *x, int64_t M, int64_t K, const uint16_t *wp,
                            int64_t inter, const float *bias, float *out);
int tandem_amx_mlp(const float *x, int64_t M, int64_t K, const uint16_t *wgu, int64_t inter,
                   const float *bgu, const uint16_t *wd, int64_t N, const float *bd, float *out);

/* bf16_avx512_linear.c: tandem_amx_linear's product on the same packed weight, on
 * vdpbf16ps or on FMAs over the widened weights (return -2 where the build has no
 * AVX-512 BF16) */
int tandem_bf16_dot_linear(const float *x, int64_t M, int64_t K, const uint16_t *wp, int64_t N,
                           const float *bias, float *y, int round_output);
int tandem_bf16_fma_linear(const float *x, int64_t M, int64_t K, const uint16_t *wp, int64_t N,
                           const float *bias, float *y, int round_output);

/* packed_linear.c */
void tandem_pack_linear_f32(const float *w, float *packed, int64_t n_out, int64_t k_in);
void tandem_packed_linear_f32(const float *x, const float *packed, const float *bias, float *y,
                              int64_t m_rows, int64_t n_out, int64_t k_in);
void tandem_packed_gate_up_silu_f32(const float *x, const float *packed, const float *bias, float *out,
                                    int64_t m_rows, int64_t inter, int64_t k_in);

/* paged_decode.c */
int tandem_paged_decode_f32(const float *q, int64_t q_stride, float *out, const int64_t *rows,
                            const float *k_cache, const float *v_cache, const int64_t *block_table,
                            int64_t table_stride, const int64_t *positions, int64_t num_rows,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                            int64_t block_size, int64_t window, float scale, int64_t head_splits);
int tandem_paged_decode_bf16(const float *q, int64_t q_stride, float *out, const int64_t *rows,
                             const uint16_t *k_cache, const uint16_t *v_cache,
                             const int64_t *block_table, int64_t table_stride,
                             const int64_t *positions, int64_t num_rows, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                             int64_t window, float scale, int64_t head_splits);
#endif
