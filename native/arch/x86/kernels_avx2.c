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
 * of 32): every type llama.cpp's Q2_K mix puts in a base and every quantized residual type.
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

static int cpu_avx2 = -1;

static bool avx2_cpu(void) {
    if (cpu_avx2 < 0) {
        __builtin_cpu_init();
        cpu_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    }
    return cpu_avx2 == 1;
}

static bool block32_type(enum ggml_type t) {
    return t == GGML_TYPE_Q8_0 || t == GGML_TYPE_Q4_0 || t == GGML_TYPE_Q4_1;
}

static bool superblock_type(enum ggml_type t) {
    return t == GGML_TYPE_Q2_K || t == GGML_TYPE_Q3_K || t == GGML_TYPE_Q4_K || t == GGML_TYPE_Q5_K ||
           t == GGML_TYPE_Q6_K;
}

static bool type_ok(enum ggml_type t, int64_t K) {
    return (superblock_type(t) && K % 256 == 0) || (block32_type(t) && K % 32 == 0);
}

static bool avx2_supports(const bs_job * job) {
    if (job->precision == BITSPLIT_PREC_F32) {
        return false; /* the exact f32 contract belongs to the generic family (tests compare bit for bit) */
    }
    if (job->r != NULL && job->r_type != GGML_TYPE_Q6_K && job->r_type != GGML_TYPE_Q8_0) {
        return false;
    }
    return (job->r == NULL || type_ok(job->r_type, job->K)) && (job->w2 == NULL || type_ok(job->w2_type, job->K));
}

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

enum { T_NONE, T_Q2_K, T_Q3_K, T_Q4_K, T_Q5_K, T_Q6_K, T_Q8_0, T_Q4_0, T_Q4_1, T_COUNT };

static int tcode(const uint8_t * data, enum ggml_type t) {
    if (data == NULL) return T_NONE;
    switch (t) {
        case GGML_TYPE_Q2_K: return T_Q2_K;
        case GGML_TYPE_Q3_K: return T_Q3_K;
        case GGML_TYPE_Q4_K: return T_Q4_K;
        case GGML_TYPE_Q5_K: return T_Q5_K;
        case GGML_TYPE_Q6_K: return T_Q6_K;
        case GGML_TYPE_Q8_0: return T_Q8_0;
        case GGML_TYPE_Q4_0: return T_Q4_0;
        case GGML_TYPE_Q4_1: return T_Q4_1;
        default: return -1;
    }
}

/* elements per block and bytes per block of each code */
static const int T_BLCK[T_COUNT] = {1, 256, 256, 256, 256, 256, 32, 32, 32};
static const int T_SIZE[T_COUNT] = {0, 84, 110, 144, 176, 210, 34, 18, 20};

typedef struct {
    const uint8_t * p;  /* the unit's first byte */
    float D[16], O[16]; /* per sub-block scale and offset (superblock types) */
} ustate;

TGT static inline float h2f(const uint8_t * p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

INL __m256i srl8(__m256i v, int n) { return _mm256_srli_epi16(v, n); }

/* D[j] = d * s[j], O[j] = z * D[j] for 16 signed byte scales */
INL void scales16(__m128i v, float d, float z, float * D, float * O) {
    const __m256 dd = _mm256_set1_ps(d), zz = _mm256_set1_ps(z);
    const __m256 a = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
    const __m256 b = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))));
    _mm256_storeu_ps(D, a);
    _mm256_storeu_ps(D + 8, b);
    _mm256_storeu_ps(O, _mm256_mul_ps(zz, a));
    _mm256_storeu_ps(O + 8, _mm256_mul_ps(zz, b));
}

static inline void scale_min_k4(int j, const uint8_t * q, uint8_t * d, uint8_t * m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
    }
}

INL void prep(int t, ustate * s, const uint8_t * b) {
    s->p = b;
    switch (t) {
        case T_Q2_K: { /* scales: low nibbles x d; mins: high nibbles x -dmin */
            const __m128i v = _mm_loadu_si128((const __m128i *)b), m4 = _mm_set1_epi8(0x0F);
            float unused[16];
            scales16(_mm_and_si128(v, m4), h2f(b + 80), 0.0f, s->D, unused);
            scales16(_mm_and_si128(_mm_srli_epi16(v, 4), m4), -h2f(b + 82), 0.0f, s->O, unused);
            break;
        }
        case T_Q3_K: {
            int8_t sc[16];
            bs_q3k_scales(b + 96, sc);
            scales16(_mm_sub_epi8(_mm_loadu_si128((const __m128i *)sc), _mm_set1_epi8(32)), h2f(b + 108), -4.0f,
                     s->D, s->O);
            break;
        }
        case T_Q4_K:
        case T_Q5_K: { /* 8 sub-blocks of 32 */
            const float d = h2f(b), dmin = h2f(b + 2);
            for (int j = 0; j < 8; j++) {
                uint8_t sc, m;
                scale_min_k4(j, b + 4, &sc, &m);
                s->D[j] = d * (float)sc;
                s->O[j] = -dmin * (float)m;
            }
            break;
        }
        case T_Q6_K:
            scales16(_mm_loadu_si128((const __m128i *)(b + 192)), h2f(b + 208), -32.0f, s->D, s->O);
            break;
        default:
            break; /* block-32 types read their scale per group */
    }
}

