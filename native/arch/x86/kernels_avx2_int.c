/*
 * The AVX2 integer family ("avx2-int16"): exact integer weights times 16-bit integer activations,
 * for the AVX2 CPUs without AVX-512 (Zen 2/3, Intel Haswell to 14th gen client) at the batch
 * sizes of decoding and verification, where avx2-f32 spends more instructions unpacking weights to
 * f32 than the memory takes to deliver them. This source is compiled again as "avxvnni-int16"
 * (BS_INT16_VNNI: VEX vpdpbusd / vpdpwssd) and as "avx512vnni-int16" (BS_INT16_EVEX as well: the
 * same in EVEX form, with AVX-512's 32 registers), each with these results bit for bit.
 *
 * Activations: each column is cut into blocks of QA values (256 where a superblock type is in the
 * product, else 32); a block is scaled by s = max|x| / 32512 and rounded to integers X, |X| <=
 * 32512 (2^-15 of the block's largest value: finer than bf16's 8-bit mantissa for every value
 * within 1/128 of the largest), kept as two signed byte digits X = 255*d1 + d0 with d0, d1 in
 * [-127, 127] (base 255, so that no digit is -128: Q8_0's sign trick below negates digits), plus
 * the sums of X over each 16 values. The fast drafter (base alone) keeps one digit: 8-bit
 * activations, as ggml's own K-quant products use. A verify pass's product of the residual alone
 * (add mode: the device computes W2 . x) takes the high digit alone, d1 = round(X / 255) (8 bits,
 * half the multiplies), in every block whose largest value is within BS_HI_SPAN times its mean
 * magnitude; a block with an outlier keeps both digits (one scale per 256 values would flatten the
 * outlier's neighbours). With 8-bit verifier activations (job->act8: BITSPLIT_ACTS_8, the default
 * with a Q6_K residual on x86 CPUs without AVX-512) W2 + R does the same for both halves. The
 * choice is the column's own (from its integers), so batch-invariant.
 *
 * Weights: as in vnni-int24, every type is per group of 32 values an affine map of unsigned byte
 * codes, W = D u + O with D and O per half-group of 16 (avx2_quants.h); Q8_0 is taken as its
 * signed bytes, u = |q| and the digits' signs flipped where q < 0 (so W = d q, no offset). Then
 *   sum_k W[k] x[k] = s * sum_halves (D * sum u X + O * sum X),
 * where sum u X is exact: vpmaddubsw's pair sums stay below 2^15 for every type (u <= 63 except
 * Q8_0's |q| <= 128, digits <= 127), vpmaddwd sums four products per lane (the high digit's
 * weighted by 255), and their sum is exact in int32 and in f32 (below 2^24). Floats appear only
 * in the per-half scaling and the offsets (sums of 16 X, per unit), always in the same order, so a
 * column's result never depends on the rest of the batch.
 *
 * Memory: one row at a time. For W2 + R at every batch size (avx2-int16 with 8-bit activations:
 * below TILE_MIN_COLS_WB columns), and for the other products up to FUSED_COLS columns, each pair
 * of columns (with AVX-512's 32 registers, each set of up to FUSED_WIDE = 4, with the base in the
 * product or for the residual alone below TILE_MIN_COLS) runs over the whole row, decoding each
 * unit in registers and applying it to each of its columns, their totals in registers (the row's
 * blocks are in L1/L2 after the first set, which prefetches them and keeps each unit's decoded
 * scales for the others); above that, each unit is decoded once into an L1 buffer and applied to
 * every column (and R alone from TILE_MIN_COLS columns, 8-bit W2 + R from TILE_MIN_COLS_WB, in
 * tiles of rows and columns). Each weight block is read from memory once per product.
 */
#if defined(__x86_64__)

#define _GNU_SOURCE
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "bitsplit.h"
#include "bs_internal.h"

#if defined(BS_INT16_EVEX) /* compiled a third time as the AVX512-VNNI family (kernels_avx512vnni_int.c) */
#define TGT __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))
#define DPBUSD _mm256_dpbusd_epi32 /* EVEX, 256 bits */
#define DPWSSD _mm256_dpwssd_epi32
#elif defined(BS_INT16_VNNI) /* compiled a second time as the AVX-VNNI family (kernels_avxvnni_int.c) */
#define TGT __attribute__((target("avx2,fma,f16c,avxvnni")))
#define DPBUSD _mm256_dpbusd_avx_epi32 /* VEX */
#define DPWSSD _mm256_dpwssd_avx_epi32
#else
#define TGT __attribute__((target("avx2,fma,f16c")))
#endif
#define INL TGT static inline __attribute__((always_inline))

#include "avx2_quants.h"
#include "prefetch.h"

/* Up to here each set of columns decodes the row again, in registers, for the residual alone, the
 * drafter and the exact weights; W2 + R does so at every batch size. Measured on a 2-core Zen 4
 * (python bench/native_ab.py, Qwen2.5-Coder-1.5B q6_k split, W2 + R, bit-identical), the row
 * decoded again for every set against the one-column buffered loop: time 0.696 / 0.711 / 0.712 /
 * 0.718 / 0.711 at 7 / 8 / 9 / 12 / 16 columns with avx512vnni-int16 (sets of 4), 0.928 / 0.857 /
 * 0.869 / 0.876 at 7 / 8 / 12 / 16 with avx2-int16 (pairs); R alone with avx2-int16 1.05 / 1.05 /
 * 0.99 / 1.08 at 7 / 8 / 12 / 16 (noisy), so the residual alone keeps this limit */
#define FUSED_COLS 6
/* The residual alone (add mode) from TILE_MIN_COLS columns takes its rows TILE_ROWS at a time: each
 * unit of the tile's rows decoded into L1 buffers, then per TILE_COLS columns whose blocks take the
 * high digit alone, the TILE_ROWS x TILE_COLS sums in registers (each digit and each row's codes and
 * scales loaded once per group for the columns and the tile, where one row and one column at a time
 * loaded all three for every pair of row and column). Measured on a 2-core Zen 4 (python
 * bench/native_ab.py OLD.so NEW.so SPLIT --batches 7,8,16,32 --residual-only, Qwen2.5-Coder-1.5B
 * q6_k split, bit-identical), avx512vnni-int16: time 1.00 at 8 columns, 0.74 at 16, 0.61 at 32.
 * With AVX2's 16 registers (avx2-int16; avxvnni-int16 runs its bodies for these types) the same
 * 4 x 2 tile, on a 2-core Zen 5 (same command, --threads 1 --kernel avx2-int16, 7 rounds): time 1.10
 * at 9 columns, 1.01 at 12, 0.90 at 16, 0.82 at 24, 0.81 at 32, 0.76 at 64 (2 rows x 4 columns:
 * 1.09 at 9, 1.01 at 16, 0.90 at 32), so from 16 there; with AVX-512's registers 4 x 4 against
 * 4 x 2 read 1.02 / 0.94 / 0.98 at 9 / 16 / 32: noise, 4 x 2 kept. On a 2-core Zen 3 (AVX2 alone;
 * same command, 1 thread, 5 rounds, with tile_group's codes and scales in registers) tiles against
 * the one-row loop: 1.03 / 0.98 / 1.09 / 1.01 / 1.00 / 0.86 / 0.91 at 7 / 8 / 9 / 10 / 11 / 12 / 14
 * columns (an odd column goes row by row), 1.47 / 1.28 / 1.12 at 3 / 4 / 6 against the pairs: so
 * from 12 on AVX2 (the Zen 5 read 1.01 there; a Zen 4, tiles and registers together against
 * neither, 0.92 at 12) */
#define TILE_ROWS 4
#define TILE_COLS 2
/* Since the tiles ask their rows ahead into L2 and only the next block into L1 (prefetch.h), they
 * beat the other loops from fewer columns: on a 2-core Zen 4 (python bench/native_ab.py OLD.so
 * NEW.so qwen-q6k --residual-only --kernel F --threads 1 --rounds 5, bit-identical) tiles against
 * avx512vnni-int16's sets of 4 (FUSED_ALONE_WIDE) time 1.13 / 0.98 / 0.91 / 0.91 / 0.89 / 0.82 /
 * 0.82 / 0.79 at 4 / 5 / 6 / 7 / 8 / 10 / 12 / 14 columns (they were from 16: the sets against the
 * tiles had read 0.82-0.96 at 9-15), so from 6; and against avx2-int16's pairs and one-row loop
 * 1.06 / 0.97 / 0.85 / 0.84 / 0.81 / 0.76 / 0.72 / 0.74 at 3 / 4 / 5 / 6 / 7 / 8 / 10 / 11. On AVX2
 * alone from 7 (after the pairs, in place of the one-row loop): a Zen 3 (before the prefetch) read
 * the tiles level with that loop at 7-11 and 1.12-1.28x the pairs' time at 4-6; not measured there
 * since. After col_offs and the tiles' tail, this Zen 4 read avx2-int16's tiles against its pairs
 * 0.998 / 0.914 / 0.840 at 4 / 5 / 6 columns, and avx512vnni-int16's sets of 4 against its tiles
 * 1.002 at 6. An AVX2-only Zen 3 (2-core VM, same command, --kernel avx2-int16, 9 rounds) then read
 * tiles from 4 against tiles from 7 (pairs below): 0.841 / 0.816 / 0.758 at 4 / 5 / 6 columns (1.007
 * at 8, where both tile), and tiles from 2 against pairs 1.094 at 2, 0.991 at 3; so AVX2 tiles from
 * 4 (the Zen 4's 0.998 there: level) */
