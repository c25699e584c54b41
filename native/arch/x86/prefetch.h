/*
 * Software prefetch of the weights the x86 integer families read next (vnni-int24, avx2-int16,
 * avxvnni-int16): each row's blocks are decoded one after another, and at small batches the
 * hardware prefetchers start too late (measured on a 2-core Zen 4: three quarters of the decode's
 * samples on the first load of each block, waiting on memory). A kernel asks for the bytes
 * BS_PF_AHEAD (the int16 families' R . x alone below their tiles: BS_PF_AHEAD_ALONE; in tiles, from
 * 6-7 columns: BS_PF_TILE_NEAR into L1 and BS_PF_TILE_FAR into L2) past the block it is about to
 * decode, never past the end of its rows.
 */
#ifndef BS_X86_PREFETCH_H
#define BS_X86_PREFETCH_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#define BS_PF_AHEAD 1024 /* bytes of a row read ahead of the block being decoded */
/* The residual alone (add mode's R . x) at 1-6 columns, one stream of weights and less work per byte
 * than W2 + R: 2 KB ahead. Measured on a 2-core Zen 4 (python bench/native_ab.py, Qwen2.5-Coder-1.5B
 * q6_k split, --residual-only, medians of the per-round ratios, bit-identical): avx2-int16 time
 * 1.015 / 0.949 / 0.953 / 0.976 of 1 KB's at 1 column and 0.966 / 0.936 / 0.988 / 0.957 at 2 (four
 * runs of 15-31 rounds), 0.999 at 4; avx512vnni-int16 0.989 / 1.003 at 1 and 0.931 / 0.984 at 2 */
#define BS_PF_AHEAD_ALONE 2048

/* The residual alone in tiles (6+ columns): each unit of a tile's rows is applied to every column
 * before the next, so the lines BS_PF_AHEAD ahead waited in L1 while all columns' digits streamed
 * through it, and were evicted before their turn (measured on a 2-core Zen 4: with 1 KB ahead into
 * L1, a fifth of the time on the first load of each block's scales). The next block is asked into
 * L1 (BS_PF_TILE_NEAR ahead) and the rows further on into L2 alone (BS_PF_TILE_FAR, prefetcht1:
 * L2 on Intel and, by AMD's documentation, from Zen 4; earlier AMD cores fill L1 with it as with
 * prefetcht0, and a Zen 3 has not measured this distance). python
 * bench/native_ab.py OLD NEW qwen-q6k --residual-only --kernel avx512vnni-int16 --threads 1 --only
 * blk.1. (Qwen2.5-Coder-1.5B q6_k split, bit-identical), time against 1 KB into L1: 256 B alone
 * 0.862 / 0.985 at 16 / 64 columns, 512 B 0.937 / 0.991; 256 B and 2 KB into L2 0.834 / 0.919, and
 * against that 4 KB 0.981 / 0.961, 1 KB 1.032 / 1.021; 128 B or 384 B near 1.03 / 1.02 */
#define BS_PF_TILE_NEAR 256
#define BS_PF_TILE_FAR 4096

/* the cache lines of [p + ahead, p + ahead + n) below end, into L1 */
static inline __attribute__((always_inline)) void bs_prefetch_at(const uint8_t * p, size_t n, const uint8_t * end,
                                                                  size_t ahead) {
    for (size_t o = 0; o < n; o += 64) {
        if (p + ahead + o < end) _mm_prefetch((const char *)(p + ahead + o), _MM_HINT_T0);
    }
}

/* the cache lines of [p + BS_PF_AHEAD, p + BS_PF_AHEAD + n) below end, into L1 */
static inline __attribute__((always_inline)) void bs_prefetch_ahead(const uint8_t * p, size_t n, const uint8_t * end) {
    bs_prefetch_at(p, n, end, BS_PF_AHEAD);
}

/* the cache lines of [p + ahead, p + ahead + n) below end, into L2 (and not L1, where the CPU
 * honours prefetcht1's hint: above) */
static inline __attribute__((always_inline)) void bs_prefetch_l2_at(const uint8_t * p, size_t n, const uint8_t * end,
                                                                     size_t ahead) {
    for (size_t o = 0; o < n; o += 64) {
        if (p + ahead + o < end) _mm_prefetch((const char *)(p + ahead + o), _MM_HINT_T1);
    }
}

#endif
