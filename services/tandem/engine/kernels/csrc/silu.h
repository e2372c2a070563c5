/* SiLU(g) * u of one element, in plain float arithmetic (vexp.h's exp): loops that call it
 * vectorize, and every kernel that applies it rounds alike. */
#ifndef TANDEM_SILU_H
#define TANDEM_SILU_H
#include "vexp.h"

static inline float tandem_silu_mul1(float g, float u) { return g / (1.f + tandem_expf(-g)) * u; }
#endif
