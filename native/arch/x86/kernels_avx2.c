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
 * unpackers: one block to f32, stored (add = false) or added to what is there (add = true)
 * ------------------------------------------------------------------------------------------- */

TGT static inline float h2f(const uint8_t * p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* out[0..7] (+)= D * u + O for 8 unsigned byte codes */
INL void put8(float * out, __m128i u8, __m256 D, __m256 O, bool add) {
    const __m256 v = _mm256_fmadd_ps(D, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(u8)), O);
    _mm256_storeu_ps(out, add ? _mm256_add_ps(_mm256_loadu_ps(out), v) : v);
}

/* 16 codes (one sub-block of 16) from the low 128 bits of a */
INL void put16(float * out, __m128i a, __m256 D, __m256 O, bool add) {
    put8(out, a, D, O, add);
    put8(out + 8, _mm_srli_si128(a, 8), D, O, add);
}

/* 32 codes of one sub-block of 32 */
INL void put32(float * out, __m256i a, __m256 D, __m256 O, bool add) {
    put16(out, _mm256_castsi256_si128(a), D, O, add);
    put16(out + 16, _mm256_extracti128_si256(a, 1), D, O, add);
}

/* 32 codes that are two sub-blocks of 16 with their own scales */
INL void put2x16(float * out, __m256i a, const float * D, const float * O, bool add) {
    put16(out, _mm256_castsi256_si128(a), _mm256_broadcast_ss(D), _mm256_broadcast_ss(O), add);
    put16(out + 16, _mm256_extracti128_si256(a, 1), _mm256_broadcast_ss(D + 1), _mm256_broadcast_ss(O + 1), add);
}

/* D[j] = d * s[j], O[j] = z * D[j] for 16 sub-block scales (signed bytes), vectorised */
INL void scales16(const int8_t * s, float d, float z, float * D, float * O) {
    const __m128i v = _mm_loadu_si128((const __m128i *)s);
    const __m256 dd = _mm256_set1_ps(d), zz = _mm256_set1_ps(z);
    const __m256 a = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
    const __m256 b = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))));
    _mm256_storeu_ps(D, a);
    _mm256_storeu_ps(D + 8, b);
    _mm256_storeu_ps(O, _mm256_mul_ps(zz, a));
    _mm256_storeu_ps(O + 8, _mm256_mul_ps(zz, b));
}

TGT static inline __m256i srl8(__m256i v, int n) { return _mm256_srli_epi16(v, n); }

/* Q2_K (84 bytes): element 128n + 32j + l is bits 2j of qs[32n + l]; scale/min nibbles per 16 */
INL void deq_q2_K(const uint8_t * b, float * out, bool add) {
    const uint8_t * sc = b;
    const uint8_t * qs = b + 16;
    const float d = h2f(b + 80), dmin = h2f(b + 82);
    const __m256i m3 = _mm256_set1_epi8(3);
    /* scales (low nibbles) and mins (high nibbles), 16 each */
    float D[16], O[16], M[16];
    {
        const __m128i v = _mm_loadu_si128((const __m128i *)sc), m4 = _mm_set1_epi8(0x0F);
        int8_t lo[16], hi[16];
        _mm_storeu_si128((__m128i *)lo, _mm_and_si128(v, m4));
        _mm_storeu_si128((__m128i *)hi, _mm_and_si128(_mm_srli_epi16(v, 4), m4));
        scales16(lo, d, 0.0f, D, O);
        scales16(hi, -dmin, 0.0f, M, O);
    }
    for (int n = 0; n < 2; n++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * n));
        for (int j = 0; j < 4; j++) {
            const int s = 8 * n + 2 * j;
            const __m256i u = _mm256_and_si256(srl8(q, 2 * j), m3);
            put2x16(out + 128 * n + 32 * j, u, D + s, M + s, add);
        }
    }
}

