/*
 * The integer kernel family ("vnni-int24"): exact integer weights times 24-bit integer activations.
 *
 * Activations: each column is cut into blocks of 256 values; a block is scaled by s = max|x| /
 * 8355711 and rounded to integers X, |X| <= 8355711 (24 bits: 2^-23 of the block's largest value,
 * so an outlier channel costs its neighbours nothing), stored as three signed byte digits
 * X = 65536*d2 + 256*d1 + d0, plus the sums of X over each 16 values.
 *
 * Weights: every supported type is, per superblock of 256, an affine map of small unsigned codes:
 *   W[k] = D[sub(k)] * u[k] + O[sub(k)]        (u: 0..255, D and O per sub-block of 16 or 32)
 *   Q2_K  u = sc*q (scale folded in, one D = d for the whole block), O = -dmin*m
 *   Q3_K  u = q + 4h, D = d*(sc-32), O = -4D        Q4_K/Q5_K  u = q, D = d*sc, O = -dmin*m
 *   Q6_K  u = q, D = d*sc, O = -32D                 Q8_0       u = q+128, D = d, O = -128D
 * so sum_k W[k] x[k] = s * (sum_j D_j sum_{k in j} u_k X_k + sum_j O_j sum_{k in j} X_k).
 * The inner sums are exact integers (AVX512-VNNI vpdpbusd, unsigned codes times signed digits);
 * floats appear only in the per-block scaling, always in the same order. A weight block is decoded
 * once per row and applied to every column; a column's result never depends on the others.
 */
#if defined(__x86_64__)

#define _GNU_SOURCE
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "bitsplit.h"
#include "bs_internal.h"
#include "cpu_feats.h"
#include "prefetch.h"
#include "q3k_scales.h"

#define TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c,bmi2")))
#define QK 256
#define XMAX 8355711.0f /* 127*65536 + 127*256 + 127: three digits in [-128, 127] */

typedef struct {
    int8_t d[3][QK];  /* digits d0, d1, d2 */
    int32_t xsum[16]; /* sum of X over each 16 values */
    float s;          /* x ~= s * X */
    float pad[15];
} act_block; /* 3*256 + 64 + 64 = 896 bytes, 64-byte aligned */

/* AVX-512 F, BW, VL, DQ and VNNI, FMA, F16C (cpu_feats.c) */
static bool int_available(void) { return bs_cpu_has(BS_CPU_NEED_VNNI_INT24); }

static bool type_ok(enum ggml_type t) {
    return t == GGML_TYPE_Q2_K || t == GGML_TYPE_Q3_K || t == GGML_TYPE_Q4_K || t == GGML_TYPE_Q5_K ||
           t == GGML_TYPE_Q6_K || t == GGML_TYPE_Q8_0;
}

static bool int_supports(const bs_job * job) {
    /* any batch works; which batches it is chosen for is the kernel policy (kernels.c) */
    if (job->K % QK != 0 || job->precision == BITSPLIT_PREC_F32) {
        return false;
    }
    return (job->r == NULL || type_ok(job->r_type)) && (job->w2 == NULL || type_ok(job->w2_type));
}

static size_t int_acts_size(const bs_job * job) {
    return (size_t)job->n_cols * (size_t)(job->K / QK) * sizeof(act_block) + 64;
}

/* The fast drafter (job->draft: the base alone) needs speed, not precision: its activations
 * are rounded to 8 bits per 256 values (as ggml's own K-quant products do), one digit instead of three. */
