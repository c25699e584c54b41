/*
 * AVX2 decoding of the weight types a split holds, shared by the AVX2 families (avx2-f32,
 * avx2-int16): a unit of weights (256 values, or 32 for the block-32 types when the row width is
 * not a multiple of 256) is prepared once (its sub-block scales), then read as groups of 32 values:
 * 32 unsigned byte codes u with W = D u + O, D and O per sub-block of 16 (values 0-15: D0/O0,
 * 16-31: D1/O1; the same for types with sub-blocks of 32). IQ2_XXS, IQ2_XS and IQ3_S (a family
 * that takes them defines AVX2_WITH_IQ2 and sets avx2_iq to iq2.c's tables after checking its
 * decoder): the signed grid value v as u = 128 + v, D = ggml's block scale (bs_iq_scale) and O =
 * -128 D, so that D u + O, one fused multiply-add, is ggml's D v exactly. IQ1_M likewise with v =
 * 8 (grid + delta), an integer in [-9, 9], and D = ggml's d (2 s + 1) / 8.
 *
 * Internal to native/arch/x86; include after the TGT/INL macros are defined.
 */
#ifndef BS_AVX2_QUANTS_H
#define BS_AVX2_QUANTS_H

#include "bs_codes.h"
#include "cpu_feats.h"
#include "q3k_scales.h"

/* iq2.c's tables, for the family that takes IQ bases (NULL elsewhere: those never decode them) */
static const bs_iq_tables * avx2_iq;

/* the ggml type of an IQ code */
static inline enum ggml_type iq_ggml(int t) {
    return t == T_IQ2_XXS ? GGML_TYPE_IQ2_XXS : t == T_IQ2_XS ? GGML_TYPE_IQ2_XS : t == T_IQ1_M ? GGML_TYPE_IQ1_M
                                                                                         : GGML_TYPE_IQ3_S;
}

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

/* bit `from` of each byte of v moved to bit `to`, every other bit cleared: one 16-bit shift and
 * one AND (the bits a 16-bit shift carries across bytes never land on bit `to`, for from, to <= 7).
 * It takes the K-quants' high-bit planes (Q3_K's hmask, Q5_K's qh) for two operations, where
 * AND + compare + AND with per-group masks took three and two more to build each mask */
INL __m256i bit_to(__m256i v, int from, int to) {
    const __m256i s = from >= to ? _mm256_srli_epi16(v, from - to) : _mm256_slli_epi16(v, to - from);
    return _mm256_and_si256(s, _mm256_set1_epi8((char)(1u << to)));
}

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
            scales16(bs_q3k_scales_v(b + 96), h2f(b + 108), -4.0f, s->D, s->O);
            break;
        }
        case T_Q4_K:
        case T_Q5_K: { /* 8 sub-blocks of 32 */
            const float d = h2f(b), dmin = h2f(b + 2);
            uint64_t s8, m8;
            bs_k4_scales_mins(b + 4, &s8, &m8);
            _mm256_storeu_ps(s->D, _mm256_mul_ps(_mm256_set1_ps(d),
                                                 _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)s8)))));
            _mm256_storeu_ps(s->O, _mm256_mul_ps(_mm256_set1_ps(-dmin),
                                                 _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)m8)))));
            break;
        }
        case T_Q6_K:
            scales16(_mm_loadu_si128((const __m128i *)(b + 192)), h2f(b + 208), -32.0f, s->D, s->O);
            break;
        case T_IQ2_XXS:
        case T_IQ2_XS:
        case T_IQ3_S: { /* ggml's scale per half of 16 */
            const float d = h2f(b);
            for (int j = 0; j < 16; j++) {
                s->D[j] = bs_iq_scale(iq_ggml(t), d, b, j / 2, j % 2);
                s->O[j] = -128.0f * s->D[j];
            }
            break;
        }
        case T_IQ1_M: { /* codes are 128 + 8 (grid + delta): D = ggml's d (2 s + 1) / 8, exact */
            const float d = _cvtsh_ss(bs_iq1m_d16(b));
            for (int j = 0; j < 16; j++) {
                s->D[j] = bs_iq1m_scale(d, b, j / 2, j % 2) * 0.125f;
                s->O[j] = -128.0f * s->D[j];
            }
            break;
        }
        default:
            break; /* block-32 types read their scale per group */
    }
    /* the scales are read back from memory, one broadcast load each: kept in registers, the
     * compiler extracted each lane with two shuffles (vpermilps + vperm2f128), four per group of
     * each half, on the vector ALUs that the decoding needs */
    __asm__ volatile("" ::: "memory");
}