/* Q3_K (110 bytes): u = 2 bits of qs + 4 * (bit of hmask), W = d (sc - 32) (u - 4) */
INL void deq_q3_K(const uint8_t * b, float * out, bool add) {
    int8_t sc[16];
    bs_q3k_scales(b + 96, sc);
    const float d = h2f(b + 108);
    float D[16], O[16];
    {
        const __m128i v = _mm_sub_epi8(_mm_loadu_si128((const __m128i *)sc), _mm_set1_epi8(32));
        int8_t s32[16];
        _mm_storeu_si128((__m128i *)s32, v);
        scales16(s32, d, -4.0f, D, O);
    }
    const __m256i hm = _mm256_loadu_si256((const __m256i *)b);
    const uint8_t * qs = b + 32;
    const __m256i m3 = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    for (int n = 0; n < 2; n++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * n));
        for (int j = 0; j < 4; j++) {
            const int s = 8 * n + 2 * j;
            const __m256i bit = _mm256_set1_epi8((char)(1u << (4 * n + j)));
            const __m256i hset = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
            const __m256i u = _mm256_add_epi8(_mm256_and_si256(srl8(q, 2 * j), m3), _mm256_and_si256(hset, four));
            put2x16(out + 128 * n + 32 * j, u, D + s, O + s, add);
        }
    }
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

/* Q4_K (144 bytes) / Q5_K (176): element 64z + l is the low nibble of qs[32z + l] (sub-block 2z),
 * 64z + 32 + l its high nibble (2z + 1); Q5_K adds 16 for bit 2z (2z + 1) of qh[l] */
INL void deq_q45_K(const uint8_t * b, float * out, bool q5, bool add) {
    const float d = h2f(b), dmin = h2f(b + 2);
    const uint8_t * scales = b + 4;
    const uint8_t * qs = b + (q5 ? 48 : 16);
    const __m256i m4 = _mm256_set1_epi8(0x0F), sixteen = _mm256_set1_epi8(16);
    const __m256i qh = q5 ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
    for (int z = 0; z < 4; z++) {
        uint8_t s0, m0, s1, m1;
        scale_min_k4(2 * z, scales, &s0, &m0);
        scale_min_k4(2 * z + 1, scales, &s1, &m1);
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * z));
        __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(srl8(q, 4), m4);
        if (q5) {
            const __m256i b0 = _mm256_set1_epi8((char)(1u << (2 * z))), b1 = _mm256_set1_epi8((char)(2u << (2 * z)));
            lo = _mm256_add_epi8(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b0), b0), sixteen));
            hi = _mm256_add_epi8(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, b1), b1), sixteen));
        }
        put32(out + 64 * z, lo, _mm256_set1_ps(d * (float)s0), _mm256_set1_ps(-dmin * (float)m0), add);
        put32(out + 64 * z + 32, hi, _mm256_set1_ps(d * (float)s1), _mm256_set1_ps(-dmin * (float)m1), add);
    }
}

/* Q6_K (210 bytes): ql[128], qh[64], scales[16] (int8), d; W = d sc (u - 32), sub-blocks of 16 */
INL void deq_q6_K(const uint8_t * b, float * out, bool add) {
    float D[16], O[16];
    scales16((const int8_t *)(b + 192), h2f(b + 208), -32.0f, D, O);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
    for (int n = 0; n < 2; n++) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + 64 * n));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(b + 64 * n + 32));
        const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n));
        const __m256i u[4] = {
            _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(h, m3), 4)),
            _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(srl8(h, 2), m3), 4)),
            _mm256_or_si256(_mm256_and_si256(srl8(l0, 4), m4), _mm256_slli_epi16(_mm256_and_si256(srl8(h, 4), m3), 4)),
            _mm256_or_si256(_mm256_and_si256(srl8(l1, 4), m4), _mm256_slli_epi16(_mm256_and_si256(srl8(h, 6), m3), 4)),
        };
        for (int m = 0; m < 4; m++) {
            const int s = 8 * n + 2 * m;
            put2x16(out + 128 * n + 32 * m, u[m], D + s, O + s, add);
        }
    }
}