TGT static void int_prepare_acts(const bs_job * job, int64_t c0, int64_t c1) {
    const int64_t nb = job->K / QK;
    const bool coarse = job->draft;
    const float xmax = coarse ? 127.0f : XMAX;
    act_block * acts = job->acts;
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t c = c0; c < c1; c++) {
        const float * x = job->x + c * job->ldx;
        for (int64_t t = 0; t < nb; t++) {
            act_block * a = &acts[c * nb + t];
            const float * xb = x + t * QK;
            __m512 mx = _mm512_setzero_ps();
            for (int i = 0; i < QK; i += 16) {
                mx = _mm512_max_ps(mx, _mm512_and_ps(_mm512_loadu_ps(xb + i), absmask));
            }
            const float amax = _mm512_reduce_max_ps(mx);
            const float s = amax / xmax;
            const __m512 inv = _mm512_set1_ps(amax > 0.0f ? xmax / amax : 0.0f);
            const __m512i lim = _mm512_set1_epi32((int)xmax);
            a->s = s;
            for (int i = 0; i < QK; i += 16) {
                __m512i X = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i), inv));
                /* guard the rounding at the edge of the range */
                X = _mm512_max_epi32(_mm512_min_epi32(X, lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim));
                a->xsum[i / 16] = _mm512_reduce_add_epi32(X);
                const __m128i d0 = _mm512_cvtepi32_epi8(X);
                _mm_storeu_si128((__m128i *)(a->d[0] + i), d0);
                if (coarse) {
                    continue;
                }
                const __m512i X1 = _mm512_srai_epi32(_mm512_sub_epi32(X, _mm512_cvtepi8_epi32(d0)), 8);
                const __m128i d1 = _mm512_cvtepi32_epi8(X1);
                const __m512i X2 = _mm512_srai_epi32(_mm512_sub_epi32(X1, _mm512_cvtepi8_epi32(d1)), 8);
                _mm_storeu_si128((__m128i *)(a->d[1] + i), d1);
                _mm_storeu_si128((__m128i *)(a->d[2] + i), _mm512_cvtepi32_epi8(X2));
            }
        }
    }
}

/* one decoded superblock of one row */
typedef struct {
    __m512i u[4];  /* codes for k = 64z .. 64z+63 */
    __m512 D[4];   /* per-lane scale of each u[z] (lane l covers k = 64z + 4l .. +3) */
    __m512 O;      /* offset per sub-block of 16 */
    float A;       /* Q2_K: one scale for the whole block (D unused) */
    bool single;
} wblock;

TGT static inline float h2f(const uint8_t * p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* lane scales for u[z] from 16 per-sub-block values (sub-blocks of 16: lanes 4i..4i+3 <- 4z+i) */
TGT static inline __m512 lanes16(__m512 D16, int z) {
    const __m512i idx = _mm512_add_epi32(_mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2),
                                         _mm512_set1_epi32(4 * z));
    return _mm512_permutexvar_ps(idx, D16);
}

TGT static inline __m256i srl8(__m256i v, int n) { return _mm256_srli_epi16(v, n); }

TGT static void dec_q2_K(const uint8_t * b, wblock * w) {
    const uint8_t * qs = b + 16;
    const float d = h2f(b + 80), dmin = h2f(b + 82);
    const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
    /* tables [0, s, 2s, 3s] per sub-block in one dword each (3*15 < 256: no carries) */
    const __m512i tabs = _mm512_mullo_epi32(_mm512_and_si512(sc, _mm512_set1_epi32(15)), _mm512_set1_epi32(0x03020100));
    w->O = _mm512_mul_ps(_mm512_set1_ps(-dmin), _mm512_cvtepi32_ps(_mm512_srli_epi32(sc, 4)));
    w->A = d;
    w->single = true;
    const __m256i m3 = _mm256_set1_epi8(3);
    for (int z = 0; z < 4; z++) {
        const int n = z / 2, s1 = 2 * (z % 2), s2 = s1 + 1;
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * n));
        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(srl8(q, 2 * s1), m3)),
                                             _mm256_and_si256(srl8(q, 2 * s2), m3), 1);
        /* lane i of u[z] is sub-block 4z + i: put its table at the lane's start */
        const __m512i t = _mm512_permutexvar_epi32(
            _mm512_set_epi32(0, 0, 0, 4 * z + 3, 0, 0, 0, 4 * z + 2, 0, 0, 0, 4 * z + 1, 0, 0, 0, 4 * z), tabs);
        w->u[z] = _mm512_shuffle_epi8(t, v);
    }
}

