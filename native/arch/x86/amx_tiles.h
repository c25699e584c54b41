/*
 * AMX's tile configuration as ldtilecfg / sttilecfg read and write it (64 bytes: palette, start row,
 * then each of 16 tiles' bytes per row and rows), shared by the amx-bf16 family
 * (kernels_tiles.c) and its peak's step (peak.c); and the tile loads and stores both use.
 */
#ifndef BS_AMX_TILES_H
#define BS_AMX_TILES_H

#include <stdint.h>
#include <string.h>

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) bs_tile_cfg;

/* the configuration both use: palette 1, tiles 0-7 of 16 rows x 64 bytes, the others unused */
static inline void bs_tile_cfg_8x16x64(bs_tile_cfg * cfg) {
    memset(cfg, 0, sizeof(*cfg));
    cfg->palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg->rows[t] = 16;
        cfg->colsb[t] = 64;
    }
}

/* tile dst = 16 rows of `stride` bytes from base, and back: GCC's _tile_loadd / _tile_stored pass the
 * stride as a `long`, 32 bits on Windows (LLP64), which the assembler then refuses as an index
 * register; these pass it as 64 bits on every system (and tell the compiler they touch memory) */
#define BS_TILE_LOADD(dst, base, stride)                                                                            \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #dst ::"r"((const void *)(base)), "r"((long long)(stride)) : "memory")
#define BS_TILE_STORED(dst, base, stride)                                                                           \
    __asm__ volatile("tilestored %%tmm" #dst ", (%0,%1,1)" ::"r"((void *)(base)), "r"((long long)(stride)) : "memory")

#endif