/* the codes of group g (values 32g .. 32g + 31 of the unit b) */
INL __m256i gcodes_u(int t, const uint8_t * b, int g) {
    switch (t) {
        case T_Q2_K: { /* value 128n + 32j + l: bits 2j of qs[32n + l] */
            const int n = g >> 2, j = g & 3;
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 16 + 32 * n));
            return _mm256_and_si256(srl8(q, 2 * j), _mm256_set1_epi8(3));
        }
        case T_Q3_K: { /* + 4 where the hmask bit (4n + j) is set */
            const int n = g >> 2, j = g & 3;
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b + 32 + 32 * n));
            const __m256i hm = _mm256_loadu_si256((const __m256i *)b);
            return _mm256_or_si256(_mm256_and_si256(srl8(q, 2 * j), _mm256_set1_epi8(3)), bit_to(hm, 4 * n + j, 2));
        }
        case T_Q4_K:
        case T_Q5_K: { /* value 64z + l: low nibble of qs[32z + l]; 64z + 32 + l: high nibble */
            const bool q5 = t == T_Q5_K;
            const int z = g >> 1, hi = g & 1;
            const __m256i q = _mm256_loadu_si256((const __m256i *)(b + (q5 ? 48 : 16) + 32 * z));
            __m256i u = _mm256_and_si256(hi ? srl8(q, 4) : q, _mm256_set1_epi8(0x0F));
            if (q5) u = _mm256_or_si256(u, bit_to(_mm256_loadu_si256((const __m256i *)(b + 16)), g, 4));
            return u;
        }
        case T_Q6_K: { /* value 128n + 32m + l: nibble of ql[64n + 32(m&1) + l], 2 bits of qh[32n + l] */
            const int n = g >> 2, m = g & 3;
            const __m256i l = _mm256_loadu_si256((const __m256i *)(b + 64 * n + 32 * (m & 1)));
            const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n));
            const __m256i lo = _mm256_and_si256(m >= 2 ? srl8(l, 4) : l, _mm256_set1_epi8(0x0F));
            /* bits 2m, 2m + 1 of h as bits 4, 5: one shift (none for m = 2) and one AND (a 16-bit
             * shift by at most 4 carries no bit across bytes into bits 4-5) */
            const __m256i hs = m < 2 ? _mm256_slli_epi16(h, 4 - 2 * m) : m == 2 ? h : _mm256_srli_epi16(h, 2);
            return _mm256_or_si256(lo, _mm256_and_si256(hs, _mm256_set1_epi8(0x30)));
        }
        case T_Q8_0: /* W = d q = d (u - 128), u = q + 128 */
            return _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b + 34 * g + 2)), _mm256_set1_epi8((char)0x80));
        case T_IQ2_XXS:
        case T_IQ2_XS:
        case T_IQ3_S: { /* 32 grid magnitudes with their sign bits: u = 128 +- magnitude */
            uint64_t gq[4];
            uint32_t sg;
            bs_iq_group(avx2_iq, iq_ggml(t), b, g, gq, &sg);
            const __m256i mag = _mm256_setr_epi64x((long long)gq[0], (long long)gq[1], (long long)gq[2], (long long)gq[3]);
            /* byte i of the group takes sign bit i % 8 of sign byte i / 8 (vpshufb works per 128-bit lane) */
            const __m256i sb = _mm256_shuffle_epi8(_mm256_set1_epi32((int)sg),
                                                   _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                                    2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
            const __m256i bits = _mm256_set1_epi64x((long long)0x8040201008040201ull);
            const __m256i neg = _mm256_cmpeq_epi8(_mm256_and_si256(sb, bits), bits);
            const __m256i v = _mm256_sub_epi8(_mm256_xor_si256(mag, neg), neg); /* -magnitude where negative */
            return _mm256_add_epi8(v, _mm256_set1_epi8((char)0x80));
        }
        case T_IQ1_M: { /* 4 grid entries of 8 (bytes 128 + 8 g), each moved by its delta (+-1/8, so +-1) */
            const uint8_t * qs = b + 4 * g, * qh = b + 32 + 2 * g;
            const uint64_t * grid = avx2_iq->iq1m_grid, up = 0x0101010101010101ull, down = ~0ull;
            const __m256i e = _mm256_setr_epi64x((long long)grid[qs[0] | ((qh[0] & 0x07) << 8)],
                                                 (long long)grid[qs[1] | ((qh[0] & 0x70) << 4)],
                                                 (long long)grid[qs[2] | ((qh[1] & 0x07) << 8)],
                                                 (long long)grid[qs[3] | ((qh[1] & 0x70) << 4)]);
            const __m256i dl = _mm256_setr_epi64x((long long)(qh[0] & 0x08 ? down : up), (long long)(qh[0] & 0x80 ? down : up),
                                                  (long long)(qh[1] & 0x08 ? down : up), (long long)(qh[1] & 0x80 ? down : up));
            return _mm256_add_epi8(e, dl);
        }
        case T_Q4_0:
        case T_Q4_1: { /* Q4_0: W = d (q - 8); Q4_1: W = d q + m; low nibbles are values 0..15 */
            const __m128i q = _mm_loadu_si128((const __m128i *)(b + (t == T_Q4_1 ? 20 : 18) * g + (t == T_Q4_1 ? 4 : 2)));
            const __m128i m4 = _mm_set1_epi8(0x0F);
            return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
        }
        default:
            return _mm256_setzero_si256();
    }
}