#ifdef BS_INT16_EVEX
#define TILE_MIN_COLS 6
#else
#define TILE_MIN_COLS 4
#endif
/* 8-bit W2 + R (act8: the verifier's default on AVX2 CPUs without AVX-512) in the same tiles, from
 * TILE_MIN_COLS_WB columns: each unit of the tile's rows, base and residual, decoded once for every
 * column, where the pairs decode it again for each pair. avx2-int16 alone (and avxvnni-int16 where it
 * runs avx2-int16's bodies): the VNNI compilations' Q2_K codes carry their scales. Measured on a
 * 2-core Zen 3 (python bench/native_ab.py HEAD.so TILES.so qwen-q6k --kernel avx2-int16 --act-bits 8
 * --rounds 7, Qwen2.5-Coder-1.5B q6_k split, bit-identical), tiles from 4 against the pairs: time
 * 0.970 / 1.047 / 0.924 / 0.925 / 0.783 / 0.746 at 4 / 5 / 6 / 8 / 12 / 16 columns with 2 threads,
 * 1.008 / 1.001 / 0.853 / 0.938 / 0.757 at 4 / 5 / 6 / 8 / 16 with one (an odd column runs row by
 * row): so from 6 */
#define TILE_MIN_COLS_WB 6
/* The most columns one decoding of a row serves in registers, base and residual in the product:
 * with AVX-512's 32 vector registers, 4 (each column's 4 running sums stay in registers); with
 * AVX2's 16, 2 (4 columns at once spilled: time 0.97-1.03 of pairs at 2-6 columns, measured on a
 * 2-core Zen 4). On that Zen 4 (python bench/native_ab.py, Qwen2.5-Coder-1.5B q6_k split, W2 + R,
 * avx512vnni-int16 against avx2-int16, one process, 7 rounds) time 0.98 / 0.91 / 0.72 / 0.69 /
 * 0.82 / 0.80 / 0.88 at 1 / 2 / 3 / 4 / 5 / 6 / 8 columns. */
#ifdef BS_INT16_EVEX
#define FUSED_WIDE 4
#else
#define FUSED_WIDE 2
#endif
/* The residual alone in sets of 4 (3 for the last three), each column's high digit into one vpdpwssd
 * chain, below TILE_MIN_COLS columns: EVEX's 32 registers hold a set's running sums beside a group's
 * codes and scales, and the set's other columns cover the chain's latency. Before, pairs to 6
 * columns (vpmaddwd + vpaddd: with one or two columns a vpdpwssd chain is latency-bound) and the
 * one-row buffered loop to 8. Measured on a 2-core Zen 4 (python bench/native_ab.py OLD.so NEW.so
 * qwen-q6k --residual-only --kernel avx512vnni-int16 --threads 1 --rounds 7, Qwen2.5-Coder-1.5B q6_k
 * split, bit-identical): time 0.80 / 0.89 / 0.90 / 0.91 / 0.84 / 0.82 at 3 / 4 / 5 / 6 / 7 / 8
 * columns (sets of 4 with vpmaddwd + vpaddd: 0.87 / 0.98 / 0.99 / 0.99 / 0.85 / 0.85); sets of 8
 * against sets of 4: 1.16 at 8 columns, 1.14 at 16 */
#ifdef BS_INT16_EVEX
#define FUSED_ALONE_WIDE 1
#define FUSED_COLS_ALONE (TILE_MIN_COLS - 1)
#else
#define FUSED_ALONE_WIDE 0
#define FUSED_COLS_ALONE FUSED_COLS
#endif

/* the same jobs avx2-f32 takes (the types a split holds, rows a multiple of their block) */
static bool int16_supports(const bs_job * job) { return bs_f32_family_supports(job); }

static size_t int16_acts_size(const bs_job * job) { return (size_t)job->n_cols * int16_col_bytes(job) + 64; }

/* the sum of the 8 int32 lanes (exact: callers' sums stay far inside int32) */
INL int32_t hsum8_epi32(__m256i v) {
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    return _mm_cvtsi128_si32(s4);
}

TGT static void int16_prepare_acts(const bs_job * job, int64_t c0, int64_t c1) {
    const int64_t K = job->K, qa = int16_qa(job);
    const bool coarse = job->draft; /* the fast drafter: one digit */
    const int xmax = coarse ? BS_XMAX1 : BS_XMAX2;
    const size_t cb = int16_col_bytes(job);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i lim = _mm256_set1_epi32(xmax), nlim = _mm256_set1_epi32(-xmax);
    const __m256 inv255 = _mm256_set1_ps(1.0f / 255.0f);
    const __m256i k255 = _mm256_set1_epi32(255);
    /* bytes 0, 4, 8, 12 of each 128-bit lane: the low byte of each int32 */
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    for (int64_t c = c0; c < c1; c++) {
        const float * x = job->x + c * job->ldx;
        uint8_t * col = (uint8_t *)job->acts + (size_t)c * cb;
        int8_t * d0 = (int8_t *)col, * d1 = (int8_t *)col + K;
        float * xs16 = (float *)(col + 2 * K), * xh16 = xs16 + K / 16, * sv = xh16 + K / 16;
        uint8_t * hiv = (uint8_t *)(sv + K / qa);
        for (int64_t t = 0; t < K / qa; t++) {
            const float * xb = x + t * qa;
            __m256 mx = _mm256_setzero_ps();
            for (int64_t i = 0; i < qa; i += 8) {
                mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(xb + i), absmask));
            }
            __m128 m = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            m = _mm_max_ss(m, _mm_movehdup_ps(m));
            const float amax = _mm_cvtss_f32(m);
            sv[t] = amax / (float)xmax;
            const __m256 inv = _mm256_set1_ps(amax > 0.0f ? (float)xmax / amax : 0.0f);
            __m256i sabs = _mm256_setzero_si256(); /* sum |X| over the block (<= 256 * 32512: exact) */
            for (int64_t i = 0; i < qa; i += 16) {
                __m256i sum = _mm256_setzero_si256(), sumh = _mm256_setzero_si256();
                for (int64_t j = i; j < i + 16; j += 8) {
                    __m256i X = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + j), inv));
                    X = _mm256_max_epi32(_mm256_min_epi32(X, lim), nlim); /* the rounding at the range's edge */
                    sum = _mm256_add_epi32(sum, X);
                    sabs = _mm256_add_epi32(sabs, _mm256_abs_epi32(X));
                    /* X = 255 hi + lo, hi = round(X / 255) (never a tie: 255 is odd), |lo| <= 127 */
                    const __m256i hi = coarse ? _mm256_setzero_si256()
                                              : _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_cvtepi32_ps(X), inv255));
                    const __m256i lo = _mm256_sub_epi32(X, _mm256_mullo_epi32(hi, k255));
                    sumh = _mm256_add_epi32(sumh, hi);
                    const __m256i blo = _mm256_shuffle_epi8(lo, pick), bhi = _mm256_shuffle_epi8(hi, pick);
                    int32_t l4[2], h4[2];
                    l4[0] = _mm256_extract_epi32(blo, 0), l4[1] = _mm256_extract_epi32(blo, 4);
                    h4[0] = _mm256_extract_epi32(bhi, 0), h4[1] = _mm256_extract_epi32(bhi, 4);
                    memcpy(d0 + t * qa + j, l4, 8);
                    memcpy(d1 + t * qa + j, h4, 8);
                }
                /* the sum of X over these 16 values: exact in f32 (|sum| <= 16 * 32512 < 2^24) */
                xs16[(t * qa + i) / 16] = (float)hsum8_epi32(sum);
                /* and of 255 d1 (|sum| <= 16 * 255 * 127 < 2^24: exact) */
                xh16[(t * qa + i) / 16] = 255.0f * (float)hsum8_epi32(sumh);
            }
            /* the residual takes the high digit alone (8 bits) unless the block's largest value is
             * more than BS_HI_SPAN times its mean magnitude (an outlier, whose scale would flatten its
             * neighbours): decided from the column's own integers, so batch-invariant */
            hiv[t] = !coarse && (int64_t)BS_HI_SPAN * hsum8_epi32(sabs) >= qa * (int64_t)xmax;
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * One unit of one half (base or residual) of one row, decoded: per group of 32 values the codes u
 * and either (superblock types) the halves' integer scales as int16 lanes G, so that the sums stay
 * integers over the whole unit and one float scale d multiplies them, or (block-32 types) the
 * group's float scale D; for Q8_0 the signed bytes q whose signs go onto the digits. Offsets O per
 * half of 16 values, applied per unit with the sums of X over 16 values.
 * ------------------------------------------------------------------------------------------- */
typedef struct {
    __m256i S;   /* superblock types: the 16 integer scales (int16) */
    float O[16];
    float d;
} unit_sc;

typedef struct {
    __m256i u[8], q[8], G[8];
    __m256 D[8];
    unit_sc sc;
} unit_buf;

/* int16 lanes [sc[2g] x8 | sc[2g+1] x8] from the 16 scales S: vpmaddwd's layout of the pair sums
 * of vpmaddubsw (values 0-15 of the group in the low 128 bits) */
INL __m256i group_scales(__m256i S, int g) {
    const __m256i B = g < 4 ? _mm256_permute2x128_si256(S, S, 0x00) : _mm256_permute2x128_si256(S, S, 0x11);
    const char a = (char)(2 * ((2 * g) % 8)), b = (char)(2 * ((2 * g + 1) % 8));
    const __m256i idx = _mm256_setr_epi8(a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1,
                                         b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1);
    return _mm256_shuffle_epi8(B, idx);
}

