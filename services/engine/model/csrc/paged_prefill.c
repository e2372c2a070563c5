/* Causal paged attention for prefill chunks on CPU, reading K/V blocks in place
 * (fp32 or bf16 cache; queries, scores and outputs fp32).
 *
 * Sequence s has num_queries[s] query rows at flat token rows
 * first_row[s] + i and positions start_pos[s] + i; query i attends the keys at
 * positions [max(0, p - window + 1), p] through the sequence's block table
 * (its earlier chunks' keys included). Work is split over OpenMP threads as
 * (sequence, tile of TILE query rows, kv head) tasks, so one long prompt uses
 * every thread. A task walks the blocks once with an online softmax: each
 * block's keys are transposed into a [D, block] scratch so the scores of a
 * query against the block are one vector loop, and each V row is read once
 * per query row.
 *
 * Shapes (row-major):
 *   q            [T, H, D], rows q_stride apart; heads dense
 *   out          [T, H, D] contiguous
 *   k/v_cache    [num_blocks, block_size, KVH, D] contiguous
 *   block_table  [S, table_stride] int64
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_load.h"
#include "team.h"
#include "vexp.h"

#define TILE 32 /* query rows per task */
#define KC 16   /* keys per chunk: one vector of scores per query row */
#define RB 4    /* query rows scored together */

#define NAME tandem_paged_prefill_f32
#define KV_T float
#define KV_LOAD tandem_load_f32
#include "paged_prefill_impl.h"
#undef NAME
#undef KV_T
#undef KV_LOAD

#define NAME tandem_paged_prefill_bf16
#define KV_T uint16_t
#define KV_LOAD tandem_load_bf16
#include "paged_prefill_impl.h"
