/*
 * The AVX2 family ("avx2-f32"): AVX2 + FMA + F16C, the x86 desktop CPUs without AVX-512 (Zen 2/3,
 * Intel Haswell to 14th gen client), and every AVX-512 CPU too (for tests under BITSPLIT_MAX_ISA).
 *
 * Numerics: both halves are decoded to f32 and added, W = f32(W2) + f32(R), and multiplied with f32
 * activations, accumulated in f32 (eight lanes per column, reduced in a fixed order at the end of a
 * row). Weights and activations are kept to full f32 precision: more precise than bf16, no
 * activation blocks, so an outlier costs its neighbours nothing. Batch-invariant: each (row,
 * column) pair has its own accumulator and sees the same operations in the same order whatever the
 * batch, the thread split or the row grouping.
 *
 * Memory: 4 rows are decoded together, a chunk of KC values at a time, into a small f32 buffer
 * that stays in L1/L2; the buffer is then applied to every column (two columns per step, 4x2
 * accumulators in registers). Each weight block is read from memory once per product, whatever the
 * batch. Unpackers: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (superblocks of 256), Q8_0, Q4_0, Q4_1 (blocks
 * of 32): every type llama.cpp's Q2_K mix puts in a base and every quantized residual type; and
 * the IQ2_XXS / IQ2_XS / IQ3_S bases (split --base iq2_xxs|iq2_s), once this decoder agrees with
 * ggml's bit for bit (iq2.c); likewise the IQ1_M base (split --base iq1_m).
 */
#if defined(__x86_64__)

#define _GNU_SOURCE
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>


#include "bitsplit.h"
#include "bs_internal.h"

#define TGT __attribute__((target("avx2,fma,f16c")))
/* decoders are inlined into their two callers (store, add), so `add` is a constant there */
#define INL TGT static inline __attribute__((always_inline))
#define KC 1024 /* values per chunk (a multiple of 256): 4 rows x 4 KB of f32, in L1 */
#define RB 4    /* rows decoded together */
/* row stride of the decoded buffer: not a multiple of 4 KiB, so that loads of one row do not
 * falsely alias stores to another (4K aliasing) */
#define WS (KC + 16)


static size_t avx2_acts_size(const bs_job * job) {
    (void)job;
    return 0; /* activations are read as they are */
}

static void avx2_prepare_acts(const bs_job * job, int64_t c0, int64_t c1) {
    (void)job;
    (void)c0;
    (void)c1;
}

/* ---------------------------------------------------------------------------------------------
 * unpackers: a unit of weights (256 values, or 32 for the block-32 types when the row width is
 * not a multiple of 256) is prepared once (scales), then read as groups of 32 values, four f32
 * vectors each, W = D u + O per sub-block. Both halves of a group are decoded in registers and
 * added before anything is stored.
 * ------------------------------------------------------------------------------------------- */

#define AVX2_SAME_BASE_BODIES /* f32 arithmetic: no coarse variant */
#define AVX2_WITH_IQ2         /* this family decodes IQ2_XXS / IQ2_XS bases */
#include "avx2_quants.h"

/* group g as four f32 vectors, W = D u + O */
INL void grp(int t, const ustate * s, int g, __m256 v[4]) {
    float D0, O0, D1, O1;
    const __m256i u = gcodes(t, s, g, &D0, &O0, &D1, &O1);
    const __m128i lo = _mm256_castsi256_si128(u), hi = _mm256_extracti128_si256(u, 1);
    const __m256 d0 = _mm256_set1_ps(D0), o0 = _mm256_set1_ps(O0), d1 = _mm256_set1_ps(D1), o1 = _mm256_set1_ps(O1);
    v[0] = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), o0);
    v[1] = _mm256_fmadd_ps(d0, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), o0);
    v[2] = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), o1);
    v[3] = _mm256_fmadd_ps(d1, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), o1);
}

/* the combined weights W2 + R of one group of one row */
INL void wgroup(int bt, int rt, const ustate * sb, const ustate * sr, int g, __m256 w[4]) {
    if (bt != T_NONE && rt != T_NONE) {
        __m256 a[4], c[4];
        grp(bt, sb, g, a);
        grp(rt, sr, g, c);
        for (int i = 0; i < 4; i++) w[i] = _mm256_add_ps(a[i], c[i]);
    } else if (bt != T_NONE) {
        grp(bt, sb, g, w);
    } else {
        grp(rt, sr, g, w);
    }
}

