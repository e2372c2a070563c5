/* A decode step through every decoder layer in one call, from its token ids.
 *
 * At small batches a step's products are bound by reading the weights; between them
 * a Python forward spends time on every layer dispatching small ops, a large share of a
 * small model's step whatever the batch (services/RESULTS.md). This chains the same
 * kernels the Python path calls, in the same order and with the same roundings, so
 * every output bit is the same:
 *
 *   x = the token ids' rows of the embedding table (widened from bf16)
 *   per layer: x += delta; h = RMSNorm(x)            (tandem_add_rms_norm_f32)
 *              qkv = h @ Wqkv.T + b                  (tandem_packed_linear_f32, tandem_gemv_*,
 *                                                     tandem_amx_linear, tandem_bf16_*_linear
 *                                                     or tandem_int8_linear_f32)
 *              RoPE on q, k; k, v into the cache     (tandem_rope_f32; a copy, or bf16 RNE)
 *              a = paged attention of q              (tandem_paged_decode_*)
 *              x += a @ Wo.T + b; h = RMSNorm(x)     (the same product, tandem_add_rms_norm_f32)
 *              delta = silu·mul(h @ Wgu.T + b) @ Wd.T + b (on AMX weights one call,
 *                                                     tandem_amx_mlp: the same values)
 *   then       x += delta; out = RMSNorm(x)
 *
 * With bf16 weights each product's input and output are rounded to bf16 (and widened),
 * as CpuLinear rounds them (on the GEMV here; the AMX and AVX-512 bf16 kernels round them
 * themselves). Supports the layers the Python path has: biases on any
 * projection, GQA, a sliding window; not q/k norms (the caller keeps those in Python).
 *
 *   ids       [M] int64 token ids; embed [vocab, hidden] fp32 or bf16 (the stack's table),
 *             or a tied head's packed weight: [ceil(vocab / 32), hidden, 32] fp32
 *             (TANDEM_TABLE_PACKED) or bf16 in 16 x 32 blocks (TANDEM_TABLE_AMX, see amx_linear.c;
 *             with either bf16 kernel)
 *   x         [M, hidden] fp32 scratch (the residual stream), out [M, hidden] fp32
 *   positions [M] int64 (RoPE), slots [M] int64 (cache slot of each row's K/V)
 *   token_rows, last_pos [M] int64, block_table [M, table_stride] int64: the decode group
 *   kv        [layers, 2, num_blocks, block_size, KVH, D] fp32 or bf16 contiguous
 * Returns 0; -1 when a scratch buffer cannot be allocated or a product's kernel fails
 * (nothing written then, or the step's KV partly), -2 when M is out of range (nothing done): 1 .. TANDEM_GEMV_MAX_ROWS
 * on plain weights, any M >= 1 on packed, AMX, AVX-512 bf16 and int8 ones; -3 when a token id is not in the table, a
 * token row not in 0 .. M - 1, a slot or a block a row reads not in the cache (nothing done).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "kv_load.h"

/* How the projections' weights are stored (``weights``): plain [out, in] fp32 or bf16
 * (the GEMV), packed fp32 (packed_linear.c), bf16 packed for AMX (amx_linear.c), int8
 * packed as fp32 is with one fp32 scale per output (int8_linear.c), or bf16 packed as
 * for AMX, run on vdpbf16ps or on FMAs over the widened weights (bf16_avx512_linear.c). */
enum { TANDEM_WEIGHTS_F32, TANDEM_WEIGHTS_BF16, TANDEM_WEIGHTS_PACKED, TANDEM_WEIGHTS_AMX,
       TANDEM_WEIGHTS_INT8, TANDEM_WEIGHTS_BF16_DOT, TANDEM_WEIGHTS_BF16_FMA };
/* How the embedding table is stored (``table``): plain fp32 or bf16, or a tied head's packed weight. */
enum { TANDEM_TABLE_F32, TANDEM_TABLE_BF16, TANDEM_TABLE_PACKED, TANDEM_TABLE_AMX };

/* One decoder layer's parameters: weights as the stack's ``weights`` says, fp32 biases or
 * NULL, fp32 per-output scales of int8 weights (NULL otherwise). */
typedef struct {
    const float *input_norm, *post_norm;
    const void *qkv, *o, *gate_up, *down;
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias;
    const float *qkv_scale, *o_scale, *gate_up_scale, *down_scale;
} tandem_layer;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, inter, block_size, window, vocab;
    float eps, scale;
    int32_t weights, table, kv_bf16; /* TANDEM_WEIGHTS_*, TANDEM_TABLE_*, the cache's dtype */
    const void *embed;               /* laid out as ``table`` says */
    const float *cos, *sin; /* [positions, D] */
    const float *final_norm;
    const tandem_layer *layers;
} tandem_stack;

