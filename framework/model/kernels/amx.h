/* AMX tile set-up shared by the kernels that use the tiles (packed_gemm.c, extend_attention.c,
 * decode_attention.c).
 * HAVE_AMX is 1 where the compiler targets AMX-BF16 (with AVX512-BF16 for the epilogues); then
 * amx_usable() asks Linux once for the tile state and amx_configure() gives the calling thread
 * eight tiles of 16 rows x 64 bytes. A thread calls _tile_release() when done with them. */
#ifndef BATCHYARD_KERNELS_AMX_H
#define BATCHYARD_KERNELS_AMX_H

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Linux lets a process use the AMX tiles once it has asked for their state (arch_prctl). */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_usable(void) {
    static int usable = -1;
    if (usable < 0) usable = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return usable;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

static inline void amx_configure(void) {
    TileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

#else
#define HAVE_AMX 0
#endif

#endif