TGT static void dec_q3_K(const uint8_t * b, wblock * w) {
    const float d = h2f(b + 108);
    const __m512 D16 = _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bs_q3k_scales_v(b + 96))));
    w->O = _mm512_mul_ps(_mm512_set1_ps(-4.0f), D16);
    w->single = false;
    const __m256i m3 = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    const __m256i h = _mm256_loadu_si256((const __m256i *)b);
    const uint8_t * qs = b + 32;
    for (int z = 0; z < 4; z++) {
        const int n = z / 2;
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * n));
        __m256i part[2];
        for (int p = 0; p < 2; p++) {
            const int s = 2 * (z % 2) + p;
            __m256i v = _mm256_and_si256(srl8(q, 2 * s), m3);
            const __mmask32 set = _mm256_test_epi8_mask(h, _mm256_set1_epi8((char)(1u << (4 * n + s))));
            part[p] = _mm256_mask_add_epi8(v, set, v, four);
        }
        w->u[z] = _mm512_inserti64x4(_mm512_castsi256_si512(part[0]), part[1], 1);
        w->D[z] = lanes16(D16, z);
    }
}

/* Q4_K / Q5_K: sub-blocks of 32; u[z] = [low nibbles (sub-block 2z), high nibbles (2z+1)] */
TGT static void dec_q45_K(const uint8_t * b, wblock * w, bool q5) {
    const float d = h2f(b), dmin = h2f(b + 2);
    const uint8_t * scales = b + 4;
    const uint8_t * qs = b + (q5 ? 48 : 16);
    float Dv[8];
    uint64_t s8, m8;
    bs_k4_scales_mins(scales, &s8, &m8);
    _mm256_storeu_ps(Dv, _mm256_mul_ps(_mm256_set1_ps(d),
                                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)s8)))));
    const __m128i mv = _mm_cvtsi64_si128((long long)m8);
    /* each min given twice (both halves of its sub-block of 32) */
    w->O = _mm512_mul_ps(_mm512_set1_ps(-dmin), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(mv, mv))));
    w->single = false;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i hb = q5 ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
    for (int z = 0; z < 4; z++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * z));
        __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(srl8(q, 4), m4);
        if (q5) {
            lo = _mm256_mask_add_epi8(lo, _mm256_test_epi8_mask(hb, _mm256_set1_epi8((char)(1u << (2 * z)))), lo, _mm256_set1_epi8(16));
            hi = _mm256_mask_add_epi8(hi, _mm256_test_epi8_mask(hb, _mm256_set1_epi8((char)(2u << (2 * z)))), hi, _mm256_set1_epi8(16));
        }
        w->u[z] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
        w->D[z] = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(Dv[2 * z]), _mm512_set1_ps(Dv[2 * z + 1]));
    }
}

TGT static void dec_q6_K(const uint8_t * b, wblock * w) {
    const float d = h2f(b + 208);
    const __m512 D16 = _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128((const __m128i *)(b + 192)))));
    w->O = _mm512_mul_ps(_mm512_set1_ps(-32.0f), D16);
    w->single = false;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi8(3);
    for (int n = 0; n < 2; n++) {
        /* ql[64n .. 64n+63] holds the low nibbles of both quarters pairs; qh[32n ..] the high bits */
        const __m512i L = _mm512_loadu_si512((const void *)(b + 64 * n));
        const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n));
        const __m512i H = _mm512_inserti64x4(_mm512_castsi256_si512(h), _mm256_srli_epi16(h, 2), 1);
        /* elements 128n + 0..63: low nibbles | (H & 3) << 4; 128n + 64..127: high nibbles | (H >> 4 & 3) << 4 */
        w->u[2 * n] = _mm512_or_si512(_mm512_and_si512(L, m4), _mm512_slli_epi16(_mm512_and_si512(H, m3), 4));
        w->u[2 * n + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), m4),
                                          _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(H, 4), m3), 4));
    }
    for (int z = 0; z < 4; z++) {
        w->D[z] = lanes16(D16, z);
    }
}