/* the unit's scales (superblock types) */
INL void decode_scales(int t, const uint8_t * p, unit_sc * h) {
    if (superblock(t)) {
        iscales(t, p, &h->S, &h->d, h->O);
    } else {
        h->S = _mm256_setzero_si256(); /* unused: block-32 types read their scales per group */
    }
}

INL void decode_group(int t, const uint8_t * p, __m256i S, int g, unit_sc * h, __m256i * u, __m256i * q,
                      __m256i * G, __m256 * D) {
    if (superblock(t)) {
        *u = gcodes_u(t, p, g);
        *G = group_scales(S, g);
#ifdef BS_INT16_VNNI
        if (t == T_Q2_K) {
            /* u = sc * q (<= 45): per 128-bit half, bytes 0-3 of sc * 0x03020100 are [0, sc, 2sc, 3sc]
             * (no carries), the table vpshufb reads with q = 0..3 */
            *u = _mm256_shuffle_epi8(_mm256_mullo_epi16(*G, _mm256_set1_epi32(0x03020100)), *u);
        }
#endif
    } else if (t == T_Q8_0) {
        const uint8_t * blk = p + 34 * g;
        *q = _mm256_loadu_si256((const __m256i *)(blk + 2));
        *u = _mm256_abs_epi8(*q); /* -128 -> 0x80 = 128 as unsigned: right */
        *D = _mm256_set1_ps(h2f(blk));
    } else { /* Q4_0 / Q4_1 */
        const bool q41 = t == T_Q4_1;
        const uint8_t * blk = p + (q41 ? 20 : 18) * g;
        const float d = h2f(blk);
        *u = gcodes_u(t, p, g);
        *D = _mm256_set1_ps(d);
        h->O[2 * g] = h->O[2 * g + 1] = q41 ? h2f(blk + 2) : -8.0f * d;
    }
}

/* the running sums of one half for one column over a unit */
typedef struct {
    __m256i il, ih; /* superblock types: sum G u X of the low and high digits */
    __m256i jl, jh; /* the same over the odd groups, where two chains are kept (apply_group's chains) */
    __m256 f[2];    /* block-32 types: sum D u X, two chains (even, odd groups) */
} sums;

INL void sums_init(sums * a) {
    a->il = a->ih = a->jl = a->jh = _mm256_setzero_si256();
    a->f[0] = a->f[1] = _mm256_setzero_ps();
}

/* one group of one half for one column; chains (the EVEX compilation alone; both digits, verifying
 * with the base): 2 at W2 + R's 1-2 columns, 1 at 3-4, 0 otherwise (fused_group) */
INL void apply_group(int t, bool coarse, int g, __m256i u, __m256i q, __m256i G, __m256 D, const int8_t * d0,
                     const int8_t * d1, sums * a, int chains) {
    (void)chains; /* used by the EVEX compilation alone */
    __m256i e0 = _mm256_loadu_si256((const __m256i *)d0);
    if (t == T_Q8_0) e0 = _mm256_sign_epi8(e0, q);
    if (superblock(t)) {
        /* |G u X| per lane <= 2 * 2*63*127 * 128 per group, 8 groups: far inside int32 */
#ifdef BS_INT16_VNNI
        /* the same integers: Q2_K's codes carry their scale, so vpdpbusd adds four u X into each
         * lane (|4*45*127| per group). The other types keep vpmaddubsw + vpmaddwd + vpaddd: a
         * vpdpwssd into the running sum would chain its latency through the unit's 8 groups (Q6_K
         * R.x at one column 1.19x slower so, measured on a Zen 5) */
        if (t == T_Q2_K) {
            /* one chain per digit: two (even and odd groups) measured 2-5% slower (registers) */
            a->il = DPBUSD(a->il, u, e0);
            if (!coarse) a->ih = DPBUSD(a->ih, u, _mm256_loadu_si256((const __m256i *)d1));
            __asm__("" : "+x"(a->il), "+x"(a->ih));
            return;
        }
#ifdef BS_INT16_EVEX
        if (chains == 1 && !coarse) {
            /* 3-4 columns with the base: vpdpwssd into one chain per digit, the same integers as
             * vpmaddwd + vpaddd in one instruction; the other columns' chains cover its latency.
             * Measured on a 2-core Zen 4 (python bench/native_ab.py, Qwen2.5-Coder-1.5B q6_k split,
             * W2 + R, avx512vnni-int16, bit-identical): time 0.927 / 0.924 / 0.936 at 3 / 4 / 5
             * columns (7 rounds), 0.948 / 0.936 / 0.952 / 0.928 at 3 / 4 / 5 / 6 (9 rounds); in the
             * one-column buffered loop (no other chains) 1.02-1.06 at 7-16 columns, so not there */
            a->il = DPWSSD(a->il, _mm256_maddubs_epi16(u, e0), G);
            a->ih = DPWSSD(a->ih, _mm256_maddubs_epi16(u, _mm256_loadu_si256((const __m256i *)d1)), G);
            __asm__("" : "+x"(a->il), "+x"(a->ih));
            return;
        }
        if (chains == 1 && coarse) {
            /* the residual alone on its high digit in a set of 3-4 columns (FUSED_ALONE_WIDE):
             * vpdpwssd into the column's one chain, the same integers as below */
            a->il = DPWSSD(a->il, _mm256_maddubs_epi16(u, e0), G);
            __asm__("" : "+x"(a->il));
            return;
        }
        if (chains == 2 && !coarse) {
            /* W2 + R at 1-2 columns: vpdpwssd, vpmaddwd and vpaddd in one (the same integers), into
             * two chains per digit (even and odd groups, summed at the unit's end), which halve its
             * latency through the unit. Measured on a 2-core Zen 4 (python bench/native_ab.py,
             * Qwen2.5-Coder-1.5B q6_k split, avx512vnni-int16, results bit-identical): time 0.983 /
             * 0.966 and 0.942 / 0.953 at 1 / 2 columns (two runs of 40 rounds; avx2-int16, whose
             * code this leaves as it was, 0.996 / 0.987 and 0.997 / 0.990 in the same runs); R alone
             * the same way took 1.03 / 1.05 (7 rounds), so it keeps vpmaddwd + vpaddd */
            __m256i * l = (g & 1) ? &a->jl : &a->il, * h = (g & 1) ? &a->jh : &a->ih;
            *l = DPWSSD(*l, _mm256_maddubs_epi16(u, e0), G);
            *h = DPWSSD(*h, _mm256_maddubs_epi16(u, _mm256_loadu_si256((const __m256i *)d1)), G);
            __asm__("" : "+x"(a->il), "+x"(a->ih), "+x"(a->jl), "+x"(a->jh));
            return;
        }
#endif
#endif
        a->il = _mm256_add_epi32(a->il, _mm256_madd_epi16(_mm256_maddubs_epi16(u, e0), G));
        if (!coarse) {
            const __m256i e1 = _mm256_loadu_si256((const __m256i *)d1);
            a->ih = _mm256_add_epi32(a->ih, _mm256_madd_epi16(_mm256_maddubs_epi16(u, e1), G));
        }
        /* opaque to the compiler: integer sums may be reassociated, and it would keep every group's
         * products live to add them as a tree at the end of the unit, spilling them (measured) */
        __asm__("" : "+x"(a->il), "+x"(a->ih));
        return;
    }
#ifdef BS_INT16_VNNI
    __m256i p = DPBUSD(_mm256_setzero_si256(), u, e0); /* = vpmaddubsw's pairs summed: none saturates */
#else
    __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, e0), _mm256_set1_epi16(1));
#endif
    if (!coarse) {
        __m256i e1 = _mm256_loadu_si256((const __m256i *)d1);
        if (t == T_Q8_0) e1 = _mm256_sign_epi8(e1, q);
        /* 255 p1 + p0: exact in int32 and in f32 (|p| <= 256 * 4*128*127 < 2^24) */
#ifdef BS_INT16_VNNI
        p = DPWSSD(p, _mm256_maddubs_epi16(u, e1), _mm256_set1_epi16(255));
#else
        p = _mm256_add_epi32(p, _mm256_madd_epi16(_mm256_maddubs_epi16(u, e1), _mm256_set1_epi16(255)));
#endif
    }
    a->f[g & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), D, a->f[g & 1]);
}

/* the activations of column c from value k0: digits, sums of 16, block scale */
typedef struct {
    const int8_t * d0, * d1;
    const float * xs16, * xh16;
    float s;
    bool hi; /* the residual takes the high digit alone */
} colp;

/* one group of the residual for one column: the high digit alone where hi (the column's block
 * allows it; a constant where inlined: decided per unit, outside the groups' loop) */
INL void apply_r(int t, bool coarse, bool hi, int g, __m256i u, __m256i q, __m256i G, __m256 D, const colp * a,
                 sums * s, int chains) {
    if (coarse || !hi) {
        apply_group(t, coarse, g, u, q, G, D, a->d0 + 32 * g, a->d1 + 32 * g, s, chains);
    } else {
        apply_group(t, true, g, u, q, G, D, a->d1 + 32 * g, NULL, s, chains == 1 ? 1 : 0);
    }
}

/* the half's value over the unit for one column (before the block scale s); hi: the sums are of
 * the high digit alone (the residual's, in a verify pass), xs16 then its sums xh16 */
