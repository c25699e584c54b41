/*
 * IQ2_XXS and IQ2_XS (split --base iq2_xxs|iq2_s), for the families that decode them with SIMD:
 * each 8 values are one entry of a grid of 8-byte magnitudes, with a 7-bit index into a table of 8
 * signs, and one 4-bit scale per 32 (IQ2_XXS) or 16 (IQ2_XS) values:
 * w = d * (0.5 + s) * 0.25 * grid[j] * sign[j].
 *
 * The grids and the sign table are not copied from ggml: they are read once from ggml's own
 * dequantizer (blocks that hold each index in turn, unit scale). A family's decoder is then checked
 * against ggml bit for bit on blocks of pseudo-random codes of each type (bs_iq_decoder_agrees);
 * if anything is off (another ggml, another block layout), these types keep going through ggml's
 * dequantizer in that family.
 *
 * IQ3_S (the quarter of llama.cpp's IQ2_S mix that is not IQ2_XS) likewise: a grid of 512 entries
 * of 4 magnitudes, 8 entries per 32 values (an 8-bit index in qs plus a ninth bit in qh), one sign
 * bit per value, one 4-bit scale s per 32 values: w = d * (1 + 2 s) * grid[j] * sign[j].
 *
 * IQ1_M (split --base iq1_m) likewise: a grid of 2,048 entries of 8 values in {-1, 0, 1}
 * (bs_internal.h has the block's layout).
 */
#include <stdlib.h>
#include <string.h>

#include "bs_internal.h"
#include "ggml.h"

static bs_iq_tables tables;
static bs_once tables_once = BS_ONCE_INIT;

/* the magnitudes of n grid entries, index i at code slot i of unit-scale blocks (8 codes per 32
 * values), read back from ggml's dequantizer */
static bool read_grid(enum ggml_type type, uint64_t * grid, int n) {
    const int xs = type == GGML_TYPE_IQ2_XS, bb = xs ? BS_IQ2XS_BYTES : BS_IQ2XXS_BYTES, nblk = n / 32;
    uint8_t * blk = calloc((size_t)nblk, (size_t)bb);
    float * y = malloc((size_t)nblk * 256 * sizeof(float));
    bool ok = blk != NULL && y != NULL;
    for (int k = 0; ok && k < nblk; k++) {
        uint8_t * p = blk + (size_t)k * bb;
        const uint16_t one = 0x3C00; /* fp16 1.0: values are grid / 8 */
        memcpy(p, &one, 2);
        for (int slot = 0; slot < 32; slot++) {
            const int idx = 32 * k + slot, ib = slot / 4, l = slot % 4;
            if (xs) {
                const uint16_t q = (uint16_t)idx; /* sign index 0 */
                memcpy(p + 2 + 8 * ib + 2 * l, &q, 2);
            } else {
                p[2 + 8 * ib + l] = (uint8_t)idx; /* the second word (signs, scale) stays 0 */
            }
        }
    }
    if (ok) ggml_get_type_traits(type)->to_float(blk, y, (int64_t)nblk * 256);
    for (int i = 0; ok && i < n; i++) {
        uint64_t g = 0;
        for (int t = 0; t < 8; t++) {
            const float v = y[8 * i + t] * 8.0f;
            if (!(v >= 1.0f && v <= 255.0f) || v != (float)(int)v) ok = false;
            else g |= (uint64_t)(int)v << (8 * t);
        }
        grid[i] = g;
    }
    free(blk);
    free(y);
    return ok;
}

static void read_iq2(void) {
    const struct ggml_type_traits * a = ggml_get_type_traits(GGML_TYPE_IQ2_XXS);
    const struct ggml_type_traits * b = ggml_get_type_traits(GGML_TYPE_IQ2_XS);
    if (a == NULL || a->to_float == NULL || a->blck_size != 256 || a->type_size != BS_IQ2XXS_BYTES || b == NULL ||
        b->to_float == NULL || b->blck_size != 256 || b->type_size != BS_IQ2XS_BYTES ||
        !read_grid(GGML_TYPE_IQ2_XXS, tables.xxs_grid, 256) || !read_grid(GGML_TYPE_IQ2_XS, tables.xs_grid, 512)) {
        return;
    }
    /* signs: index s at slot s of IQ2_XXS blocks whose grid entry is 0 (no zero magnitudes) */
    uint8_t blk[4 * BS_IQ2XXS_BYTES];
    float y[4 * 256];
    memset(blk, 0, sizeof blk);
    for (int k = 0; k < 4; k++) {
        const uint16_t one = 0x3C00;
        memcpy(blk + k * BS_IQ2XXS_BYTES, &one, 2);
        for (int ib = 0; ib < 8; ib++) {
            uint32_t w = 0;
            for (int l = 0; l < 4; l++) w |= (uint32_t)(32 * k + 4 * ib + l) << (7 * l);
            memcpy(blk + k * BS_IQ2XXS_BYTES + 2 + 8 * ib + 4, &w, 4);
        }
    }
    a->to_float(blk, y, 4 * 256);
    for (int s = 0; s < 128; s++) {
        uint8_t m = 0;
        for (int t = 0; t < 8; t++) m |= (uint8_t)((y[8 * s + t] < 0) << t);
        tables.signs[s] = m;
    }
    tables.iq2_ok = true;
}