/* four vectors from 32 byte codes: two sub-blocks of 16 (D, O indexed j, j + 1) */
INL void four16(__m256i u, const float * D, const float * O, int j, __m256 v[4]) {
    const __m128i lo = _mm256_castsi256_si128(u), hi = _mm256_extracti128_si256(u, 1);
    const __m256 D0 = _mm256_broadcast_ss(D + j), O0 = _mm256_broadcast_ss(O + j);
    const __m256 D1 = _mm256_broadcast_ss(D + j + 1), O1 = _mm256_broadcast_ss(O + j + 1);
    v[0] = _mm256_fmadd_ps(D0, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), O0);
    v[1] = _mm256_fmadd_ps(D0, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), O0);
    v[2] = _mm256_fmadd_ps(D1, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), O1);
    v[3] = _mm256_fmadd_ps(D1, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), O1);
}

/* four vectors from 32 byte codes sharing one scale */
INL void four32(__m256i u, __m256 D, __m256 O, __m256 v[4]) {
    const __m128i lo = _mm256_castsi256_si128(u), hi = _mm256_extracti128_si256(u, 1);
    v[0] = _mm256_fmadd_ps(D, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), O);
    v[1] = _mm256_fmadd_ps(D, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), O);
    v[2] = _mm256_fmadd_ps(D, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), O);
    v[3] = _mm256_fmadd_ps(D, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), O);
}

/* group g (values 32g .. 32g + 31 of the unit) */
INL void grp(int t, const ustate * s, int g, __m256 v[4]) {
    const uint8_t * b = s->p;
    switch (t) {
        case T_Q2_K: { /* value 128n + 32j + l: bits 2j of qs[32n + l] */
            const int n = g >> 2, j = g & 3;
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * n));
            four16(_mm256_and_si256(srl8(q, 2 * j), _mm256_set1_epi8(3)), s->D, s->O, 8 * n + 2 * j, v);
            break;
        }
        case T_Q3_K: { /* + 4 where the hmask bit (4n + j) is set */
            const int n = g >> 2, j = g & 3;
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * n));
            const __m256i hm = _mm256_loadu_si256((const __m256i *)b);
            const __m256i bit = _mm256_set1_epi8((char)(1u << (4 * n + j)));
            const __m256i hset = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
            const __m256i u = _mm256_add_epi8(_mm256_and_si256(srl8(q, 2 * j), _mm256_set1_epi8(3)),
                                              _mm256_and_si256(hset, _mm256_set1_epi8(4)));
            four16(u, s->D, s->O, 8 * n + 2 * j, v);
            break;
        }
        case T_Q4_K:
        case T_Q5_K: { /* value 64z + l: low nibble of qs[32z + l]; 64z + 32 + l: high nibble */
            const bool q5 = t == T_Q5_K;
            const int z = g >> 1, hi = g & 1;
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b + (q5 ? 48 : 16) + 32 * z));
            __m256i u = _mm256_and_si256(hi ? srl8(q, 4) : q, _mm256_set1_epi8(0x0F));
            if (q5) {
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
                const __m256i bit = _mm256_set1_epi8((char)(1u << g));
                u = _mm256_add_epi8(u, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit),
                                                        _mm256_set1_epi8(16)));
            }
            four32(u, _mm256_broadcast_ss(s->D + g), _mm256_broadcast_ss(s->O + g), v);
            break;
        }
        case T_Q6_K: { /* value 128n + 32m + l: nibble of ql[64n + 32(m&1) + l], 2 bits of qh[32n + l] */
            const int n = g >> 2, m = g & 3;
            const __m256i l = _mm256_loadu_si256((const __m256i *)(b + 64 * n + 32 * (m & 1)));
            const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n));
            const __m256i lo = _mm256_and_si256(m >= 2 ? srl8(l, 4) : l, _mm256_set1_epi8(0x0F));
            const __m256i hb = _mm256_slli_epi16(_mm256_and_si256(srl8(h, 2 * m), _mm256_set1_epi8(3)), 4);
            four16(_mm256_or_si256(lo, hb), s->D, s->O, 8 * n + 2 * m, v);
            break;
        }
        case T_Q8_0: { /* W = d q */
            const uint8_t * blk = b + 34 * g;
            const __m256 D = _mm256_set1_ps(h2f(blk));
            const __m256i q = _mm256_loadu_si256((const __m256i *)(blk + 2));
            const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
            v[0] = _mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)));
            v[1] = _mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))));
            v[2] = _mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)));
            v[3] = _mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))));
            break;
        }
        case T_Q4_0:
        case T_Q4_1: { /* Q4_0: W = d (q - 8); Q4_1: W = d q + m; low nibbles are values 0..15 */
            const bool q41 = t == T_Q4_1;
            const uint8_t * blk = b + (q41 ? 20 : 18) * g;
            const float d = h2f(blk);
            const __m128i q = _mm_loadu_si128((const __m128i *)(blk + (q41 ? 4 : 2)));
            const __m128i m4 = _mm_set1_epi8(0x0F);
            const __m256i u = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
            four32(u, _mm256_set1_ps(d), _mm256_set1_ps(q41 ? h2f(blk + 2) : -8.0f * d), v);
            break;
        }
        default:
            break;
    }
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

