/* The work list of the prompt attention kernels: one task per (sequence, kv head, tile of
 * QT positions), biggest first (the keys it attends), so a dynamic schedule ends evenly. */
#ifndef TANDEM_PREFILL_TASKS_H
#define TANDEM_PREFILL_TASKS_H
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    int64_t seq, kv_head, first, count;  /* query rows first .. first + count - 1 of seq */
    int64_t keys;                        /* keys it attends (sort key: biggest first) */
} tandem_prefill_task;

static int tandem_prefill_task_order(const void *a, const void *b) {
    const int64_t ka = ((const tandem_prefill_task *)a)->keys;
    const int64_t kb = ((const tandem_prefill_task *)b)->keys;
    return (ka < kb) - (ka > kb);
}

/* The sorted tasks (malloc'd; NULL when out of memory), their number in *num_tasks.
 * Sequence b's queries are at positions pos0[b] .. pos0[b] + num_queries[b] - 1; a query
 * at p attends keys max(0, p - window + 1) .. p (window 0: 0 .. p). */
static tandem_prefill_task *tandem_prefill_tasks(const int64_t *pos0, const int64_t *num_queries,
                                                 int64_t num_seqs, int64_t num_kv_heads,
                                                 int64_t QT, int64_t window, int64_t *num_tasks) {
    int64_t n = 0;
    for (int64_t b = 0; b < num_seqs; ++b) n += num_kv_heads * ((num_queries[b] + QT - 1) / QT);
    tandem_prefill_task *tasks = malloc(sizeof(tandem_prefill_task) * (n > 0 ? n : 1));
    *num_tasks = n;
    if (tasks == NULL) return NULL;
    n = 0;
    for (int64_t b = 0; b < num_seqs; ++b)
        for (int64_t first = 0; first < num_queries[b]; first += QT)
            for (int64_t kh = 0; kh < num_kv_heads; ++kh) {
                const int64_t count = num_queries[b] - first < QT ? num_queries[b] - first : QT;
                const int64_t last = pos0[b] + first + count - 1, p = pos0[b] + first;
                const int64_t lo = (window > 0 && p - window + 1 > 0) ? p - window + 1 : 0;
                tasks[n++] = (tandem_prefill_task){b, kh, first, count, last - lo + 1};
            }
    qsort(tasks, (size_t)n, sizeof *tasks, tandem_prefill_task_order);
    return tasks;
}
#endif