/* Q8_0 (34 bytes per 32): W = d q */
INL void deq_q8_0(const uint8_t * b, float * out, bool add) {
    const __m256 D = _mm256_set1_ps(h2f(b));
    for (int i = 0; i < 32; i += 8) {
        const __m128i q = _mm_loadl_epi64((const __m128i *)(b + 2 + i));
        const __m256 v = _mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
        _mm256_storeu_ps(out + i, add ? _mm256_add_ps(_mm256_loadu_ps(out + i), v) : v);
    }
}

/* Q4_0 (18 bytes per 32): W = d (q - 8); Q4_1 (20 bytes): W = d q + m; low nibbles first */
INL void deq_q4_01(const uint8_t * b, float * out, bool q41, bool add) {
    const float d = h2f(b);
    const __m256 D = _mm256_set1_ps(d), O = _mm256_set1_ps(q41 ? h2f(b + 2) : -8.0f * d);
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + (q41 ? 4 : 2)));
    const __m128i m4 = _mm_set1_epi8(0x0F);
    put16(out, _mm_and_si128(q, m4), D, O, add);
    put16(out + 16, _mm_and_si128(_mm_srli_epi16(q, 4), m4), D, O, add);
}

/* values [k0, k0 + n) of a row (k0 and n multiples of the type's block) to f32 */
INL void deq_range_any(enum ggml_type type, const uint8_t * row, int64_t k0, int64_t n, float * out, bool add) {
    switch (type) {
        case GGML_TYPE_Q2_K:
            for (int64_t i = 0; i < n; i += 256) deq_q2_K(row + (size_t)((k0 + i) / 256) * 84, out + i, add);
            break;
        case GGML_TYPE_Q3_K:
            for (int64_t i = 0; i < n; i += 256) deq_q3_K(row + (size_t)((k0 + i) / 256) * 110, out + i, add);
            break;
        case GGML_TYPE_Q4_K:
            for (int64_t i = 0; i < n; i += 256) deq_q45_K(row + (size_t)((k0 + i) / 256) * 144, out + i, false, add);
            break;
        case GGML_TYPE_Q5_K:
            for (int64_t i = 0; i < n; i += 256) deq_q45_K(row + (size_t)((k0 + i) / 256) * 176, out + i, true, add);
            break;
        case GGML_TYPE_Q6_K:
            for (int64_t i = 0; i < n; i += 256) deq_q6_K(row + (size_t)((k0 + i) / 256) * 210, out + i, add);
            break;
        case GGML_TYPE_Q8_0:
            for (int64_t i = 0; i < n; i += 32) deq_q8_0(row + (size_t)((k0 + i) / 32) * 34, out + i, add);
            break;
        case GGML_TYPE_Q4_0:
            for (int64_t i = 0; i < n; i += 32) deq_q4_01(row + (size_t)((k0 + i) / 32) * 18, out + i, false, add);
            break;
        case GGML_TYPE_Q4_1:
            for (int64_t i = 0; i < n; i += 32) deq_q4_01(row + (size_t)((k0 + i) / 32) * 20, out + i, true, add);
            break;
        default:
            break; /* avx2_supports admitted only the types above */
    }
}

TGT static void deq_store(enum ggml_type type, const uint8_t * row, int64_t k0, int64_t n, float * out) {
    deq_range_any(type, row, k0, n, out, false);
}

TGT static void deq_add(enum ggml_type type, const uint8_t * row, int64_t k0, int64_t n, float * out) {
    deq_range_any(type, row, k0, n, out, true);
}

/* ---------------------------------------------------------------------------------------------
 * products
 * ------------------------------------------------------------------------------------------- */

/* acc[r][c] += W[r][0..n) * x[c][0..n) for NR rows (stride KC in w) and NC columns: always the
 * same operations per (r, c), so grouping never changes a result */