INL __m256 sums_end(int t, bool coarse, bool hi, int ng, const sums * a, const unit_sc * h, const float * xs16) {
    __m256 v;
    if (superblock(t)) {
        const __m256i il = _mm256_add_epi32(a->il, a->jl), ih = _mm256_add_epi32(a->ih, a->jh);
        const __m256 T = coarse ? _mm256_cvtepi32_ps(il)
                                : _mm256_fmadd_ps(_mm256_cvtepi32_ps(ih), _mm256_set1_ps(255.0f), _mm256_cvtepi32_ps(il));
        v = _mm256_mul_ps(T, _mm256_set1_ps(hi ? 255.0f * h->d : h->d));
    } else {
        v = _mm256_add_ps(a->f[0], a->f[1]);
        if (hi) v = _mm256_mul_ps(v, _mm256_set1_ps(255.0f));
    }
    if (t == T_Q8_0) {
        return v; /* no offset */
    }
    if (ng == 8) {
        return _mm256_fmadd_ps(_mm256_loadu_ps(h->O + 8), _mm256_loadu_ps(xs16 + 8),
                               _mm256_fmadd_ps(_mm256_loadu_ps(h->O), _mm256_loadu_ps(xs16), v));
    }
    /* one group (units of 32): two halves, in lanes 0 and 1 */
    /* two floats each, read through __m128i (which may alias them): a load through a double
     * pointer breaks the aliasing rules, and a build that kept the column totals in registers
     * (no __m256 store in between) moved it above decode_group's store of O, reading the previous
     * unit's offsets (greedy speculative output then differed from the verifier's on SmolLM2) */
    const __m128 o = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)h->O));
    const __m128 x = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)xs16));
    return _mm256_add_ps(v, _mm256_castps128_ps256(_mm_mul_ps(o, x)));
}

/* the residual's value over the unit for one column (as apply_r took its digits) */
INL __m256 sums_r(int t, bool coarse, bool hi, int ng, const sums * s, const unit_sc * h, const colp * a) {
    if (coarse || !hi) {
        return sums_end(t, coarse, false, ng, s, h, a->xs16);
    }
    return sums_end(t, true, true, ng, s, h, a->xh16);
}

/* Where unit k0 / qa's digits, sums of 16, block scale and digit choice sit in a column, in bytes
 * from the column's start (int16_prepare_acts' layout: d0 [K], d1 [K], xs16 [K / 16], xh16 [K / 16],
 * sv [K / qa], hiv [K / qa]): the same for every column, so computed once per unit, and each column
 * then costs its start (kept across the units) and a load or two. Before, each column worked all of
 * this out again for every unit: a quarter of the instructions of the residual's sets of 4 and a
 * tenth of the tiles' samples (perf record -e cpu-clock). With the tiles' tail (tiled_rows) and
 * fused_unit_body's add to zero left out, on a 2-core Zen 4 (python bench/native_ab.py OLD.so NEW.so
 * qwen-q6k [--residual-only] --kernel F --threads 1 --rounds 5, Qwen2.5-Coder-1.5B q6_k split,
 * bit-identical): R alone with avx512vnni-int16 time 0.975 / 0.961 / 0.911 / 0.932 / 0.948 / 0.912 /
 * 0.925 at 1 / 2 / 4 / 5 / 6 / 16 / 64 columns, with avx2-int16 0.977 / 0.950 / 0.948 / 0.925 / 0.898 /
 * 0.891 at 1 / 2 / 4 / 7 / 16 / 64; W2 + R 0.987 / 0.975 / 0.978 at 1 / 2 / 4 (avx512vnni-int16),
 * 0.986 / 0.984 at 1 / 2 (avx2-int16, 7 rounds). */
typedef struct {
    size_t d0, d1, xs, xh, s, hi;
} col_offs;

INL col_offs col_offs_at(int64_t K, int64_t k0, int qa) {
    const size_t k = (size_t)K, u = (size_t)k0, t = u / (size_t)qa, nq = k / (size_t)qa;
    const size_t xs = 2 * k + 4 * (u / 16), sv = 2 * k + 4 * (2 * (k / 16));
    const col_offs o = {u, k + u, xs, xs + 4 * (k / 16), sv + 4 * t, sv + 4 * nq + t};
    return o;
}

/* the activations of the column starting at col, at the unit o describes */
INL colp col_from(const uint8_t * col, const col_offs * o) {
    float s;
    memcpy(&s, col + o->s, sizeof s);
    colp a = {(const int8_t *)(col + o->d0), (const int8_t *)(col + o->d1), (const float *)(col + o->xs),
              (const float *)(col + o->xh), s, col[o->hi] != 0};
    return a;
}

/* group g of one unit applied to ncb columns (base half first) */
INL void fused_group(int bt, int rt, const uint8_t * bp, const uint8_t * rp, __m256i Sb, __m256i Sr, unit_sc * hb,
                     unit_sc * hr, int g, const colp * a, int ncb, sums * ab, sums * ar, bool coarse, bool h0,
                     bool h1) {
    __m256i u, q = _mm256_setzero_si256(), G = _mm256_setzero_si256();
    __m256 D = _mm256_setzero_ps();
    /* with the base, verifying with both digits: two chains per digit at 1-2 columns, one vpdpwssd
     * chain at 3-4 (apply_group); a column on its high digit alone takes one chain (apply_r); the
     * residual alone in a set of 3-4 (FUSED_ALONE_WIDE) one vpdpwssd chain per column and digit */
    const int chains = bt != T_NONE && !coarse ? (ncb <= 2 ? 2 : 1) : (bt == T_NONE && !coarse && ncb >= 3 ? 1 : 0);
    if (bt != T_NONE) {
        decode_group(bt, bp, Sb, g, hb, &u, &q, &G, &D);
        /* the base: the high digit alone where the column's block takes it (r_alone_hi: act8) */
        for (int j = 0; j < ncb; j++) apply_r(bt, coarse, j == 0 ? h0 : h1, g, u, q, G, D, &a[j], &ab[j], chains);
    }
    if (rt != T_NONE) {
        decode_group(rt, rp, Sr, g, hr, &u, &q, &G, &D);
        /* the residual: the high digit alone (8-bit activations) where the column's block takes it */
        for (int j = 0; j < ncb; j++) apply_r(rt, coarse, j == 0 ? h0 : h1, g, u, q, G, D, &a[j], &ar[j], chains);
    }
}

/* One unit applied to columns c0 .. c0 + ncb - 1 (ncb = 1 to FUSED_WIDE, a constant where inlined), each
 * group decoded in registers and applied to every column at once; h0 / h1: whether column c0 / the
 * others take the high digit alone (constants: fused_unit chooses the body; 3-4 columns, with 16-bit
 * activations alone, take neither). */
INL void fused_unit_body(int bt, int rt, int ng, const uint8_t * bp, const uint8_t * rp, __m256i Sb, __m256i Sr,
                         unit_sc * hb, unit_sc * hr, const colp * a, int ncb, __m256 * tot, bool coarse,
                         bool h0, bool h1) {
    sums ab[FUSED_WIDE], ar[FUSED_WIDE];
    for (int j = 0; j < ncb; j++) {
        sums_init(&ab[j]);
        sums_init(&ar[j]);
    }
    if (ng == 8) {
        /* two halves of the unit, not unrolled: unrolled whole, the compiler hoists the eight
         * groups' codes and scales and spills them (a third of the time at 2 columns, measured) */
        _Pragma("GCC unroll 1") for (int n = 0; n < 2; n++) {
            _Pragma("GCC unroll 4") for (int i = 0; i < 4; i++) {
                fused_group(bt, rt, bp, rp, Sb, Sr, hb, hr, 4 * n + i, a, ncb, ab, ar, coarse, h0, h1);
            }
        }
    } else {
        fused_group(bt, rt, bp, rp, Sb, Sr, hb, hr, 0, a, ncb, ab, ar, coarse, h0, h1);
    }
    for (int j = 0; j < ncb; j++) {
        const bool hj = j == 0 ? h0 : h1;
        /* the residual's sums alone, or the base's plus the residual's: an add to zero first (as
         * buffered_unit does) changes only a -0 to +0, and gives the same total, which starts at +0
         * and so is never -0 (the tiles leave it out the same way) */
        __m256 v;
        if (bt != T_NONE && rt != T_NONE) {
            v = _mm256_add_ps(sums_r(bt, coarse, hj, ng, &ab[j], hb, &a[j]), sums_r(rt, coarse, hj, ng, &ar[j], hr, &a[j]));
        } else if (bt != T_NONE) {
            v = sums_r(bt, coarse, hj, ng, &ab[j], hb, &a[j]);
        } else {
            v = sums_r(rt, coarse, hj, ng, &ar[j], hr, &a[j]);
        }
        tot[j] = _mm256_fmadd_ps(_mm256_set1_ps(a[j].s), v, tot[j]);
    }
}

/* whether a verify pass takes this column's high digit alone over the unit, where the column's
 * block has no outlier: in a product of the residual alone (add mode: the device computes W2 . x),
 * and with act8 (BITSPLIT_ACTS_8) in W2 + R for both halves. Without act8, W2 + R keeps two digits:
 * measured on a 2-core Zen 3 (bench/native_ab.py, W2 + R, Qwen2.5-Coder-1.5B q6_k split), the high
 * digit for R alone saved 0-7% at 1-4 columns and doubled the verifier's KL (0.052x -> 0.098x stock
 * Q8_0's); for both halves, on a Zen 4 with llama.cpp and this library on AVX2 alone, 1.03-1.29x
 * end to end over six pairs (median 1.14) at 0.53x stock Q8_0's KL on code, 0.94x on English (README) */
