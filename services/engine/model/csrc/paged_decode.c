/* Paged attention for decode rows on CPU, reading K/V blocks in place
 * (fp32 or bf16 cache; queries, scores and outputs fp32).
 *
 * One query token per row; row r attends the keys at positions
 * [max(0, pos[r] - window + 1), pos[r]] of its sequence, found through its
 * block table. Work is split over (row, kv head) pairs with OpenMP; each pair
 * scores its G = H / KVH query heads against every key once (two passes:
 * scores, then softmax-weighted V), so each K and V vector is read once.
 *
 * Shapes (all contiguous, row-major):
 *   q            [T, H, D], rows q_stride apart (row r reads token row rows[r])
 *   out          [T, H, D] contiguous (row r writes token row rows[r])
 *   k/v_cache    [num_blocks, block_size, KVH, D]
 *   block_table  [R, table_stride] int64
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels.h"
#include "kv_load.h"
#include "team.h"
#include "vexp.h"

#define NAME tandem_paged_decode_f32
#define KV_T float
#define KV_LOAD tandem_load_f32
#define KV_LOAD16 tandem_load16_f32
#include "paged_decode_impl.h"
#undef NAME
#undef KV_T
#undef KV_LOAD
#undef KV_LOAD16

#define NAME tandem_paged_decode_bf16
#define KV_T uint16_t
#define KV_LOAD tandem_load_bf16
#define KV_LOAD16 tandem_load16_bf16
#include "paged_decode_impl.h"