TGT static void dec_q8_0(const uint8_t * b0, wblock * w) {
    float Ov[16];
    float dv[8];
    for (int j = 0; j < 8; j++) {
        dv[j] = h2f(b0 + 34 * j);
        Ov[2 * j] = Ov[2 * j + 1] = -128.0f * dv[j];
    }
    w->O = _mm512_loadu_ps(Ov);
    w->single = false;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int z = 0; z < 4; z++) {
        const __m256i a = _mm256_loadu_si256((const __m256i *)(b0 + 34 * (2 * z) + 2));
        const __m256i c = _mm256_loadu_si256((const __m256i *)(b0 + 34 * (2 * z + 1) + 2));
        w->u[z] = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(a), c, 1), flip);
        w->D[z] = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(dv[2 * z]), _mm512_set1_ps(dv[2 * z + 1]));
    }
}

TGT static inline void decode(enum ggml_type type, const uint8_t * row, int64_t t, wblock * w) {
    switch (type) {
        case GGML_TYPE_Q2_K: dec_q2_K(row + (size_t)t * 84, w); break;
        case GGML_TYPE_Q3_K: dec_q3_K(row + (size_t)t * 110, w); break;
        case GGML_TYPE_Q4_K: dec_q45_K(row + (size_t)t * 144, w, false); break;
        case GGML_TYPE_Q5_K: dec_q45_K(row + (size_t)t * 176, w, true); break;
        case GGML_TYPE_Q6_K: dec_q6_K(row + (size_t)t * 210, w); break;
        default: dec_q8_0(row + (size_t)t * 8 * 34, w); break; /* Q8_0: 8 blocks per 256 */
    }
}

/* sum_j D_j sum_k u X + sum_j O_j xsum_j for one decoded block and one activation block, as a
 * 16-lane vector (summed later): always the same operations in the same order */
TGT static inline __m512 block_dot(const wblock * w, const act_block * a) {
    const __m512 k256 = _mm512_set1_ps(256.0f), k65536 = _mm512_set1_ps(65536.0f);
    __m512 acc = _mm512_mul_ps(w->O, _mm512_cvtepi32_ps(_mm512_loadu_si512((const void *)a->xsum)));
    if (w->single) {
        __m512i p0 = _mm512_setzero_si512(), p1 = _mm512_setzero_si512(), p2 = _mm512_setzero_si512();
        for (int z = 0; z < 4; z++) {
            p0 = _mm512_dpbusd_epi32(p0, w->u[z], _mm512_loadu_si512((const void *)(a->d[0] + 64 * z)));
            p1 = _mm512_dpbusd_epi32(p1, w->u[z], _mm512_loadu_si512((const void *)(a->d[1] + 64 * z)));
            p2 = _mm512_dpbusd_epi32(p2, w->u[z], _mm512_loadu_si512((const void *)(a->d[2] + 64 * z)));
        }
        const __m512 T = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p2), k65536,
                                         _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), k256, _mm512_cvtepi32_ps(p0)));
        return _mm512_fmadd_ps(T, _mm512_set1_ps(w->A), acc);
    }
    for (int z = 0; z < 4; z++) {
        const __m512i p0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w->u[z], _mm512_loadu_si512((const void *)(a->d[0] + 64 * z)));
        const __m512i p1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w->u[z], _mm512_loadu_si512((const void *)(a->d[1] + 64 * z)));
        const __m512i p2 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w->u[z], _mm512_loadu_si512((const void *)(a->d[2] + 64 * z)));
        /* 256*p1 + p0 stays far inside int32 for every type (|p| <= 4*255*128) */
        const __m512i p10 = _mm512_add_epi32(_mm512_slli_epi32(p1, 8), p0);
        const __m512 T = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p2), k65536, _mm512_cvtepi32_ps(p10));
        acc = _mm512_fmadd_ps(T, w->D[z], acc);
    }
    return acc;
}