/* one block of an IQ type as f32 through this family's decoder (the check against ggml) */
TGT static void avx2_deq_block(int t, const uint8_t * b, float * out) {
    ustate s;
    prep(t, &s, b);
    for (int g = 0; g < 8; g++) {
        __m256 v[4];
        grp(t, &s, g, v);
        for (int q = 0; q < 4; q++) _mm256_storeu_ps(out + 32 * g + 8 * q, v[q]);
    }
}

static void avx2_deq_iq(enum ggml_type type, const uint8_t * b, float * out) { avx2_deq_block(tcode(b, type), b, out); }

static bool avx2_iq2_ready, avx2_iq3s_ready, avx2_iq1m_ready;
static bs_once avx2_iq_once = BS_ONCE_INIT;

static void avx2_iq_init(void) {
    avx2_iq = bs_iq_get_tables();
    avx2_iq2_ready = avx2_iq->iq2_ok && bs_iq_decoder_agrees(GGML_TYPE_IQ2_XXS, avx2_deq_iq) &&
                     bs_iq_decoder_agrees(GGML_TYPE_IQ2_XS, avx2_deq_iq);
    avx2_iq3s_ready = avx2_iq->iq3s_ok && bs_iq_decoder_agrees(GGML_TYPE_IQ3_S, avx2_deq_iq);
    avx2_iq1m_ready = avx2_iq->iq1m_ok && bs_iq_decoder_agrees(GGML_TYPE_IQ1_M, avx2_deq_iq);
}

/* iq2.c's tables read and this family's decoder of the type checked against ggml (once; AVX2
 * CPUs only) */
static bool avx2_iq_ok(enum ggml_type type) {
    bs_once_run(&avx2_iq_once, avx2_iq_init);
    return type == GGML_TYPE_IQ3_S ? avx2_iq3s_ready : type == GGML_TYPE_IQ1_M ? avx2_iq1m_ready : avx2_iq2_ready;
}

static bool avx2_supports(const bs_job * job) {
    if (job->w2 != NULL &&
        (job->w2_type == GGML_TYPE_IQ2_XXS || job->w2_type == GGML_TYPE_IQ2_XS || job->w2_type == GGML_TYPE_IQ3_S ||
         job->w2_type == GGML_TYPE_IQ1_M)) {
        bs_job rest = *job; /* the precision and the residual as for any base */
        rest.w2 = NULL;
        return job->K % 256 == 0 && bs_f32_family_supports(&rest) && avx2_fma_f16c() && avx2_iq_ok(job->w2_type);
    }
    return bs_f32_family_supports(job);
}

/* ---------------------------------------------------------------------------------------------
 * products. The arithmetic of every (row, column): W2 + R per 8 values as above, then
 * acc = fma(w, x, acc) over k in order, one 8-lane accumulator, reduced in a fixed order at the
 * end. Batches of 1 compute it straight from the decoded registers; larger batches store a chunk
 * of decoded rows and apply it to every column (the same operations, so the same results).
 * ------------------------------------------------------------------------------------------- */

/* decode rows [r, r + nr) x values [k0, k0 + n) into w (row stride WS) */
INL void decode_rows(const bs_job * job, int bt, int rt, int unit, int64_t r, int nr, int64_t k0, int64_t n, float * w) {
    for (int i = 0; i < nr; i++) {
        const uint8_t * brow = bt != T_NONE ? job->w2 + (size_t)(r + i) * job->w2_row_bytes : NULL;
        const uint8_t * rrow = rt != T_NONE ? job->r + (size_t)(r + i) * job->r_row_bytes : NULL;
        float * out = w + (size_t)i * WS;
        for (int64_t k = 0; k < n; k += unit) {
            ustate sb, sr;
            if (bt != T_NONE) prep(bt, &sb, brow + toff(bt, k0 + k));
            if (rt != T_NONE) prep(rt, &sr, rrow + toff(rt, k0 + k));
            /* unrolled: the group index makes every shift and offset a constant */
            _Pragma("GCC unroll 8") for (int g = 0; g < unit / 32; g++) {
                __m256 v[4];
                wgroup(bt, rt, &sb, &sr, g, v);
                for (int q = 0; q < 4; q++) _mm256_store_ps(out + k + 32 * g + 8 * q, v[q]);
            }
        }
    }
}

