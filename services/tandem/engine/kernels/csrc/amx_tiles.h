/* The AMX tile state: asked of Linux once per process, one configuration (every tile 16
 * rows x 64 bytes) per thread. Included only where the compiler targets AMX-BF16; the
 * kernels built on it are amx_linear.c and paged_prefill_amx.c. */
#ifndef TANDEM_AMX_TILES_H
#define TANDEM_AMX_TILES_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tandem_tile_config;

/* Linux hands out the tile state only on request, once per process (syscall() needs
 * _GNU_SOURCE before the first include). */
static int tandem_amx_permitted(void) {
    static int state;  /* 0 unknown, 1 granted, -1 refused */
    if (state == 0)
        state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}

static void tandem_amx_configure(void) {  /* every tile 16 rows x 64 bytes */
    tandem_tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}
#endif