/* the codes of group g and the scales of its two halves (W = D u + O) */
INL __m256i gcodes(int t, const ustate * s, int g, float * D0, float * O0, float * D1, float * O1) {
    const uint8_t * b = s->p;
    switch (t) {
        case T_Q2_K: case T_Q3_K: case T_Q6_K: case T_IQ2_XXS: case T_IQ2_XS: case T_IQ3_S: case T_IQ1_M: {
            const int k = 2 * g; /* sub-blocks of 16 */
            *D0 = s->D[k], *O0 = s->O[k], *D1 = s->D[k + 1], *O1 = s->O[k + 1];
            break;
        }
        case T_Q4_K: case T_Q5_K:
            *D0 = *D1 = s->D[g], *O0 = *O1 = s->O[g];
            break;
        case T_Q8_0:
            *D0 = *D1 = h2f(b + 34 * g);
            *O0 = *O1 = -128.0f * *D0;
            break;
        case T_Q4_0: case T_Q4_1: {
            const bool q41 = t == T_Q4_1;
            const uint8_t * blk = b + (q41 ? 20 : 18) * g;
            *D0 = *D1 = h2f(blk);
            *O0 = *O1 = q41 ? h2f(blk + 2) : -8.0f * *D0;
            break;
        }
        default:
            *D0 = *O0 = *D1 = *O1 = 0.0f;
            break;
    }
    return gcodes_u(t, b, g);
}

/* Integer scales of a superblock (Q2_K..Q6_K): W = d * sc[h] * u + O[h] for the 16 halves h of 16
 * values (Q4_K/Q5_K's 8 scales of 32 each given twice), sc as 16 int16 in *S; O as floats. */