INL size_t toff(int t, int64_t k) { return (size_t)(k / T_BLCK[t]) * (size_t)T_SIZE[t]; }

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

TGT static inline float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

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

INL void rows_body(const bs_job * job, int bt, int rt, int64_t r0, int64_t r1, bs_scratch * scratch) {
    const int64_t K = job->K, nc = job->n_cols;
    if (nc < 1) {
        return;
    }
    /* units of 256 values where a superblock type is involved (then K % 256 == 0), else of 32 */
    const int unit = (T_BLCK[bt] == 256 || T_BLCK[rt] == 256) ? 256 : 32;
    /* scratch: the decoded chunk (RB rows x KC, 32-byte aligned), then RB x nc accumulators */
    const size_t wbytes = nc > 1 ? (size_t)RB * WS * sizeof(float) : 0;
    uint8_t * mem = bs_scratch_get(scratch, wbytes + (size_t)RB * (size_t)(nc > 0 ? nc : 1) * sizeof(__m256) + 64);
    if (mem == NULL) {
        return; /* the caller checked capacity before; cannot happen */
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

/* one compiled body per (base type, residual type): the decoders' switches fold away */
typedef void (*rows_fn)(const bs_job *, int64_t, int64_t, bs_scratch *);
#define BODY(B, R) \
    TGT static void rows_##B##_##R(const bs_job * j, int64_t r0, int64_t r1, bs_scratch * s) { rows_body(j, B, R, r0, r1, s); }
#define BODIES(B) BODY(B, T_NONE) BODY(B, T_Q6_K) BODY(B, T_Q8_0)
BODIES(T_Q2_K) BODIES(T_Q3_K) BODIES(T_Q4_K) BODIES(T_Q5_K) BODIES(T_Q6_K) BODIES(T_Q8_0) BODIES(T_Q4_0) BODIES(T_Q4_1)
BODY(T_NONE, T_Q6_K) BODY(T_NONE, T_Q8_0)
#define ROW(B) {NULL, rows_##B##_T_NONE, rows_##B##_T_Q6_K, rows_##B##_T_Q8_0}
/* [base code][0: unused, 1: no residual, 2: Q6_K residual, 3: Q8_0 residual] */
static const rows_fn BODY_TABLE[T_COUNT][4] = {
    {NULL, NULL, rows_T_NONE_T_Q6_K, rows_T_NONE_T_Q8_0},
    ROW(T_Q2_K), ROW(T_Q3_K), ROW(T_Q4_K), ROW(T_Q5_K), ROW(T_Q6_K), ROW(T_Q8_0), ROW(T_Q4_0), ROW(T_Q4_1),
};

static rows_fn body_for(const bs_job * job) {
    const int bt = tcode(job->w2, job->w2_type), rt = tcode(job->r, job->r_type);
    const int col = rt == T_NONE ? 1 : rt == T_Q6_K ? 2 : rt == T_Q8_0 ? 3 : -1;
    if (bt < 0 || col < 0) return NULL;
    return BODY_TABLE[bt][col];
}

static void avx2_rows(const bs_job * job, int64_t r0, int64_t r1, bs_scratch * scratch) {
    const rows_fn f = body_for(job);
    if (f != NULL) f(job, r0, r1, scratch); /* avx2_supports admitted the job */
}

const bs_kernel_family bs_family_avx2_f32 = {
    "avx2-f32", BS_ISA_AVX2, avx2_cpu, avx2_supports, avx2_acts_size, avx2_prepare_acts, avx2_rows,
};

#endif /* __x86_64__ */