INL bool r_alone_hi(bool act8, int bt, int rt, bool coarse, const colp * a) {
    return (bt == T_NONE || act8) && rt != T_NONE && !coarse && a->hi;
}

/* 1-2 columns (ncb), whether each takes the high digit alone a constant in its body */
INL void fused_pair(int bt, int rt, int ng, const uint8_t * bp, const uint8_t * rp, __m256i Sb, __m256i Sr,
                    unit_sc * hb, unit_sc * hr, const colp * a, int ncb, __m256 * tot, bool coarse, bool h0, bool h1) {
    if (h0 && h1) {
        fused_unit_body(bt, rt, ng, bp, rp, Sb, Sr, hb, hr, a, ncb, tot, coarse, true, true);
    } else if (h0) {
        fused_unit_body(bt, rt, ng, bp, rp, Sb, Sr, hb, hr, a, ncb, tot, coarse, true, false);
    } else if (h1) {
        fused_unit_body(bt, rt, ng, bp, rp, Sb, Sr, hb, hr, a, ncb, tot, coarse, false, true);
    } else {
        fused_unit_body(bt, rt, ng, bp, rp, Sb, Sr, hb, hr, a, ncb, tot, coarse, false, false);
    }
}

/* the body for these columns' digit choices, each a constant in it (a branch per group and column
 * made the 2-column pass 1.19x slower, measured). With act8 (W2 + R on 8-bit activations, pairs at
 * most: rows_body_bits) a pair takes one body for its common choice, and a pair whose columns differ
 * runs as two columns (the same integers, in the same floating-point order: batch-invariant): two
 * bodies per width, not one per combination (with those, and avx512vnni-int16's 3-4 column sets
 * under act8, kernels_avx512vnni_int.c compiled for over 9 minutes under ASan; 383 s now, and
 * kernels_avx2_int.c 236 s against 55 s before 8-bit W2 + R: native/tests/run_sanitizers.sh) */
INL void fused_unit(int bt, int rt, int ng, const uint8_t * bp, const uint8_t * rp, __m256i Sb, __m256i Sr,
                    unit_sc * hb, unit_sc * hr, const uint8_t * const * cols, const col_offs * o, int ncb,
                    __m256 * tot, bool coarse, bool act8) {
    colp a[FUSED_WIDE];
    bool h[FUSED_WIDE];
    int nh = 0;
    for (int j = 0; j < ncb; j++) {
        a[j] = col_from(cols[j], o);
        h[j] = r_alone_hi(act8, bt, rt, coarse, &a[j]);
        nh += h[j];
    }
    if (ncb > 2 && bt != T_NONE) { /* with the base and 16-bit activations (act8 keeps to pairs): both digits */
        fused_unit_body(bt, rt, ng, bp, rp, Sb, Sr, hb, hr, a, ncb, tot, coarse, false, false);
        return;
    }
    /* act8's pairs with the base, and the residual alone in a set of 3-4 (FUSED_ALONE_WIDE): one body
     * for the columns' common digit choice; columns whose choices differ run one by one (the same
     * integers and float operations for each: batch-invariant) */
    if (ncb > 2 || (act8 && bt != T_NONE)) {
        if (nh == 0 || nh == ncb) {
            if (nh > 0) {
                fused_unit_body(bt, rt, ng, bp, rp, Sb, Sr, hb, hr, a, ncb, tot, coarse, true, true);
            } else {
                fused_unit_body(bt, rt, ng, bp, rp, Sb, Sr, hb, hr, a, ncb, tot, coarse, false, false);
            }
            return;
        }
        /* through copies: indexed by a loop variable, a, h and the totals lived in memory in the
         * common case above as well (the set's totals and columns stored and loaded every unit).
         * Measured on a 2-core Zen 4 (python bench/native_ab.py OLD.so NEW.so qwen-q6k --threads 1
         * --rounds 5, bit-identical): R alone with avx512vnni-int16 (sets of 3-4) time 0.917 / 0.903
         * / 0.920 at 3 / 4 / 5 columns; 8-bit W2 + R with avx2-int16 (--act-bits 8, its pairs)
         * 1.000 / 0.925 / 0.956 / 0.932 at 1 / 2 / 3 / 4 */
        __m256 t1[FUSED_WIDE];
        for (int j = 0; j < ncb; j++) t1[j] = tot[j];
        _Pragma("GCC unroll 1") for (int j = 0; j < ncb; j++) {
            const colp aj = col_from(cols[j], o);
            fused_pair(bt, rt, ng, bp, rp, Sb, Sr, hb, hr, &aj, 1, t1 + j, coarse,
                       r_alone_hi(act8, bt, rt, coarse, &aj), false);
        }
        for (int j = 0; j < ncb; j++) tot[j] = t1[j];
        return;
    }
    fused_pair(bt, rt, ng, bp, rp, Sb, Sr, hb, hr, a, ncb, tot, coarse, h[0], ncb == 2 && h[1]);
}

/* columns c .. c + ncb - 1 (ncb = 1 to FUSED_WIDE, a constant where inlined) of row r, unit after unit over
 * the whole row: the pair's totals are locals, in registers across the units. The first pair
 * (c = 0) prefetches the row and decodes each unit's scales into scb / scr (one per unit of the
 * row), which the other pairs read back */
INL void fused_row(const bs_job * job, int bt, int rt, bool coarse, bool act8, int64_t r, int64_t c, int ncb, unit_sc * scb,
                   unit_sc * scr, const uint8_t * brow, const uint8_t * rrow, const uint8_t * bend,
                   const uint8_t * rend) {
    const int64_t K = job->K;
    const int qa = unit_of(bt, rt);
    const int ng = qa / 32;
    const size_t cb = int16_col_bytes(job);
    const size_t bub = bt != T_NONE ? toff(bt, qa) : 0, rub = rt != T_NONE ? toff(rt, qa) : 0;
    __m256 pt[FUSED_WIDE];
    for (int j = 0; j < FUSED_WIDE; j++) pt[j] = _mm256_setzero_ps();
    const uint8_t * cols[FUSED_WIDE];
    for (int j = 0; j < ncb; j++) cols[j] = (const uint8_t *)job->acts + (size_t)(c + j) * cb;
    bool first = c == 0;
    for (int64_t k0 = 0; k0 < K; k0 += qa) {
        const int64_t t = k0 / qa;
        const uint8_t * bp = bt != T_NONE ? brow + (size_t)t * bub : NULL;
        const uint8_t * rp = rt != T_NONE ? rrow + (size_t)t * rub : NULL;
        unit_sc * hb = scb + t, * hr = scr + t;
        /* opaque: unswitched on it, the loop (and its inlined bodies) would be compiled twice */
        __asm__("" : "+r"(first));
        if (first) {
            if (bt != T_NONE) bs_prefetch_ahead(bp, bub, bend);
            /* the residual alone: one stream, further ahead (prefetch.h) */
            if (rt != T_NONE) bs_prefetch_at(rp, rub, rend, bt != T_NONE ? BS_PF_AHEAD : BS_PF_AHEAD_ALONE);
            if (bt != T_NONE) decode_scales(bt, bp, hb);
            if (rt != T_NONE) decode_scales(rt, rp, hr);
        }
        const __m256i Sb = bt != T_NONE ? hb->S : _mm256_setzero_si256();
        const __m256i Sr = rt != T_NONE ? hr->S : _mm256_setzero_si256();
        const col_offs o = col_offs_at(K, k0, qa);
        fused_unit(bt, rt, ng, bp, rp, Sb, Sr, hb, hr, cols, &o, ncb, pt, coarse, act8);
    }
    for (int j = 0; j < ncb; j++) {
        float * y = job->y + (c + j) * job->ldy + r;
        const float v = hsum8(pt[j]);
        *y = job->accumulate ? *y + v : v;
    }
}

/* one column's sums over a unit decoded in the L1 buffers (b, e), both halves' digits as hi says */
INL __m256 buffered_unit(int bt, int rt, int ng, const unit_buf * b, const unit_buf * e, const colp * a, bool coarse,
                         bool hi) {
    sums ab, ar;
    sums_init(&ab);
    sums_init(&ar);
    _Pragma("GCC unroll 8") for (int g = 0; g < ng; g++) {
        if (bt != T_NONE) apply_r(bt, coarse, hi, g, b->u[g], b->q[g], b->G[g], b->D[g], a, &ab, 0);
        if (rt != T_NONE) apply_r(rt, coarse, hi, g, e->u[g], e->q[g], e->G[g], e->D[g], a, &ar, 0);
    }
    __m256 v = _mm256_setzero_ps();
    if (bt != T_NONE) v = sums_r(bt, coarse, hi, ng, &ab, &b->sc, a);
    if (rt != T_NONE) v = _mm256_add_ps(v, sums_r(rt, coarse, hi, ng, &ar, &e->sc, a));
    return v;
}

/* one column's sums over a unit decoded in the L1 buffers (b, e), its residual's digits as the
 * column's block allows (r_alone_hi), times its block scale into its total *t: the one-row loop's
 * body for each column, and the tile's for a column whose pair does not take the high digit alone */
INL void buffered_column(bool act8, int bt, int rt, int ng, const unit_buf * b, const unit_buf * e, const colp * a,
                         bool coarse, __m256 * t) {
    /* read the decoded unit from L1 in every column: kept in registers across the column loop it
     * would spill */
    __asm__("" : "+r"(b), "+r"(e));
    const __m256 v = r_alone_hi(act8, bt, rt, coarse, a) ? buffered_unit(bt, rt, ng, b, e, a, coarse, true)
                                                   : buffered_unit(bt, rt, ng, b, e, a, coarse, false);
    *t = _mm256_fmadd_ps(_mm256_set1_ps(a->s), v, *t);
}