#define MICRO(NR, NC)                                                                              \
    TGT static inline void micro_##NR##_##NC(const float * w, const float * const * xc, int64_t n, \
                                             __m256 * acc, int64_t acc_stride) {                   \
        __m256 a[NR][NC];                                                                          \
        for (int r = 0; r < NR; r++)                                                               \
            for (int c = 0; c < NC; c++) a[r][c] = acc[r * acc_stride + c];                        \
        for (int64_t k = 0; k < n; k += 8) {                                                       \
            __m256 wv[NR];                                                                         \
            for (int r = 0; r < NR; r++) {                                                         \
                wv[r] = _mm256_load_ps(w + r * KC + k);                                            \
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

/* bytes of values [k0, k0 + n) of a row of this type (k0, n multiples of its block) */
static inline size_t span(enum ggml_type type, int64_t k0, int64_t n, size_t * off) {
    const size_t bs = (size_t)ggml_blck_size(type), ts = ggml_type_size(type);
    *off = (size_t)k0 / bs * ts;
    return (size_t)n / bs * ts;
}

/* Ask for the next chunk's weights while this one is computed: the rows are read a chunk at a
 * time, several rows side by side, a pattern the hardware prefetchers follow too late (measured:
 * most of the time stalled on the first touch of each block without it). */
TGT static void prefetch_chunk(const bs_job * job, int64_t r, int nr, int64_t k0, int64_t n) {
    for (int h = 0; h < 2; h++) {
        const uint8_t * base = h == 0 ? job->w2 : job->r;
        if (base == NULL) continue;
        const enum ggml_type type = h == 0 ? job->w2_type : job->r_type;
        const size_t rb = h == 0 ? job->w2_row_bytes : job->r_row_bytes;
        size_t off;
        const size_t len = span(type, k0, n, &off);
        for (int i = 0; i < nr; i++) {
            const uint8_t * p = base + (size_t)(r + i) * rb + off;
            for (size_t o = 0; o < len; o += 64) {
                _mm_prefetch((const char *)(p + o), _MM_HINT_T0);
            }
        }
    }
}

TGT static void avx2_rows(const bs_job * job, int64_t r0, int64_t r1, bs_scratch * scratch) {
    const int64_t K = job->K, nc = job->n_cols;
    /* scratch: the decoded chunk (RB rows x KC, 32-byte aligned), then RB x nc accumulators */
    const size_t wbytes = (size_t)RB * KC * sizeof(float);
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
            for (int i = 0; i < nr; i++) {
                float * wr = w + i * KC;
                bool have = false;
                if (job->w2 != NULL) {
                    deq_store(job->w2_type, job->w2 + (size_t)(r + i) * job->w2_row_bytes, k0, n, wr);
                    have = true;
                }
                if (job->r != NULL) {
                    const uint8_t * rr = job->r + (size_t)(r + i) * job->r_row_bytes;
                    if (have) deq_add(job->r_type, rr, k0, n, wr);
                    else deq_store(job->r_type, rr, k0, n, wr);
                }
            }
            if (k0 + KC < K) {
                prefetch_chunk(job, r, nr, k0 + KC, K - k0 - KC < KC ? K - k0 - KC : KC);
            } else if (r + RB < r1) {
                prefetch_chunk(job, r + RB, r1 - r - RB >= RB ? RB : (int)(r1 - r - RB), 0, K < KC ? K : KC);
            }
            int64_t c = 0;
            for (; c + 2 <= nc; c += 2) {
                xc[0] = job->x + c * job->ldx + k0;
                xc[1] = job->x + (c + 1) * job->ldx + k0;
                if (nr == RB) {
                    micro_4_2(w, xc, n, acc + c, nc);
                } else {
                    for (int i = 0; i < nr; i++) micro_1_2(w + i * KC, xc, n, acc + i * nc + c, nc);
                }
            }
            if (c < nc) {
                xc[0] = job->x + c * job->ldx + k0;
                if (nr == RB) {
                    micro_4_1(w, xc, n, acc + c, nc);
                } else {
                    for (int i = 0; i < nr; i++) micro_1_1(w + i * KC, xc, n, acc + i * nc + c, nc);
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

const bs_kernel_family bs_family_avx2_f32 = {
    "avx2-f32", BS_ISA_AVX2, avx2_cpu, avx2_supports, avx2_acts_size, avx2_prepare_acts, avx2_rows,
};

#endif /* __x86_64__ */