static inline float round_trip_bf16(float f) {
    const uint16_t b = tandem_round_bf16(f);
    return tandem_load_bf16(&b);
}

/* y [m, n] = x [m, k] @ w.T + bias (int8: (x @ w.T) * scale + bias), rounded as CpuLinear
 * rounds it; tmp holds m * k. On plain weights m is in the GEMV's range (checked on
 * entry), so it cannot refuse it. Returns 0, or -1 when a bf16 kernel could not allocate
 * its bf16 input. */
static int linear(const tandem_stack *s, const float *x, int64_t m, int64_t k, const void *w,
                  const float *bias, const float *scale, float *y, int64_t n, float *tmp) {
    switch (s->weights) {
        case TANDEM_WEIGHTS_INT8:
            tandem_int8_linear_f32(x, (const int8_t *)w, scale, bias, y, m, n, k);
            return 0;
        case TANDEM_WEIGHTS_AMX:
            return tandem_amx_linear(x, m, k, (const uint16_t *)w, n, bias, y, 1) == 0 ? 0 : -1;
        case TANDEM_WEIGHTS_BF16_DOT:
            return tandem_bf16_dot_linear(x, m, k, (const uint16_t *)w, n, bias, y, 1) == 0 ? 0 : -1;
        case TANDEM_WEIGHTS_BF16_FMA:
            return tandem_bf16_fma_linear(x, m, k, (const uint16_t *)w, n, bias, y, 1) == 0 ? 0 : -1;
        case TANDEM_WEIGHTS_PACKED:
            tandem_packed_linear_f32(x, (const float *)w, bias, y, m, n, k);
            return 0;
        case TANDEM_WEIGHTS_F32:
            tandem_gemv_f32(x, (const float *)w, bias, y, m, n, k);
            return 0;
    }
    for (int64_t i = 0; i < m * k; ++i) tmp[i] = round_trip_bf16(x[i]);
    tandem_gemv_bf16(tmp, (const uint16_t *)w, bias, y, m, n, k);
    for (int64_t i = 0; i < m * n; ++i) y[i] = round_trip_bf16(y[i]);
    return 0;
}