INL void iscales(int t, const uint8_t * b, __m256i * S, float * d, float * O) {
    switch (t) {
        case T_Q2_K: { /* scales: low nibbles; mins: high nibbles x -dmin */
            const __m128i v = _mm_loadu_si128((const __m128i *)b), m4 = _mm_set1_epi8(0x0F);
            *S = _mm256_cvtepu8_epi16(_mm_and_si128(v, m4));
            *d = h2f(b + 80);
            const __m256 dm = _mm256_set1_ps(-h2f(b + 82));
            const __m128i mn = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
            _mm256_storeu_ps(O, _mm256_mul_ps(dm, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn))));
            _mm256_storeu_ps(O + 8, _mm256_mul_ps(dm, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(mn, 8)))));
            break;
        }
        case T_Q3_K:
        case T_Q6_K: { /* O = -4 d sc (Q3_K), -32 d sc (Q6_K) */
            __m128i v;
            if (t == T_Q3_K) {
                v = bs_q3k_scales_v(b + 96);
                *d = h2f(b + 108);
            } else {
                v = _mm_loadu_si128((const __m128i *)(b + 192));
                *d = h2f(b + 208);
            }
            *S = _mm256_cvtepi8_epi16(v);
            const __m256 z = _mm256_set1_ps((t == T_Q3_K ? -4.0f : -32.0f) * *d);
            _mm256_storeu_ps(O, _mm256_mul_ps(z, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))));
            _mm256_storeu_ps(O + 8, _mm256_mul_ps(z, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)))));
            break;
        }
        case T_Q4_K:
        case T_Q5_K: { /* 8 sub-blocks of 32 */
            const float dmin = h2f(b + 2);
            *d = h2f(b);
            uint64_t s8, m8;
            bs_k4_scales_mins(b + 4, &s8, &m8);
            const __m128i sv = _mm_cvtsi64_si128((long long)s8), mv = _mm_cvtsi64_si128((long long)m8);
            /* each of the 8 given twice (the halves of its sub-block of 32) */
            *S = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sv, sv));
            const __m128i m2 = _mm_unpacklo_epi8(mv, mv);
            const __m256 dm = _mm256_set1_ps(-dmin);
            _mm256_storeu_ps(O, _mm256_mul_ps(dm, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m2))));
            _mm256_storeu_ps(O + 8, _mm256_mul_ps(dm, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(m2, 8)))));
            break;
        }
        default:
            *S = _mm256_setzero_si256();
            *d = 0.0f;
            break;
    }
}

INL size_t toff(int t, int64_t k) { return (size_t)(k / T_BLCK[t]) * (size_t)T_SIZE[t]; }

/* whether this CPU runs the AVX2 families: AVX2 + FMA + F16C (cpu_feats.c) */
static inline bool avx2_fma_f16c(void) { return bs_cpu_has(BS_CPU_NEED_AVX2); }

/* the sum of 8 lanes, in a fixed order */
TGT static inline float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

/* One compiled body per (base type, residual type) of a family's rows_body(job, bt, rt, coarse, r0,
 * r1, scratch), so that the decoders' switches fold away, and rows_for(job): the job's body, or NULL
 * for types the families do not take. A base alone comes twice: coarse (the fast drafter, job->draft)
 * and at the verifier's precision (a weight without residual); a family whose arithmetic does not
 * depend on it defines AVX2_SAME_BASE_BODIES to share one body. Expand once, after rows_body. */
typedef void (*avx2_rows_fn)(const bs_job *, int64_t, int64_t, bs_scratch *);
#define AVX2_BODY_AS(NAME, B, R, C) \
    TGT static void NAME(const bs_job * j, int64_t r0, int64_t r1, bs_scratch * s) { rows_body(j, B, R, C, r0, r1, s); }
#define AVX2_BODY(B, R) AVX2_BODY_AS(rows_##B##_##R, B, R, (R) == T_NONE)
#define AVX2_RES_BODIES(B) \
    AVX2_BODY(B, T_Q6_K) AVX2_BODY(B, T_Q8_0) AVX2_BODY(B, T_Q4_K) AVX2_BODY(B, T_Q5_K)
