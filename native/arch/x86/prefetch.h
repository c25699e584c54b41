/*
 * Software prefetch of the weights the x86 integer families read next (vnni-int24, avx2-int16,
 * avxvnni-int16): each row's blocks are decoded one after another, and at small batches the
 * hardware prefetchers start too late (measured on a 2-core Zen 4: three quarters of the decode's
 * samples on the first load of each block, waiting on memory). A kernel asks for the bytes
 * BS_PF_AHEAD past the block it is about to decode, never past the end of its rows.
 */
#ifndef BS_X86_PREFETCH_H
#define BS_X86_PREFETCH_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#define BS_PF_AHEAD 1024 /* bytes of a row read ahead of the block being decoded */

/* the cache lines of [p + BS_PF_AHEAD, p + BS_PF_AHEAD + n) below end, into L1 */
static inline __attribute__((always_inline)) void bs_prefetch_ahead(const uint8_t * p, size_t n, const uint8_t * end) {
    for (size_t o = 0; o < n; o += 64) {
        if (p + BS_PF_AHEAD + o < end) _mm_prefetch((const char *)(p + BS_PF_AHEAD + o), _MM_HINT_T0);
    }
}

#endif