/* block_dot for 8-bit activations (one digit: the fast drafter) */
TGT static inline __m512 block_dot8(const wblock * w, const act_block * a) {
    __m512 acc = _mm512_mul_ps(w->O, _mm512_cvtepi32_ps(_mm512_loadu_si512((const void *)a->xsum)));
    if (w->single) {
        __m512i p0 = _mm512_setzero_si512();
        for (int z = 0; z < 4; z++) {
            p0 = _mm512_dpbusd_epi32(p0, w->u[z], _mm512_loadu_si512((const void *)(a->d[0] + 64 * z)));
        }
        return _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_set1_ps(w->A), acc);
    }
    for (int z = 0; z < 4; z++) {
        const __m512i p0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w->u[z], _mm512_loadu_si512((const void *)(a->d[0] + 64 * z)));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), w->D[z], acc);
    }
    return acc;
}

TGT static void int_rows(const bs_job * job, int64_t r0, int64_t r1, bs_scratch * scratch) {
    const int64_t nb = job->K / QK, nc = job->n_cols;
    const act_block * acts = job->acts;
    __m512 * tot = bs_scratch_get(scratch, (size_t)nc * sizeof(__m512) + 64);
    if (tot == NULL) {
        return;
    }
    /* bytes per block of 256 weights, and where the rows of this range end (no prefetch past them) */
    const size_t bbytes = job->w2 ? job->w2_row_bytes / (size_t)nb : 0, rbytes = job->r ? job->r_row_bytes / (size_t)nb : 0;
    const uint8_t * bend = job->w2 ? job->w2 + (size_t)r1 * job->w2_row_bytes : NULL;
    const uint8_t * rend = job->r ? job->r + (size_t)r1 * job->r_row_bytes : NULL;
    wblock wb, wr;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t * brow = job->w2 ? job->w2 + (size_t)r * job->w2_row_bytes : NULL;
        const uint8_t * rrow = job->r ? job->r + (size_t)r * job->r_row_bytes : NULL;
        for (int64_t c = 0; c < nc; c++) {
            tot[c] = _mm512_setzero_ps();
        }
        for (int64_t t = 0; t < nb; t++) {
            if (brow) bs_prefetch_ahead(brow + (size_t)t * bbytes, bbytes, bend);
            if (rrow) bs_prefetch_ahead(rrow + (size_t)t * rbytes, rbytes, rend);
            if (brow) decode(job->w2_type, brow, t, &wb);
            if (rrow) decode(job->r_type, rrow, t, &wr);
            for (int64_t c = 0; c < nc; c++) {
                const act_block * a = &acts[c * nb + t];
                __m512 v;
                if (rrow) {
                    v = block_dot(&wr, a);
                    if (brow) v = _mm512_add_ps(block_dot(&wb, a), v);
                } else if (job->draft) {
                    v = block_dot8(&wb, a); /* base alone (the fast drafter) */
                } else {
                    v = block_dot(&wb, a); /* a weight without residual, at the verifier's precision */
                }
                tot[c] = _mm512_fmadd_ps(_mm512_set1_ps(a->s), v, tot[c]);
            }
        }
        for (int64_t c = 0; c < nc; c++) {
            float * y = job->y + c * job->ldy + r;
            const float v = _mm512_reduce_add_ps(tot[c]);
            *y = job->accumulate ? *y + v : v;
        }
    }
}

const bs_kernel_family bs_family_vnni_int24 = {
    "vnni-int24", BS_ISA_AVX512, int_available, int_supports, int_acts_size, int_prepare_acts, int_rows,
    /* drafting: measured on Qwen2.5-Coder-1.5B's Q2_K base, 2 cores (python bench/draft_speed.py
     * SPLIT): native/ggml time 1.22 at 1 column, 0.86 at 2, 0.65 at 4 */
    2,
    /* preferred up to 4 columns: measured crossover with the tile kernels (amx-bf16) at 4-5 columns
     * on a 2-core Xeon */
    4,
    .exact_weights = true,
};

#endif /* __x86_64__ */