#ifdef AVX2_SAME_BASE_BODIES
#define AVX2_BODIES(B) AVX2_BODY(B, T_NONE) AVX2_RES_BODIES(B)
#define AVX2_EXACT(B) rows_##B##_T_NONE
#else
#define AVX2_BODIES(B) AVX2_BODY(B, T_NONE) AVX2_RES_BODIES(B) AVX2_BODY_AS(rows_##B##_exact, B, T_NONE, false)
#define AVX2_EXACT(B) rows_##B##_exact
#endif
#define AVX2_ROW(B)                                                                                              \
    {NULL, rows_##B##_T_NONE, rows_##B##_T_Q6_K, rows_##B##_T_Q8_0, AVX2_EXACT(B), rows_##B##_T_Q4_K,            \
     rows_##B##_T_Q5_K}
/* the IQ2 bases' bodies and table rows where the family takes them (else their rows stay NULL) */
#ifdef AVX2_WITH_IQ2
#define AVX2_IQ2_BODIES AVX2_BODIES(T_IQ2_XXS) AVX2_BODIES(T_IQ2_XS) AVX2_BODIES(T_IQ3_S) AVX2_BODIES(T_IQ1_M)
#define AVX2_IQ2_ROWS , [T_IQ2_XXS] = AVX2_ROW(T_IQ2_XXS), [T_IQ2_XS] = AVX2_ROW(T_IQ2_XS), [T_IQ3_S] = AVX2_ROW(T_IQ3_S), \
                      [T_IQ1_M] = AVX2_ROW(T_IQ1_M)
#else
#define AVX2_IQ2_BODIES
#define AVX2_IQ2_ROWS
#endif
#define AVX2_ROW_BODIES                                                                                          \
    AVX2_BODIES(T_Q2_K) AVX2_BODIES(T_Q3_K) AVX2_BODIES(T_Q4_K) AVX2_BODIES(T_Q5_K) AVX2_BODIES(T_Q6_K)          \
    AVX2_BODIES(T_Q8_0) AVX2_BODIES(T_Q4_0) AVX2_BODIES(T_Q4_1) AVX2_RES_BODIES(T_NONE) AVX2_IQ2_BODIES           \
    /* [base code][0: unused, 1: no residual (drafter), 2: Q6_K residual, 3: Q8_0 residual,                     \
     *  4: no residual, verifier's precision, 5: Q4_K residual, 6: Q5_K residual] */                            \
    static const avx2_rows_fn BODY_TABLE[T_COUNT][7] = {                                                        \
        {NULL, NULL, rows_T_NONE_T_Q6_K, rows_T_NONE_T_Q8_0, NULL, rows_T_NONE_T_Q4_K, rows_T_NONE_T_Q5_K},     \
        AVX2_ROW(T_Q2_K), AVX2_ROW(T_Q3_K), AVX2_ROW(T_Q4_K), AVX2_ROW(T_Q5_K), AVX2_ROW(T_Q6_K),               \
        AVX2_ROW(T_Q8_0), AVX2_ROW(T_Q4_0), AVX2_ROW(T_Q4_1) AVX2_IQ2_ROWS                                      \
    };                                                                                                          \
    static avx2_rows_fn rows_for(const bs_job * job) {                                                          \
        const int bt = tcode(job->w2, job->w2_type), rt = tcode(job->r, job->r_type);                          \
        const int col = rt == T_NONE ? (job->draft ? 1 : 4) : rt == T_Q6_K ? 2 : rt == T_Q8_0 ? 3                \
                      : rt == T_Q4_K ? 5 : rt == T_Q5_K ? 6 : -1;                                               \
        return bt < 0 || col < 0 ? NULL : BODY_TABLE[bt][col];                                                  \
    }

#endif