/* one group g of the tile's TILE_ROWS rows (buffers e) applied to TILE_COLS columns' high digits (a):
 * the same integers as apply_group's for each (row, column), acc[i * TILE_COLS + j] row i's and
 * column j's */
INL void tile_group(const unit_buf * e, int g, const colp * a, __m256i * acc) {
    __m256i h[TILE_COLS];
    for (int j = 0; j < TILE_COLS; j++) h[j] = _mm256_loadu_si256((const __m256i *)(a[j].d1 + 32 * g));
    for (int i = 0; i < TILE_ROWS; i++) {
        /* in registers for the tile's columns: as memory operands the compiler loaded both again for
         * every column (18 loads a group where 10 do; Zen 3 issues two 256-bit loads a cycle), time
         * 0.92 / 0.94 / 0.96 at 16 / 24 / 32 columns on a 2-core Zen 3 (python bench/native_ab.py,
         * Qwen2.5-Coder-1.5B q6_k split, --residual-only --kernel avx2-int16 --threads 1, 5 rounds);
         * on a 2-core Zen 4, with the tiles from 12, 0.92 / 0.96 / 0.96 at 12 / 16 / 32. The EVEX build
         * (32 registers) kept them there already: 1.01 / 1.00 / 0.99 at 9 / 16 / 32 (avx512vnni-int16;
         * "+v", any of the 32, read as "+x" did) */
        __m256i u = e[i].u[g], G = e[i].G[g];
        __asm__("" : "+x"(u), "+x"(G));
        for (int j = 0; j < TILE_COLS; j++) {
#ifdef BS_INT16_EVEX
            acc[i * TILE_COLS + j] = DPWSSD(acc[i * TILE_COLS + j], _mm256_maddubs_epi16(u, h[j]), G);
#else
            acc[i * TILE_COLS + j] = _mm256_add_epi32(acc[i * TILE_COLS + j],
                                                      _mm256_madd_epi16(_mm256_maddubs_epi16(u, h[j]), G));
            /* opaque, as in apply_group: else the compiler keeps every group's products to add them
             * as a tree at the unit's end, and spills them */
            __asm__("" : "+x"(acc[i * TILE_COLS + j]));
#endif
        }
    }
}

/* one half's tile (TILE_ROWS rows e, TILE_COLS columns a on their high digit) over the unit: its
 * integer sums (tile_group), then sums_end's operations for a superblock type's high digit in its
 * order (the same bits), into v[i * TILE_COLS + j], with each row's 255 d and offsets read once for
 * the tile's columns: read through e (which the stores to tot may alias, for all the compiler knows)
 * they were loaded again, and 255 d multiplied again, for every (row, column); a quarter of the
 * tile's samples were this tail. Alone: time 0.970 / 0.972 / 0.968 / 0.978 / 0.978 at 6 / 8 / 16 /
 * 32 / 64 columns (same command as col_offs'). */
INL void tile_half(const unit_buf * e, int ng, const colp * a, __m256 * v) {
    __m256i acc[TILE_ROWS * TILE_COLS];
    for (int j = 0; j < TILE_ROWS * TILE_COLS; j++) acc[j] = _mm256_setzero_si256();
    _Pragma("GCC unroll 8") for (int g = 0; g < ng; g++) {
        tile_group(e, g, a, acc);
    }
    for (int i = 0; i < TILE_ROWS; i++) {
        const __m256 dv = _mm256_set1_ps(255.0f * e[i].sc.d);
        const __m256 o0 = _mm256_loadu_ps(e[i].sc.O), o1 = _mm256_loadu_ps(e[i].sc.O + 8);
        for (int j = 0; j < TILE_COLS; j++) {
            const __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[i * TILE_COLS + j]), dv);
            v[i * TILE_COLS + j] = _mm256_fmadd_ps(o1, _mm256_loadu_ps(a[j].xh16 + 8),
                                                   _mm256_fmadd_ps(o0, _mm256_loadu_ps(a[j].xh16), w));
        }
    }
}

/* The TILE_ROWS rows of one unit of a tile, decoded into the L1 buffers e[0 .. TILE_ROWS - 1] */
INL void tile_decode(int t, const uint8_t * w, size_t row_bytes, size_t ub, int64_t rt0, int64_t u, const uint8_t * end,
                     int ng, unit_buf * e) {
    for (int i = 0; i < TILE_ROWS; i++) {
        const uint8_t * p = w + (size_t)(rt0 + i) * row_bytes + (size_t)u * ub;
        bs_prefetch_at(p, ub, end, BS_PF_TILE_NEAR);
        bs_prefetch_l2_at(p, ub, end, BS_PF_TILE_FAR);
        decode_scales(t, p, &e[i].sc);
        const __m256i S = e[i].sc.S;
        _Pragma("GCC unroll 8") for (int g = 0; g < ng; g++) {
            decode_group(t, p, S, g, &e[i].sc, &e[i].u[g], &e[i].q[g], &e[i].G[g], &e[i].D[g]);
        }
    }
}

/* The residual alone (bt = T_NONE) from TILE_MIN_COLS columns, and 8-bit W2 + R (act8, both halves
 * superblock types) from TILE_MIN_COLS_WB: rows in tiles of TILE_ROWS, each unit of the tile's rows
 * decoded into L1 buffers (eb[i] the base's, e[i] the residual's); the columns whose blocks take the
 * high digit alone, TILE_COLS at a time, run tile_half for each half, any other column (and the last
 * few) buffered_column row by row. Every (row, column) sees buffered_unit's integers and then its
 * float operations in the same order (each half's sums and offsets, the base's plus the
 * residual's, times the block scale into the total), once per unit into its own total: the same
 * results whichever way its column went. Tried and slower for the residual alone: 4 x 4 tiles
 * (EVEX) 1.04-1.15 at 6-64; a chunk of 3-6 units decoded before the columns run it with the tile's
 * totals in registers, 1.07-1.17 at 6-16 (the decoding then waits on L2) though 0.93-0.97 at 64;
 * EVEX tiles from 4 columns 1.28 at 4, 1.05 at 5 (against its sets of 4; AVX2's, against its
 * pairs, win from 4: TILE_MIN_COLS) */
INL void tiled_rows(const bs_job * job, int bt, int rt, bool act8, int64_t r0, int64_t r1, unit_buf * eb, unit_buf * e,
                    __m256 * tot) {
    const int64_t K = job->K, nc = job->n_cols;
    const int qa = unit_of(bt, rt);
    const int ng = qa / 32;
    const size_t cb = int16_col_bytes(job);
    const size_t rub = toff(rt, qa), bub = bt != T_NONE ? toff(bt, qa) : 0;
    const uint8_t * rend = job->r + (size_t)r1 * job->r_row_bytes;
    const uint8_t * bend = bt != T_NONE ? job->w2 + (size_t)r1 * job->w2_row_bytes : NULL;
    /* without the base, e stands for both buffers in buffered_column */
    const unit_buf * ebc = bt != T_NONE ? eb : e;
    for (int64_t rt0 = r0; rt0 + TILE_ROWS <= r1; rt0 += TILE_ROWS) {
        for (int64_t i = 0; i < nc * TILE_ROWS; i++) {
            tot[i] = _mm256_setzero_ps();
        }
        for (int64_t k0 = 0; k0 < K; k0 += qa) {
            const int64_t t = k0 / qa;
            if (bt != T_NONE) tile_decode(bt, job->w2, job->w2_row_bytes, bub, rt0, t, bend, ng, eb);
            tile_decode(rt, job->r, job->r_row_bytes, rub, rt0, t, rend, ng, e);
            const col_offs o = col_offs_at(K, k0, qa);
            const uint8_t * cp = (const uint8_t *)job->acts;
            int64_t c = 0;
            while (c < nc) {
                /* the next TILE_COLS columns on their high digit; the others met on the way, row by row */
                colp a[TILE_COLS];
                int64_t at[TILE_COLS];
                int n = 0;
                for (; c < nc && n < TILE_COLS; c++, cp += cb) {
                    const colp ac = col_from(cp, &o);
                    if (r_alone_hi(act8, bt, rt, false, &ac)) {
                        a[n] = ac;
                        at[n++] = c;
                    } else {
                        for (int i = 0; i < TILE_ROWS; i++) {
                            buffered_column(act8, bt, rt, ng, ebc + i, e + i, &ac, false, &tot[c * TILE_ROWS + i]);
                        }
                    }
                }
                if (n < TILE_COLS) { /* the last few: row by row */
                    for (int j = 0; j < n; j++) {
                        for (int i = 0; i < TILE_ROWS; i++) {
                            buffered_column(act8, bt, rt, ng, ebc + i, e + i, &a[j], false, &tot[at[j] * TILE_ROWS + i]);
                        }
                    }
                    continue;
                }
                __m256 vb[TILE_ROWS * TILE_COLS], v[TILE_ROWS * TILE_COLS];
                if (bt != T_NONE) {
                    tile_half(eb, ng, a, vb);
                    /* the base's values to memory (L1) while the residual's tile runs: kept in
                     * registers, they made the compiler spill that tile's integer sums instead */
                    __asm__("" : : "r"(vb) : "memory");
                }
                tile_half(e, ng, a, v);
                __m256 sv[TILE_COLS];
                for (int j = 0; j < TILE_COLS; j++) sv[j] = _mm256_set1_ps(a[j].s);
                for (int i = 0; i < TILE_ROWS; i++) {
                    for (int j = 0; j < TILE_COLS; j++) {
                        /* buffered_column adds the sums to a zero first, which changes only a -0 to +0:
                         * the same in the total, which starts at +0 and so is never -0 (time 0.980 /
                         * 0.956 at 16 / 64 columns without that add, measured as BS_PF_TILE_NEAR is) */
                        const __m256 w = bt != T_NONE ? _mm256_add_ps(vb[i * TILE_COLS + j], v[i * TILE_COLS + j])
                                                      : v[i * TILE_COLS + j];
                        __m256 * tt = &tot[at[j] * TILE_ROWS + i];
                        *tt = _mm256_fmadd_ps(sv[j], w, *tt);
                    }
                }
            }
        }
        for (int64_t c = 0; c < nc; c++) {
            for (int i = 0; i < TILE_ROWS; i++) {
                float * y = job->y + c * job->ldy + rt0 + i;
                const float v = hsum8(tot[c * TILE_ROWS + i]);
                *y = job->accumulate ? *y + v : v;
            }
        }
    }
}

