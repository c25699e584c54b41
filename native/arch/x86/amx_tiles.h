/*
 * AMX's tile configuration as ldtilecfg / sttilecfg read and write it (64 bytes: palette, start row,
 * then each of 16 tiles' bytes per row and rows), shared by the amx-bf16 family
 * (kernels_tiles.c) and its peak's step (peak.c).
 */
#ifndef BS_AMX_TILES_H
#define BS_AMX_TILES_H

#include <stdint.h>

typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) bs_tile_cfg;

#endif