/* the 512 entries of IQ3_S's grid: entry e at slot e % 64 of block e / 64 (unit scale, no signs) */
static void read_iq3s(void) {
    const struct ggml_type_traits * tr = ggml_get_type_traits(GGML_TYPE_IQ3_S);
    if (tr == NULL || tr->to_float == NULL || tr->blck_size != 256 || tr->type_size != BS_IQ3S_BYTES) {
        return;
    }
    enum { NBLK = 512 / 64 };
    uint8_t blk[NBLK * BS_IQ3S_BYTES];
    float y[NBLK * 256];
    memset(blk, 0, sizeof blk);
    for (int k = 0; k < NBLK; k++) {
        uint8_t * p = blk + k * BS_IQ3S_BYTES;
        const uint16_t one = 0x3C00; /* d = 1, scales 0: values are the grid's */
        memcpy(p, &one, 2);
        for (int slot = 0; slot < 64; slot++) { /* group slot / 8, entry slot % 8 */
            const int e = 64 * k + slot, g = slot / 8, j = slot % 8;
            p[2 + 8 * g + j] = (uint8_t)(e & 255);       /* qs */
            if (e & 256) p[2 + 64 + g] |= (uint8_t)(1u << j); /* qh: the ninth bit of entry j of group g */
        }
    }
    tr->to_float(blk, y, NBLK * 256);
    for (int e = 0; e < 512; e++) {
        uint32_t v = 0;
        for (int t = 0; t < 4; t++) {
            const float f = y[4 * e + t];
            if (!(f >= 1.0f && f <= 255.0f) || f != (float)(int)f) return;
            v |= (uint32_t)(int)f << (8 * t);
        }
        tables.iq3s_grid[e] = v;
    }
    tables.iq3s_ok = true;
}

/* the 2,048 entries of IQ1_M's grid: entry e at slot e % 32 of block e / 32 (d = 1, scales 0, so
 * dl = 1, and every delta +1/8: values are grid + 0.125) */
static void read_iq1m(void) {
    const struct ggml_type_traits * tr = ggml_get_type_traits(GGML_TYPE_IQ1_M);
    if (tr == NULL || tr->to_float == NULL || tr->blck_size != 256 || tr->type_size != BS_IQ1M_BYTES) {
        return;
    }
    enum { NBLK = 2048 / 32 };
    uint8_t * blk = calloc(NBLK, BS_IQ1M_BYTES);
    float * y = malloc(NBLK * 256 * sizeof(float));
    bool ok = blk != NULL && y != NULL;
    for (int k = 0; ok && k < NBLK; k++) {
        uint8_t * p = blk + k * BS_IQ1M_BYTES;
        p[53] = 0xC0, p[55] = 0x30; /* fp16 1.0 = 0x3C00: nibble 2 in scale word 2, nibble 3 in word 3 */
        for (int slot = 0; slot < 32; slot++) { /* group slot / 4, entry slot % 4 */
            const int e = 32 * k + slot, g = slot / 4, l = slot % 4;
            p[4 * g + l] = (uint8_t)(e & 255);                              /* qs */
            p[32 + 2 * g + l / 2] |= (uint8_t)((e >> 8) << (4 * (l % 2))); /* qh: 3 high bits */
        }
    }
    if (ok) tr->to_float(blk, y, (int64_t)NBLK * 256);
    for (int e = 0; ok && e < 2048; e++) {
        uint64_t v = 0;
        for (int t = 0; t < 8; t++) {
            const float g = y[8 * e + t] - 0.125f;
            if (g != -1.0f && g != 0.0f && g != 1.0f) ok = false;
            else v |= (uint64_t)(uint8_t)(128 + 8 * (int)g) << (8 * t);
        }
        tables.iq1m_grid[e] = v;
    }
    free(blk);
    free(y);
    tables.iq1m_ok = ok;
}

static void read_tables(void) {
    read_iq2();
    read_iq3s();
    read_iq1m();
}

const bs_iq_tables * bs_iq_get_tables(void) {
    bs_once_run(&tables_once, read_tables);
    return &tables;
}

bool bs_iq_decoder_agrees(enum ggml_type type, void (*decode)(enum ggml_type type, const uint8_t * block, float * out)) {
    const struct ggml_type_traits * tr = ggml_get_type_traits(type);
    uint8_t rb[BS_IQ3S_BYTES]; /* the largest of these blocks */
    if (tr == NULL || tr->to_float == NULL || tr->blck_size != 256 || tr->type_size > sizeof rb) {
        return false;
    }
    const int bb = (int)tr->type_size; /* the read_* functions checked it against the layouts above */
    float ref[256], got[256];
    uint32_t st = 0x9e3779b9u ^ (uint32_t)type;
    for (int rep = 0; rep < 4; rep++) {
        for (int i = 0; i < bb; i++) {
            st = st * 1664525u + 1013904223u;
            rb[i] = (uint8_t)(st >> 24);
        }
        static const uint16_t ds[4] = {0xB800, 0x2E66, 0x0400, 0x7BFF}; /* -0.5, 0.1, tiny, fp16 max */
        if (type == GGML_TYPE_IQ1_M) { /* d in the top nibbles of the four scale words */
            for (int k = 0; k < 4; k++) rb[49 + 2 * k] = (uint8_t)((rb[49 + 2 * k] & 0x0f) | (((ds[rep] >> (4 * k)) & 0xf) << 4));
        } else {
            memcpy(rb, &ds[rep], 2);
        }
        tr->to_float(rb, ref, 256);
        decode(type, rb, got);
        if (memcmp(got, ref, sizeof ref) != 0) {
            return false;
        }
    }
    return true;
}