/* Every (row, column) sees the same operations in the same order: per unit, each half's sums
 * (base first), their offsets, times the block scale s, into the column's total. act8: a constant
 * (rows_body), so that W2 + R with 16-bit activations compiles to the code it had before 8-bit
 * ones existed (their body choice per unit, made at run time, took 1-8% more time at 1-5 columns
 * with 16 bits: python bench/native_ab.py, 2-core Zen 4, Qwen2.5-Coder-1.5B q6_k split) */
INL void rows_body_bits(const bs_job * job, int bt, int rt, bool coarse, bool act8, int64_t r0, int64_t r1,
                        bs_scratch * scratch) {
    const int64_t K = job->K, nc = job->n_cols;
    if (nc < 1) {
        return;
    }
    const int qa = unit_of(bt, rt);
    const int ng = qa / 32;
    const size_t cb = int16_col_bytes(job);
    const int64_t nu = K / qa; /* units per row */
    uint8_t * mem = bs_scratch_get(scratch, (1 + 2 * TILE_ROWS) * sizeof(unit_buf) + (size_t)nc * TILE_ROWS * sizeof(__m256) +
                                                (size_t)(2 * nu) * sizeof(unit_sc) + 64);
    if (mem == NULL) {
        return; /* out of memory: bs_run_job reports it (scratch->failed) */
    }
    /* hr: TILE_ROWS buffers for the tiles' residual, then TILE_ROWS for their base (tiled_rows) */
    unit_buf * hb = (unit_buf *)mem, * hr = hb + 1;
    __m256 * tot = (__m256 *)(hr + 2 * TILE_ROWS);
    unit_sc * scb = (unit_sc *)(tot + (size_t)nc * TILE_ROWS), * scr = scb + nu; /* the fused path's scales per unit */
    const size_t bub = bt != T_NONE ? toff(bt, qa) : 0, rub = rt != T_NONE ? toff(rt, qa) : 0;
    /* superblock residuals (Q4_K-Q6_K: integer scales per 16 values); Q8_0 keeps one row at a time */
    if (nc >= TILE_MIN_COLS && bt == T_NONE && superblock(rt) && rt != T_Q2_K && !coarse) {
        tiled_rows(job, T_NONE, rt, false, r0, r1, NULL, hr, tot);
        r0 += (r1 - r0) / TILE_ROWS * TILE_ROWS; /* the rows left over: one at a time, below */
    }
#if !defined(BS_INT16_VNNI)
    /* 8-bit W2 + R, both halves superblock types, in the same tiles (TILE_MIN_COLS_WB) */
    if (nc >= TILE_MIN_COLS_WB && act8 && bt != T_NONE && superblock(bt) && superblock(rt) && rt != T_Q2_K && !coarse) {
        tiled_rows(job, bt, rt, true, r0, r1, hr + TILE_ROWS, hr, tot);
        r0 += (r1 - r0) / TILE_ROWS * TILE_ROWS;
    }
#endif
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t * brow = bt != T_NONE ? job->w2 + (size_t)r * job->w2_row_bytes : NULL;
        const uint8_t * rrow = rt != T_NONE ? job->r + (size_t)r * job->r_row_bytes : NULL;
        const uint8_t * bend = bt != T_NONE ? job->w2 + (size_t)r1 * job->w2_row_bytes : NULL;
        const uint8_t * rend = rt != T_NONE ? job->r + (size_t)r1 * job->r_row_bytes : NULL;
        /* a Q8_0 residual alone in pairs at every width: the buffered loop below took twice their
         * time from 8 columns (time pairs / buffered 0.75 / 0.51 / 0.47 / 0.48 at 8 / 12 / 16 / 32
         * columns with avx512vnni-int16, 0.67 / 0.47 / 0.50 at 8 / 16 / 32 with avx2-int16: python
         * bench/native_ab.py OLD.so NEW.so qwen-q8r --residual-only --kernel F --threads 1 --rounds 5,
         * a q8_0 split of Qwen2.5-Coder-1.5B, 2-core Zen 4, bit-identical) */
        const bool alone_q8 = bt == T_NONE && !superblock(rt);
        if (nc <= (bt == T_NONE ? FUSED_COLS_ALONE : FUSED_COLS) || alone_q8 || (bt != T_NONE && rt != T_NONE)) {
            /* straight from registers, two (FUSED_WIDE) columns at a time, each set over the whole
             * row (the row's blocks are in L1/L2 after the first): the set's totals are locals, kept
             * in registers across the units, instead of an array in memory stored and read back
             * every unit */
            for (int64_t c = 0; c < nc;) {
                const int64_t left = nc - c;
                /* with the base, up to FUSED_WIDE columns per decoding (8-bit W2 + R keeps pairs: its
                 * digit choice per column makes more bodies); the residual alone in sets of 4 where
                 * FUSED_ALONE_WIDE, a superblock type's (a Q8_0 residual's in sets of 4 took 1.52-1.73x
                 * the pairs' time at 3-6 columns: pairs) */
                const bool wide = FUSED_WIDE >= 4 && (bt != T_NONE ? !act8 : FUSED_ALONE_WIDE && superblock(rt));
                if (wide && left >= 4) {
                    fused_row(job, bt, rt, coarse, act8, r, c, 4, scb, scr, brow, rrow, bend, rend);
                    c += 4;
                } else if (wide && left == 3) {
                    fused_row(job, bt, rt, coarse, act8, r, c, 3, scb, scr, brow, rrow, bend, rend);
                    c += 3;
                } else if (left >= 2) {
                    fused_row(job, bt, rt, coarse, act8, r, c, 2, scb, scr, brow, rrow, bend, rend);
                    c += 2;
                } else {
                    fused_row(job, bt, rt, coarse, act8, r, c, 1, scb, scr, brow, rrow, bend, rend);
                    c += 1;
                }
            }
            continue;
        }
        for (int64_t c = 0; c < nc; c++) {
            tot[c] = _mm256_setzero_ps();
        }
        for (int64_t k0 = 0; k0 < K; k0 += qa) {
            const int64_t t = k0 / qa;
            const uint8_t * bp = bt != T_NONE ? brow + (size_t)t * bub : NULL;
            const uint8_t * rp = rt != T_NONE ? rrow + (size_t)t * rub : NULL;
            if (bt != T_NONE) bs_prefetch_ahead(bp, bub, bend);
            if (rt != T_NONE) bs_prefetch_ahead(rp, rub, rend);
            if (bt != T_NONE) decode_scales(bt, bp, &hb->sc);
            if (rt != T_NONE) decode_scales(rt, rp, &hr->sc);
            const __m256i Sb = bt != T_NONE ? hb->sc.S : _mm256_setzero_si256();
            const __m256i Sr = rt != T_NONE ? hr->sc.S : _mm256_setzero_si256();
            _Pragma("GCC unroll 8") for (int g = 0; g < ng; g++) {
                if (bt != T_NONE) decode_group(bt, bp, Sb, g, &hb->sc, &hb->u[g], &hb->q[g], &hb->G[g], &hb->D[g]);
                if (rt != T_NONE) decode_group(rt, rp, Sr, g, &hr->sc, &hr->u[g], &hr->q[g], &hr->G[g], &hr->D[g]);
            }
            const col_offs o = col_offs_at(K, k0, qa);
            const uint8_t * cp = (const uint8_t *)job->acts;
            for (int64_t c = 0; c < nc; c++, cp += cb) {
                const colp a = col_from(cp, &o);
                buffered_column(act8, bt, rt, ng, hb, hr, &a, coarse, &tot[c]);
            }
        }
        for (int64_t c = 0; c < nc; c++) {
            float * y = job->y + c * job->ldy + r;
            const float v = hsum8(tot[c]);
            *y = job->accumulate ? *y + v : v;
        }
    }
}

/* avx2-int16's rows (the plain compilation of this file), which the AVX-VNNI compilation calls for
 * the jobs where its own source would be the same (vnni_same_as_avx2) */
void bs_int16_avx2_rows(const bs_job * job, int64_t r0, int64_t r1, bs_scratch * scratch);

