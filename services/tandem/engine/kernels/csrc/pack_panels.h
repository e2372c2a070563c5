/* The packed layout of packed_linear.c (fp32) and int8_linear.c (int8): a weight [N, K]
 * as panels of TANDEM_PACK_WIDTH output channels, K-major, [ceil(N / 32), K, 32], the
 * last panel zero-padded. TANDEM_PACK_PANELS(w, packed, n_out, k_in) copies ``w`` there
 * (any element type; panels split over OpenMP threads). */
#ifndef TANDEM_PACK_PANELS_H
#define TANDEM_PACK_PANELS_H
#include <stdint.h>

#include "kernels.h"
#include "team.h"

#define TANDEM_PACK_PANELS(w, packed, n_out, k_in)                                          \
    do {                                                                                    \
        const int64_t panels_ = ((n_out) + TANDEM_PACK_WIDTH - 1) / TANDEM_PACK_WIDTH;      \
        _Pragma("omp parallel for num_threads(tandem_team(panels_))")                       \
        for (int64_t j = 0; j < panels_; ++j)                                               \
            for (int64_t k = 0; k < (k_in); ++k)                                            \
                for (int64_t c = 0; c < TANDEM_PACK_WIDTH; ++c) {                           \
                    const int64_t n = j * TANDEM_PACK_WIDTH + c;                            \
                    (packed)[(j * (k_in) + k) * TANDEM_PACK_WIDTH + c] =                    \
                        n < (n_out) ? (w)[n * (k_in) + k] : 0;                              \
                }                                                                           \
    } while (0)
#endif