int tandem_decode_stack(const tandem_stack *s, const int64_t *ids, float *x, float *out, int64_t m,
                        const int64_t *positions, const int64_t *slots,
                        const int64_t *token_rows, const int64_t *last_pos,
                        const int64_t *block_table, int64_t table_stride, void *kv,
                        int64_t num_blocks, int64_t head_splits) {
    const int gemv = s->weights == TANDEM_WEIGHTS_F32 || s->weights == TANDEM_WEIGHTS_BF16;
    if (m < 1 || (gemv && m > TANDEM_GEMV_MAX_ROWS)) return -2;
    for (int64_t r = 0; r < m; ++r) {
        if (ids[r] < 0 || ids[r] >= s->vocab || token_rows[r] < 0 || token_rows[r] >= m || slots[r] < 0
                || slots[r] >= num_blocks * s->block_size || last_pos[r] < 0)
            return -3;
        for (int64_t b = 0; b <= last_pos[r] / s->block_size; ++b) { /* the blocks it reads */
            const int64_t block = b < table_stride ? block_table[r * table_stride + b] : -1;
            if (block < 0 || block >= num_blocks) return -3;
        }
    }
    const int64_t hidden = s->hidden, d = s->head_dim;
    for (int64_t r = 0; r < m; ++r) {
        if (s->table == TANDEM_TABLE_BF16) {
            const uint16_t *row = (const uint16_t *)s->embed + ids[r] * hidden;
            for (int64_t i = 0; i < hidden; ++i) x[r * hidden + i] = tandem_load_bf16(row + i);
        } else if (s->table == TANDEM_TABLE_AMX) {  /* output ids[r] % 16 of block ids[r] / 16: a pair every 64 bytes */
            const uint16_t *block = (const uint16_t *)s->embed + ids[r] / 16 * ((hidden + 31) / 32) * 512
                                    + ids[r] % 16 * 2;
            for (int64_t i = 0; i < hidden; ++i)
                x[r * hidden + i] = tandem_load_bf16(block + i / 32 * 512 + i % 32 / 2 * 32 + i % 2);
        } else if (s->table == TANDEM_TABLE_PACKED) {  /* column ids[r] % 32 of panel ids[r] / 32 */
            const float *col = (const float *)s->embed + ids[r] / TANDEM_PACK_WIDTH * hidden * TANDEM_PACK_WIDTH
                               + ids[r] % TANDEM_PACK_WIDTH;
            for (int64_t i = 0; i < hidden; ++i) x[r * hidden + i] = col[i * TANDEM_PACK_WIDTH];
        } else {
            memcpy(x + r * hidden, (const float *)s->embed + ids[r] * hidden, (size_t)hidden * sizeof(float));
        }
    }
    const int64_t q_size = s->heads * d, kv_size = s->kv_heads * d;
    const int64_t qkv_width = q_size + 2 * kv_size, inter = s->inter;
    /* on AMX weights the MLP is one call: no gate|up product or activation written out */
    const int mlp_in_one = s->weights == TANDEM_WEIGHTS_AMX && tandem_amx_fuses_gate_up(inter);
    const int64_t gu_width = mlp_in_one ? 0 : 2 * inter, act_width = mlp_in_one ? 0 : inter;
    /* the bf16 GEMV's rounded input, as wide as the widest input it rounds */
    const int64_t tmp_width = s->weights != TANDEM_WEIGHTS_BF16 ? 0
                              : hidden > q_size ? (hidden > inter ? hidden : inter)
                                                : (q_size > inter ? q_size : inter);
    /* h | qkv | attn | o | delta | gate_up | act | rounded input */
    const int64_t per_row = hidden + qkv_width + q_size + 2 * hidden + gu_width + act_width + tmp_width;
    float *buf = malloc((size_t)(m * per_row) * sizeof(float));
    if (buf == NULL) return -1;
    float *h = buf, *qkv = h + m * hidden, *attn = qkv + m * qkv_width, *o = attn + m * q_size;
    float *delta = o + m * hidden, *gu = delta + m * hidden, *act = gu + m * gu_width;
    float *tmp = act + m * act_width;
    const size_t elem = s->kv_bf16 ? sizeof(uint16_t) : sizeof(float);
    const int64_t cache_elems = num_blocks * s->block_size * kv_size; /* one K or V of a layer */
    int rc = 0;
    for (int64_t l = 0; l < s->num_layers; ++l) {
        const tandem_layer *L = &s->layers[l];
        char *k_cache = (char *)kv + (size_t)(2 * l) * (size_t)cache_elems * elem;
        char *v_cache = k_cache + (size_t)cache_elems * elem;
        tandem_add_rms_norm_f32(x, l == 0 ? NULL : delta, h, L->input_norm, m, hidden, s->eps);
        if ((rc = linear(s, h, m, hidden, L->qkv, L->qkv_bias, L->qkv_scale, qkv, qkv_width, tmp)) != 0) break;
        tandem_rope_f32(qkv, qkv_width, s->heads, qkv + q_size, qkv_width, s->kv_heads, s->cos,
                        s->sin, positions, m, d);
        for (int64_t r = 0; r < m; ++r) {
            tandem_store_kv_row(k_cache, s->kv_bf16, slots[r], qkv + r * qkv_width + q_size, kv_size);
            tandem_store_kv_row(v_cache, s->kv_bf16, slots[r], qkv + r * qkv_width + q_size + kv_size,
                                kv_size);
        }
        rc = s->kv_bf16
                  ? tandem_paged_decode_bf16(qkv, qkv_width, attn, token_rows,
                                             (const uint16_t *)k_cache, (const uint16_t *)v_cache,
                                             block_table, table_stride, last_pos, m, s->heads,
                                             s->kv_heads, d, s->block_size, s->window, s->scale,
                                             head_splits)
                  : tandem_paged_decode_f32(qkv, qkv_width, attn, token_rows,
                                            (const float *)k_cache, (const float *)v_cache,
                                            block_table, table_stride, last_pos, m, s->heads,
                                            s->kv_heads, d, s->block_size, s->window, s->scale,
                                            head_splits);
        if (rc != 0) break; /* its scratch could not be allocated */
        if ((rc = linear(s, attn, m, q_size, L->o, L->o_bias, L->o_scale, o, hidden, tmp)) != 0) break;
        tandem_add_rms_norm_f32(x, o, h, L->post_norm, m, hidden, s->eps);
        if (mlp_in_one) {
            if ((rc = tandem_amx_mlp(h, m, hidden, (const uint16_t *)L->gate_up, inter,
                                     L->gate_up_bias, (const uint16_t *)L->down, hidden,
                                     L->down_bias, delta) == 0 ? 0 : -1) != 0) break;
        } else {
            if ((rc = linear(s, h, m, hidden, L->gate_up, L->gate_up_bias, L->gate_up_scale, gu,
                             2 * inter, tmp)) != 0) break;
            tandem_silu_mul_f32(gu, act, m, inter);
            if ((rc = linear(s, act, m, inter, L->down, L->down_bias, L->down_scale, delta, hidden,
                             tmp)) != 0) break;
        }
    }
    if (rc == 0)
        tandem_add_rms_norm_f32(x, s->num_layers ? delta : NULL, out, s->final_norm, m, hidden, s->eps);
    free(buf);
    return rc == 0 ? 0 : -1;
}