#if defined(BS_INT16_VNNI) && !defined(BS_INT16_EVEX)
/* Whether the AVX-VNNI compilation leaves this pair of types to avx2-int16's bodies: vpdpbusd /
 * vpdpwssd change only Q2_K's groups (its codes carry their scales) and the block-32 types' (Q8_0,
 * Q4_0, Q4_1: apply_group, decode_group); for every other pair this compilation's source is
 * avx2-int16's, the same intrinsics and the same results bit for bit, so its bodies are not
 * compiled twice (8.4 s of this file's 24 s at -O3 on a 2-core Zen 5). The machine code differs only
 * in register allocation: measured there, avxvnni-int16 with avx2-int16's bodies against its own
 * (python bench/native_ab.py, a synthetic split of 6 Q4_K + Q6_K weights of 2048 x 4096, one
 * process, 12-25 rounds, results bit-identical), time 0.99-1.04 at 1-5 columns for W2 + R with 16-
 * and 8-bit activations, 0.96-1.08 for R alone at 1-16, where the same library against a copy of
 * itself read 0.92-0.97: noise. */
static inline bool vnni_same_as_avx2(int bt, int rt) {
    const bool plain_b = bt == T_NONE || bt == T_Q3_K || bt == T_Q4_K || bt == T_Q5_K || bt == T_Q6_K;
    const bool plain_r = rt == T_NONE || rt == T_Q4_K || rt == T_Q5_K || rt == T_Q6_K;
    return plain_b && plain_r;
}
#endif

/* W2 + R compiled twice: with 16-bit activations and with 8 (job->act8) */
INL void rows_body(const bs_job * job, int bt, int rt, bool coarse, int64_t r0, int64_t r1, bs_scratch * scratch) {
#if defined(BS_INT16_VNNI) && !defined(BS_INT16_EVEX)
    if (vnni_same_as_avx2(bt, rt)) { /* a constant where inlined: the rest is not compiled */
        bs_int16_avx2_rows(job, r0, r1, scratch);
        return;
    }
#endif
    if (bt != T_NONE && rt != T_NONE && !coarse && job->act8) {
        rows_body_bits(job, bt, rt, coarse, true, r0, r1, scratch);
    } else {
        rows_body_bits(job, bt, rt, coarse, false, r0, r1, scratch);
    }
}

AVX2_ROW_BODIES

static void int16_rows(const bs_job * job, int64_t r0, int64_t r1, bs_scratch * scratch) {
    const avx2_rows_fn f = rows_for(job);
    if (f != NULL) f(job, r0, r1, scratch); /* int16_supports admitted the job */
}

#if !defined(BS_INT16_VNNI)
void bs_int16_avx2_rows(const bs_job * job, int64_t r0, int64_t r1, bs_scratch * scratch) {
    int16_rows(job, r0, r1, scratch);
}
#endif

#if defined(BS_INT16_EVEX)
/* AVX512-VNNI with VL and BW (EVEX vpdpbusd on 256-bit vectors) besides AVX2 + FMA + F16C */
static bool avx512_vnni_vl(void) { return bs_cpu_has(BS_CPU_NEED_AVX512VNNI_256); }

const bs_kernel_family bs_family_avx512vnni_int16 = {
    "avx512vnni-int16", BS_ISA_AVX512, avx512_vnni_vl, int16_supports, int16_acts_size, int16_prepare_acts, int16_rows,
    /* drafting (8-bit activations, up to 4 columns per decoding) from 1 column. Measured on a
     * 2-core Zen 4 (python bench/draft_speed.py SPLIT --repeat 7, then 9, Qwen2.5-Coder-1.5B's
     * Q2_K base, against ggml's kernels): native/ggml time 1.07 at 1 column, 0.83 / 0.72 at 2,
     * 0.70 / 0.71 at 3, 0.72 / 0.62 at 4 (vnni-int24, the drafter there before: 1.16 at 2, 0.98
     * at 3, 0.93 at 4); so from 2 columns, until the Q3_K scales were built in a vector
     * (q3k_scales.h). Measured again after (same command, the draft vocabulary on in the native
     * drafter's passes, so its head reads less): the 1-row pass 0.88 / 0.89 of ggml's with the
     * base's products left to ggml, 0.86 / 0.81 / 0.74 / 0.71 with this family taking them */
    1,
    /* avxvnni-int16's integers (so avx2-int16's results, bit for bit) with EVEX's 32 registers,
     * which let one decoding of a row serve 4 columns (FUSED_WIDE). Preferred where 512-bit
     * operations run at half rate (Zen 4), to 12 columns there (HR_INT16W_MAX in kernels.c); after
     * the full-rate AVX-512 families elsewhere, to 6 columns (not measured on such a CPU) */
    6,
    /* R alone: sets of 4 columns to 15 (FUSED_ALONE_WIDE), then tiles of 4 rows (TILE_MIN_COLS), to 32 */
    .alone_max_cols = 32,
    .exact_weights = true,
};
#elif defined(BS_INT16_VNNI)
/* AVX-VNNI (VEX vpdpbusd/vpdpwssd) besides AVX2 + FMA + F16C */
static bool avx2_vnni256(void) { return bs_cpu_has(BS_CPU_NEED_AVXVNNI); }

const bs_kernel_family bs_family_avxvnni_int16 = {
    "avxvnni-int16", BS_ISA_AVXVNNI, avx2_vnni256, int16_supports, int16_acts_size, int16_prepare_acts, int16_rows,
    /* drafting (8-bit activations) from 1 column, as avx2-int16 and avx512vnni-int16 (the same
     * code with vpdpbusd). Measured on a 2-core Zen 5 under BITSPLIT_MAX_ISA=avxvnni (python
     * bench/draft_speed.py SPLIT --repeat 9, Qwen2.5-Coder-1.5B's Q2_K base, against ggml's AVX-512
     * kernels), before the Q3_K scales were built in a vector: native/ggml time 1.10 at 1 column,
     * 0.79 at 2, 0.82 at 3, 0.75 at 4 (avx2-int16 there: 1.05, 0.74, 0.75, 0.70: the drafter is
     * not bound by its multiplies); not measured on an AVX-VNNI CPU since (avx2-int16's figures) */
    1,
    /* avx2-int16's integers with fewer instructions for the Q2_K half (2 instead of 6 per 32
     * weights and column); preferred up to 6 columns, as avx2-int16. Measured on a 2-core Zen 5,
     * Qwen2.5-Coder-1.5B q6_k split, W2 + R, both families in one process, interleaved (python
     * bench/residual_speed.py SPLIT --kernel avxvnni-int16,avx2-int16): time avx2-int16 /
     * avxvnni-int16 0.97 at 1 column, 1.06-1.08 at 2, 1.03 at 3, 1.06 at 4, 1.12 at 6, 1.09 at 8,
     * 0.98 at 16; R alone 0.97-1.05; time avx2-f32 / avxvnni-int16 2.09 at 1, 1.04 at 6, 0.76 at 8 */
    6,
    /* R alone: to 32 columns, as avx2-int16 (not measured on AVX-VNNI: the same products with
     * vpdpbusd in place of vpmaddubsw + vpmaddwd) */
    .alone_max_cols = 32,
    .exact_weights = true,
};
#else
const bs_kernel_family bs_family_avx2_int16 = {
    "avx2-int16", BS_ISA_AVX2, avx2_fma_f16c, int16_supports, int16_acts_size, int16_prepare_acts, int16_rows,
    /* drafting (8-bit activations) from 1 column. Measured on Qwen2.5-Coder-1.5B's Q2_K base, 2-core
     * Zen 3 (python bench/draft_speed.py SPLIT --repeat 9): native/ggml time 1.26 at 1 column, 1.00
     * at 2, 1.07 at 3, 0.92 at 4, so from 4 columns, before the Q3_K scales were built in a vector
     * (q3k_scales.h; not measured on a Zen 3 since). Measured after on a 2-core Zen 4 against ggml's
     * AVX2 kernels (bench/avx2_venv.sh, BITSPLIT_MAX_ISA=avx2, same command, the draft vocabulary
     * on in the native drafter's passes): the 1-row pass 0.91 of ggml's with the base's products
     * left to ggml, 0.71-0.75 (three runs) with this family taking them; 2 rows 0.88 and 0.48-0.49 */
    1,
    /* preferred up to 6 columns: per column it multiplies with vpmaddubsw/vpmaddwd, 8 per 32
     * weights of W2 + R, against avx2-f32's 4 FMAs on the summed weights, but decodes the weights
     * for much less. Measured on a 2-core Zen 3, Qwen2.5-Coder-1.5B q6_k split, W2 + R, both
     * families in one process, interleaved, 2 threads: time int16/f32 0.73 at 4 columns, 0.83-0.91
     * at 5, 0.90-0.96 at 6, 0.99 at 7, 1.12 at 8 (after the spill fix; before it the crossover was
     * 4: f32/int16 2.12 at 1 column, 1.41 at 2, 1.10 at 3, 1.04 at 4, 0.94 at 5) */
    6,
    /* R alone (add mode) takes one activation digit per block without an outlier, half the
     * multiplies: preferred up to 32 columns (a pinned family's limit). Measured on a 2-core Zen 3,
     * Qwen2.5-Coder-1.5B q6_k split (python bench/residual_speed.py SPLIT --residual-only --kernel
     * avx2-int16,avx2-f32): time f32/int16 1.54 at 6 columns, 1.18 at 8, 1.05 at 12, 1.18 at 16,
     * 1.12 at 24, 1.01 at 32, 0.87 at 64 */
    .alone_max_cols = 32,
    .exact_weights = true,
};
#endif /* BS_INT16_EVEX, BS_INT16_VNNI */

#endif /* __x86_64__ */