/* one column: acc[i] += W[r + i] . x over [k0, k0 + n), rows interleaved (independent chains) */
INL void dot_rows(const bs_job * job, int bt, int rt, int unit, int64_t r, int nr, int64_t k0, int64_t n,
                  const float * x, __m256 * acc) {
    const uint8_t * brow[RB] = {0}, * rrow[RB] = {0};
    __m256 a[RB];
    for (int i = 0; i < nr; i++) {
        if (bt != T_NONE) brow[i] = job->w2 + (size_t)(r + i) * job->w2_row_bytes;
        if (rt != T_NONE) rrow[i] = job->r + (size_t)(r + i) * job->r_row_bytes;
        a[i] = acc[i];
    }
    for (int64_t k = 0; k < n; k += unit) {
        ustate sb[RB], sr[RB];
        for (int i = 0; i < nr; i++) {
            if (bt != T_NONE) prep(bt, &sb[i], brow[i] + toff(bt, k0 + k));
            if (rt != T_NONE) prep(rt, &sr[i], rrow[i] + toff(rt, k0 + k));
        }
        _Pragma("GCC unroll 8") for (int g = 0; g < unit / 32; g++) {
            const float * xg = x + k + 32 * g;
            for (int i = 0; i < nr; i++) {
                __m256 v[4];
                wgroup(bt, rt, &sb[i], &sr[i], g, v);
                for (int q = 0; q < 4; q++) a[i] = _mm256_fmadd_ps(v[q], _mm256_loadu_ps(xg + 8 * q), a[i]);
            }
        }
    }
    for (int i = 0; i < nr; i++) acc[i] = a[i];
}

