/* OpenMP team sizes: no more threads than independent pieces of work, so a
 * one-row step does not wait at a barrier for a thread that had nothing to do
 * (and may not even be scheduled on a busy machine). */
#ifndef TANDEM_TEAM_H
#define TANDEM_TEAM_H
#include <omp.h>
#include <stdint.h>

static inline int tandem_team(int64_t pieces) {
    const int max = omp_get_max_threads();
    return pieces < 1 ? 1 : pieces < max ? (int)pieces : max;
}
#endif