/* acc[r][c] += W[r][0..n) * x[c][0..n) for NR rows (stride WS in w) and NC columns */
#define MICRO(NR, NC)                                                                              \
    TGT static inline void micro_##NR##_##NC(const float * w, const float * const * xc, int64_t n, \
                                             __m256 * acc, int64_t acc_stride) {                   \
        __m256 a[NR][NC];                                                                          \
        for (int r = 0; r < NR; r++)                                                               \
            for (int c = 0; c < NC; c++) a[r][c] = acc[r * acc_stride + c];                        \
        for (int64_t k = 0; k < n; k += 8) {                                                       \
            __m256 wv[NR];                                                                         \
            for (int r = 0; r < NR; r++) {                                                         \
                wv[r] = _mm256_load_ps(w + r * WS + k);                                            \
                /* keep it in a register: folded into each FMA it would be loaded once per column */ \
                __asm__("" : "+x"(wv[r]));                                                         \
            }                                                                                      \
            for (int c = 0; c < NC; c++) {                                                         \
                const __m256 xv = _mm256_loadu_ps(xc[c] + k);                                      \
                for (int r = 0; r < NR; r++) a[r][c] = _mm256_fmadd_ps(wv[r], xv, a[r][c]);         \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < NR; r++)                                                               \
            for (int c = 0; c < NC; c++) acc[r * acc_stride + c] = a[r][c];                        \
    }
MICRO(4, 2)
MICRO(4, 1)
MICRO(1, 2)
MICRO(1, 1)

/* Ask for the next chunk's weights while this one is computed: the rows are read a chunk at a
 * time, several rows side by side, a pattern the hardware prefetchers follow too late (measured:
 * most of the time stalled on the first touch of each block without it). */
INL void prefetch_chunk(const bs_job * job, int bt, int rt, int64_t r, int nr, int64_t k0, int64_t n) {
    for (int h = 0; h < 2; h++) {
        const int t = h == 0 ? bt : rt;
        if (t == T_NONE) continue;
        const uint8_t * base = h == 0 ? job->w2 : job->r;
        const size_t rb = h == 0 ? job->w2_row_bytes : job->r_row_bytes;
        const size_t off = toff(t, k0), len = toff(t, n);
        for (int i = 0; i < nr; i++) {
            const uint8_t * p = base + (size_t)(r + i) * rb + off;
            for (size_t o = 0; o < len; o += 64) {
                _mm_prefetch((const char *)(p + o), _MM_HINT_T0);
            }
        }
    }
}

INL void rows_body(const bs_job * job, int bt, int rt, bool coarse, int64_t r0, int64_t r1, bs_scratch * scratch) {
    (void)coarse; /* f32 arithmetic: the drafter's and the verifier's are one */
    const int64_t K = job->K, nc = job->n_cols;
    if (nc < 1) {
        return;
    }
    /* units of 256 values where a superblock type is involved (then K % 256 == 0), else of 32 */
    const int unit = unit_of(bt, rt);
    /* scratch: the decoded chunk (RB rows x KC, 32-byte aligned), then RB x nc accumulators */
    const size_t wbytes = nc > 1 ? (size_t)RB * WS * sizeof(float) : 0;
    uint8_t * mem = bs_scratch_get(scratch, wbytes + (size_t)RB * (size_t)(nc > 0 ? nc : 1) * sizeof(__m256) + 64);
    if (mem == NULL) {
        return; /* out of memory: bs_run_job reports it (scratch->failed) */
    }
    float * w = (float *)mem;
    __m256 * acc = (__m256 *)(mem + wbytes);
    const float * xc[2];
    for (int64_t r = r0; r < r1; r += RB) {
        const int nr = r1 - r >= RB ? RB : (int)(r1 - r);
        for (int64_t i = 0; i < (int64_t)nr * nc; i++) {
            acc[i] = _mm256_setzero_ps();
        }
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t n = K - k0 < KC ? K - k0 : KC;
            if (k0 + KC < K) {
                prefetch_chunk(job, bt, rt, r, nr, k0 + KC, K - k0 - KC < KC ? K - k0 - KC : KC);
            } else if (r + RB < r1) {
                prefetch_chunk(job, bt, rt, r + RB, r1 - r - RB >= RB ? RB : (int)(r1 - r - RB), 0, K < KC ? K : KC);
            }
            if (nc == 1) { /* constant row counts, so the accumulators stay in registers */
                /* two rows at a time: two independent chains, and few enough live registers */
                int i = 0;
                for (; i + 2 <= nr; i += 2) dot_rows(job, bt, rt, unit, r + i, 2, k0, n, job->x + k0, acc + i);
                if (i < nr) dot_rows(job, bt, rt, unit, r + i, 1, k0, n, job->x + k0, acc + i);
                continue;
            }
            if (nr == RB) {
                decode_rows(job, bt, rt, unit, r, RB, k0, n, w);
            } else {
                for (int i = 0; i < nr; i++) decode_rows(job, bt, rt, unit, r + i, 1, k0, n, w + (size_t)i * WS);
            }
            int64_t c = 0;
            for (; c + 2 <= nc; c += 2) {
                xc[0] = job->x + c * job->ldx + k0;
                xc[1] = job->x + (c + 1) * job->ldx + k0;
                if (nr == RB) {
                    micro_4_2(w, xc, n, acc + c, nc);
                } else {
                    for (int i = 0; i < nr; i++) micro_1_2(w + i * WS, xc, n, acc + i * nc + c, nc);
                }
            }
            if (c < nc) {
                xc[0] = job->x + c * job->ldx + k0;
                if (nr == RB) {
                    micro_4_1(w, xc, n, acc + c, nc);
                } else {
                    for (int i = 0; i < nr; i++) micro_1_1(w + i * WS, xc, n, acc + i * nc + c, nc);
                }
            }
        }
        for (int i = 0; i < nr; i++) {
            for (int64_t cc = 0; cc < nc; cc++) {
                float * y = job->y + cc * job->ldy + r + i;
                const float v = hsum8(acc[i * nc + cc]);
                *y = job->accumulate ? *y + v : v;
            }
        }
    }
}

AVX2_ROW_BODIES

static void avx2_rows(const bs_job * job, int64_t r0, int64_t r1, bs_scratch * scratch) {
    const avx2_rows_fn f = rows_for(job);
    if (f != NULL) f(job, r0, r1, scratch); /* avx2_supports admitted the job */
}

const bs_kernel_family bs_family_avx2_f32 = {
    "avx2-f32", BS_ISA_AVX2, avx2_fma_f16c, avx2_supports, avx2_acts_size, avx2_prepare_acts, avx2_rows,
    0, /* not a drafter: no measurement yet that it beats llama.cpp's Q2_K kernel at draft batches */
    .exact_weights = true,
};

#endif /* __x86_64__ */
