/*
 * x86-64 kernel families, compiled with per-function target attributes and chosen at run time:
 *
 *   amx-bf16     AVX-512 unpacks 16 rows x K of (W2 + R) into bf16 once; AMX tiles multiply them
 *                with all activation columns (16 per tile, 4 tiles at a time). The weight unpack is
 *                the whole cost: a batch of 16 costs about what one column does.
 *   avx512-bf16  the same unpack; 4x4 register blocks of vdpbf16ps instead of tiles (Zen 4, and
 *                Intel parts without AMX).
 *
 * avx512-bf16 computes bf16(f32(W2) + f32(R)) . bf16(x), one weight per product; amx-bf16 computes
 * bf16(W2) . bf16(x) + bf16(R) . bf16(x) (two tiles); both with f32 accumulation, column by column
 * in a fixed order (batch-invariant). Unpackers exist for the types llama.cpp's Q2_K mixes produce
 * (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q8_0) and for the residual types (Q4_K, Q5_K, Q6_K,
 * Q8_0); any other readable base type goes through ggml's own dequantizer, block by block.
 */
#if defined(__x86_64__)

#define _GNU_SOURCE
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "bitsplit.h"
#include "bs_internal.h"
#include "amx_tiles.h"
#include "cpu_feats.h"
#include "q3k_scales.h"

#define TGT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c,bmi2")))
#define TGT_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c,bmi2,amx-tile,amx-bf16")))

#define QK 256

/* ---------------------------------------------------------------------------------------------
 * unpacking: elements [k0, k0 + n) of one row to f32 (n: 256 for K-quants, a multiple of 32 else)
 * ------------------------------------------------------------------------------------------- */

TGT_AVX512 static inline float h2f(const uint8_t * p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* 16 bytes -> 16 floats */
TGT_AVX512 static inline __m512 u8x16_ps(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }
TGT_AVX512 static inline __m512 i8x16_ps(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)); }

TGT_AVX512 static void deq_q2_K(const uint8_t * b, float * out) {
    const uint8_t * sc = b;
    const uint8_t * qs = b + 16;
    const float d = h2f(b + 80), dmin = h2f(b + 82);
    const __m256i m3 = _mm256_set1_epi8(3);
    for (int n = 0; n < 2; n++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * n));
        for (int s = 0; s < 4; s++) {
            const __m256i v = _mm256_and_si256(_mm256_srli_epi16(q, 2 * s), m3);
            const int j = 8 * n + 2 * s;
            const __m512 lo = u8x16_ps(_mm256_castsi256_si128(v));
            const __m512 hi = u8x16_ps(_mm256_extracti128_si256(v, 1));
            float * o = out + 128 * n + 32 * s;
            _mm512_storeu_ps(o, _mm512_fmsub_ps(lo, _mm512_set1_ps(d * (sc[j] & 0xF)), _mm512_set1_ps(dmin * (sc[j] >> 4))));
            _mm512_storeu_ps(o + 16, _mm512_fmsub_ps(hi, _mm512_set1_ps(d * (sc[j + 1] & 0xF)),
                                                     _mm512_set1_ps(dmin * (sc[j + 1] >> 4))));
        }
    }
}

TGT_AVX512 static void deq_q3_K(const uint8_t * b, float * out) {
    const uint8_t * hm = b;
    const uint8_t * qs = b + 32;
    int8_t sc[16];
    bs_q3k_scales(b + 96, sc);
    const float d = h2f(b + 108);
    const __m256i m3 = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    const __m256i h = _mm256_loadu_si256((const __m256i *)hm);
    for (int n = 0; n < 2; n++) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * n));
        for (int s = 0; s < 4; s++) {
            const __mmask32 set = _mm256_test_epi8_mask(h, _mm256_set1_epi8((char)(1u << (4 * n + s))));
            __m256i v = _mm256_and_si256(_mm256_srli_epi16(q, 2 * s), m3);
            v = _mm256_mask_sub_epi8(v, (__mmask32)~set, v, four); /* high bit clear: q - 4 */
            const int j = 8 * n + 2 * s;
            float * o = out + 128 * n + 32 * s;
            _mm512_storeu_ps(o, _mm512_mul_ps(i8x16_ps(_mm256_castsi256_si128(v)), _mm512_set1_ps(d * (sc[j] - 32))));
            _mm512_storeu_ps(o + 16, _mm512_mul_ps(i8x16_ps(_mm256_extracti128_si256(v, 1)),
                                                   _mm512_set1_ps(d * (sc[j + 1] - 32))));
        }
    }
}

/* Q4_K (qh == NULL) and Q5_K */
TGT_AVX512 static void deq_q45_K(const uint8_t * b, const uint8_t * scales, const uint8_t * qh, const uint8_t * qs,
                                 float * out) {
    const float d = h2f(b), dmin = h2f(b + 2);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i h = qh ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        uint8_t s1, m1, s2, m2;
        bs_k4_scale_min(2 * j, scales, &s1, &m1);
        bs_k4_scale_min(2 * j + 1, scales, &s2, &m2);
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
        __m256i lo = _mm256_and_si256(q, m4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        if (qh) {
            const __mmask32 b1 = _mm256_test_epi8_mask(h, _mm256_set1_epi8((char)(1u << (2 * j))));
            const __mmask32 b2 = _mm256_test_epi8_mask(h, _mm256_set1_epi8((char)(2u << (2 * j))));
            lo = _mm256_mask_add_epi8(lo, b1, lo, _mm256_set1_epi8(16));
            hi = _mm256_mask_add_epi8(hi, b2, hi, _mm256_set1_epi8(16));
        }
        const __m512 D1 = _mm512_set1_ps(d * s1), M1 = _mm512_set1_ps(dmin * m1);
        const __m512 D2 = _mm512_set1_ps(d * s2), M2 = _mm512_set1_ps(dmin * m2);
        float * o = out + 64 * j;
        _mm512_storeu_ps(o, _mm512_fmsub_ps(u8x16_ps(_mm256_castsi256_si128(lo)), D1, M1));
        _mm512_storeu_ps(o + 16, _mm512_fmsub_ps(u8x16_ps(_mm256_extracti128_si256(lo, 1)), D1, M1));
        _mm512_storeu_ps(o + 32, _mm512_fmsub_ps(u8x16_ps(_mm256_castsi256_si128(hi)), D2, M2));
        _mm512_storeu_ps(o + 48, _mm512_fmsub_ps(u8x16_ps(_mm256_extracti128_si256(hi, 1)), D2, M2));
    }
}

TGT_AVX512 static void deq_q6_K(const uint8_t * b, float * out) {
    const float d = h2f(b + 208);
    const int8_t * sc = (const int8_t *)(b + 192);
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3), k32 = _mm256_set1_epi8(32);
    for (int n = 0; n < 2; n++) {
        const uint8_t * ql = b + 64 * n;
        const uint8_t * qh = b + 128 + 32 * n;
        const int8_t * s = sc + 8 * n;
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
        const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
        __m256i q[4];
        q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(h, m3), 4));
        q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m3), 4));
        q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m3), 4));
        q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m3), 4));
        for (int i = 0; i < 4; i++) {
            const __m256i v = _mm256_sub_epi8(q[i], k32);
            float * o = out + 128 * n + 32 * i;
            _mm512_storeu_ps(o, _mm512_mul_ps(i8x16_ps(_mm256_castsi256_si128(v)), _mm512_set1_ps(d * s[2 * i])));
            _mm512_storeu_ps(o + 16, _mm512_mul_ps(i8x16_ps(_mm256_extracti128_si256(v, 1)),
                                                   _mm512_set1_ps(d * s[2 * i + 1])));
        }
    }
}

TGT_AVX512 static void deq_q8_0(const uint8_t * b, float * out) {
    const __m512 d = _mm512_set1_ps(h2f(b));
    _mm512_storeu_ps(out, _mm512_mul_ps(i8x16_ps(_mm_loadu_si128((const __m128i *)(b + 2))), d));
    _mm512_storeu_ps(out + 16, _mm512_mul_ps(i8x16_ps(_mm_loadu_si128((const __m128i *)(b + 18))), d));
}

TGT_AVX512 static void deq_q4_0(const uint8_t * b, float * out) {
    const __m512 d = _mm512_set1_ps(h2f(b));
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 2));
    const __m128i m4 = _mm_set1_epi8(0x0F), k8 = _mm_set1_epi8(8);
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(q, m4), k8);
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(q, 4), m4), k8);
    _mm512_storeu_ps(out, _mm512_mul_ps(i8x16_ps(lo), d));
    _mm512_storeu_ps(out + 16, _mm512_mul_ps(i8x16_ps(hi), d));
}

TGT_AVX512 static void deq_q4_1(const uint8_t * b, float * out) {
    const __m512 d = _mm512_set1_ps(h2f(b)), m = _mm512_set1_ps(h2f(b + 2));
    const __m128i q = _mm_loadu_si128((const __m128i *)(b + 4));
    const __m128i m4 = _mm_set1_epi8(0x0F);
    _mm512_storeu_ps(out, _mm512_fmadd_ps(u8x16_ps(_mm_and_si128(q, m4)), d, m));
    _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(u8x16_ps(_mm_and_si128(_mm_srli_epi16(q, 4), m4)), d, m));
}

/* IQ2_XXS, IQ2_XS and IQ3_S (split --base iq2_xxs|iq2_s): the grids and sign table of iq2.c (read
 * from ggml's dequantizer), used once deq_iq (the SIMD decoder the tile families use) agrees with
 * ggml bit for bit for that type; otherwise it keeps going through ggml's. */
static const bs_iq_tables * iq_tab;
static bool iq2_ready, iq3s_ready;
static bs_once iq_once = BS_ONCE_INIT;

TGT_AVX512 static void deq_iq(enum ggml_type type, const uint8_t * b, float * out); /* below: the decoder checked */

static void iq_init(void) { /* reached only on AVX-512 CPUs */
    iq_tab = bs_iq_get_tables();
    iq2_ready = iq_tab->iq2_ok && bs_iq_decoder_agrees(GGML_TYPE_IQ2_XXS, deq_iq) &&
                bs_iq_decoder_agrees(GGML_TYPE_IQ2_XS, deq_iq);
    iq3s_ready = iq_tab->iq3s_ok && bs_iq_decoder_agrees(GGML_TYPE_IQ3_S, deq_iq);
}

/* whether this is an IQ type the tile families decode themselves here */
static bool iq_decoded(enum ggml_type type) {
    if (type != GGML_TYPE_IQ2_XXS && type != GGML_TYPE_IQ2_XS && type != GGML_TYPE_IQ3_S) {
        return false;
    }
    bs_once_run(&iq_once, iq_init);
    return type == GGML_TYPE_IQ3_S ? iq3s_ready : iq2_ready;
}

/* values [32 g, 32 g + 32) of an IQ2_XXS / IQ2_XS / IQ3_S block as f32: db * grid, negated where
 * the sign says (ggml's (db * grid) * -1, exactly) */
TGT_AVX512 static inline void iq_group(enum ggml_type type, const uint8_t * b, int g, __m512 * lo, __m512 * hi) {
    const float d = h2f(b);
    uint64_t m[4];
    uint32_t sg;
    bs_iq_group(iq_tab, type, b, g, m, &sg);
    const __m512 zero = _mm512_setzero_ps();
    const __m512 a = _mm512_mul_ps(u8x16_ps(_mm_set_epi64x((long long)m[1], (long long)m[0])),
                                   _mm512_set1_ps(bs_iq_scale(type, d, b, g, 0)));
    const __m512 c = _mm512_mul_ps(u8x16_ps(_mm_set_epi64x((long long)m[3], (long long)m[2])),
                                   _mm512_set1_ps(bs_iq_scale(type, d, b, g, 1)));
    *lo = _mm512_mask_sub_ps(a, (__mmask16)(sg & 0xffffu), zero, a);
    *hi = _mm512_mask_sub_ps(c, (__mmask16)(sg >> 16), zero, c);
}

TGT_AVX512 static void deq_iq(enum ggml_type type, const uint8_t * b, float * out) {
    for (int g = 0; g < 8; g++) {
        __m512 lo, hi;
        iq_group(type, b, g, &lo, &hi);
        _mm512_storeu_ps(out + 32 * g, lo);
        _mm512_storeu_ps(out + 32 * g + 16, hi);
    }
}

/* f32 values of elements [k0, k0 + n) of a row of `type` */
TGT_AVX512 static void deq(enum ggml_type type, const uint8_t * row, int64_t k0, int64_t n, float * out) {
    switch (type) {
        case GGML_TYPE_Q2_K:
            for (int64_t k = 0; k < n; k += QK) deq_q2_K(row + (size_t)((k0 + k) / QK) * 84, out + k);
            return;
        case GGML_TYPE_Q3_K:
            for (int64_t k = 0; k < n; k += QK) deq_q3_K(row + (size_t)((k0 + k) / QK) * 110, out + k);
            return;
        case GGML_TYPE_Q4_K:
            for (int64_t k = 0; k < n; k += QK) {
                const uint8_t * b = row + (size_t)((k0 + k) / QK) * 144;
                deq_q45_K(b, b + 4, NULL, b + 16, out + k);
            }
            return;
        case GGML_TYPE_Q5_K:
            for (int64_t k = 0; k < n; k += QK) {
                const uint8_t * b = row + (size_t)((k0 + k) / QK) * 176;
                deq_q45_K(b, b + 4, b + 16, b + 48, out + k);
            }
            return;
        case GGML_TYPE_Q6_K:
            for (int64_t k = 0; k < n; k += QK) deq_q6_K(row + (size_t)((k0 + k) / QK) * 210, out + k);
            return;
        case GGML_TYPE_Q8_0:
            for (int64_t k = 0; k < n; k += 32) deq_q8_0(row + (size_t)((k0 + k) / 32) * 34, out + k);
            return;
        case GGML_TYPE_Q4_0:
            for (int64_t k = 0; k < n; k += 32) deq_q4_0(row + (size_t)((k0 + k) / 32) * 18, out + k);
            return;
        case GGML_TYPE_Q4_1:
            for (int64_t k = 0; k < n; k += 32) deq_q4_1(row + (size_t)((k0 + k) / 32) * 20, out + k);
            return;
        case GGML_TYPE_IQ2_XXS: case GGML_TYPE_IQ2_XS: case GGML_TYPE_IQ3_S:
            if (n % QK == 0 && k0 % QK == 0 && iq_decoded(type)) {
                const size_t bb = ggml_type_size(type);
                for (int64_t k = 0; k < n; k += QK) deq_iq(type, row + (size_t)((k0 + k) / QK) * bb, out + k);
                return;
            }
            /* fall through: ggml's dequantizer */
        default: {
            const int64_t blck = ggml_blck_size(type);
            bs_dequant_row(type, row + (size_t)(k0 / blck) * ggml_type_size(type), out, n);
            return;
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * unpacking straight to bf16, in tile layout: element k of row i goes to dst[(k/32)*512 + i*32 + k%32]
 * (dst already offset to the row). For amx-bf16, base and residual are unpacked into separate
 * buffers and summed by the products (bf16(W2) + bf16(R)); avx512-bf16 sums them in f32 first. Small codes (2 to 5 bits) become bf16 through a per-block
 * table and one vpermw per 32 weights; 6- and 8-bit codes through f32.
 * ------------------------------------------------------------------------------------------- */

#define TILE_WORDS 512 /* one 16 x 32 bf16 tile */

TGT_AVX512 static inline void store_bf16(uint16_t * dst, int64_t kc, __m512 lo, __m512 hi) {
    _mm512_storeu_si512((void *)(dst + (size_t)kc * TILE_WORDS), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* words 0..31: value of the 32-entry table for each index word */
TGT_AVX512 static inline void store_lookup(uint16_t * dst, int64_t kc, __m512i idx, __m512i table) {
    _mm512_storeu_si512((void *)(dst + (size_t)kc * TILE_WORDS), _mm512_permutexvar_epi16(idx, table));
}

TGT_AVX512 static inline __m512i ramp_words(int lo_val, int hi_val) {
    /* words 0..15 = lo_val, 16..31 = hi_val */
    return _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16((short)lo_val), _mm512_set1_epi16((short)hi_val));
}

/* Q2_K: w = d*sc*q - dmin*m, q in 0..3, 16 sub-blocks of 16. Table n (sub-blocks 8n..8n+7) holds
 * entry q*8 + local sub-block. */
TGT_AVX512 static void bf16_q2_K(const uint8_t * row, int64_t k0, int64_t n_el, uint16_t * dst) {
    const __m512i e = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i sb_lo = _mm512_and_si512(e, _mm512_set1_epi32(7));            /* entries 0..15: q = e>>3 */
    const __m512 q_lo = _mm512_cvtepi32_ps(_mm512_srli_epi32(e, 3));             /* 0,0..,1,1.. */
    const __m512 q_hi = _mm512_add_ps(q_lo, _mm512_set1_ps(2.0f));               /* entries 16..31 */
    const __m256i m3 = _mm256_set1_epi8(3);
    for (int64_t sb = 0; sb < n_el / QK; sb++) {
        const uint8_t * b = row + (size_t)(k0 / QK + sb) * 84;
        const float d = h2f(b + 80), dmin = h2f(b + 82);
        const __m512i s = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
        const __m512 D = _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_and_si512(s, _mm512_set1_epi32(15))));
        const __m512 M = _mm512_mul_ps(_mm512_set1_ps(dmin), _mm512_cvtepi32_ps(_mm512_srli_epi32(s, 4)));
        const uint8_t * qs = b + 16;
        for (int n = 0; n < 2; n++) {
            const __m512i pidx = _mm512_add_epi32(sb_lo, _mm512_set1_epi32(8 * n));
            const __m512 Dp = _mm512_permutexvar_ps(pidx, D), Mp = _mm512_permutexvar_ps(pidx, M);
            const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmsub_ps(q_hi, Dp, Mp), _mm512_fmsub_ps(q_lo, Dp, Mp));
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * n));
            for (int sh = 0; sh < 4; sh++) {
                const __m256i v = _mm256_and_si256(_mm256_srli_epi16(q, 2 * sh), m3);
                const __m512i idx = _mm512_add_epi16(_mm512_slli_epi16(_mm512_cvtepu8_epi16(v), 3), ramp_words(2 * sh, 2 * sh + 1));
                store_lookup(dst, sb * 8 + n * 4 + sh, idx, table);
            }
        }
    }
}

/* Q3_K: w = d*(sc - 32)*(q2 - 4*!h); index i = q2 + 4h in 0..7 gives (i - 4). Table t (sub-blocks
 * 4t..4t+3) holds entry i*4 + local sub-block. */
TGT_AVX512 static void bf16_q3_K(const uint8_t * row, int64_t k0, int64_t n_el, uint16_t * dst) {
    const __m512i e = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i sbl = _mm512_and_si512(e, _mm512_set1_epi32(3));
    const __m512 r_lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(e, 2), _mm512_set1_epi32(4))); /* i-4, i=0..3 */
    const __m512 r_hi = _mm512_add_ps(r_lo, _mm512_set1_ps(4.0f));                                              /* i=4..7 */
    const __m256i m3 = _mm256_set1_epi8(3), four = _mm256_set1_epi8(4);
    for (int64_t sb = 0; sb < n_el / QK; sb++) {
        const uint8_t * b = row + (size_t)(k0 / QK + sb) * 110;
        const float d = h2f(b + 108);
        const __m512 D = _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bs_q3k_scales_v(b + 96))));
        __m512i tables[4];
        for (int t = 0; t < 4; t++) {
            const __m512 Dp = _mm512_permutexvar_ps(_mm512_add_epi32(sbl, _mm512_set1_epi32(4 * t)), D);
            tables[t] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(r_hi, Dp), _mm512_mul_ps(r_lo, Dp));
        }
        const __m256i h = _mm256_loadu_si256((const __m256i *)b);
        const uint8_t * qs = b + 32;
        for (int n = 0; n < 2; n++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * n));
            for (int sh = 0; sh < 4; sh++) {
                const __mmask32 set = _mm256_test_epi8_mask(h, _mm256_set1_epi8((char)(1u << (4 * n + sh))));
                __m256i v = _mm256_and_si256(_mm256_srli_epi16(q, 2 * sh), m3);
                v = _mm256_mask_add_epi8(v, set, v, four);
                const int j = 2 * sh; /* local sub-block of the first 16 within table 2n + sh/2 */
                const __m512i idx = _mm512_add_epi16(_mm512_slli_epi16(_mm512_cvtepu8_epi16(v), 2), ramp_words(j % 4, j % 4 + 1));
                store_lookup(dst, sb * 8 + n * 4 + sh, idx, tables[2 * n + sh / 2]);
            }
        }
    }
}

/* Q4_K (qh == NULL: 4 bits) and Q5_K (5 bits): w = d*sc*q - dmin*m, sub-blocks of 32. */
TGT_AVX512 static void bf16_q45_K(const uint8_t * row, int64_t k0, int64_t n_el, uint16_t * dst, bool q5) {
    const __m512 ramp = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 ramp16 = _mm512_add_ps(ramp, _mm512_set1_ps(16.0f));
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const size_t bsz = q5 ? 176 : 144;
    for (int64_t sb = 0; sb < n_el / QK; sb++) {
        const uint8_t * b = row + (size_t)(k0 / QK + sb) * bsz;
        const float d = h2f(b), dmin = h2f(b + 2);
        const uint8_t * scales = b + 4;
        const uint8_t * qh = q5 ? b + 16 : NULL;
        const uint8_t * qs = b + (q5 ? 48 : 16);
        const __m256i hb = q5 ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            uint8_t s1, m1, s2, m2;
            bs_k4_scale_min(2 * j, scales, &s1, &m1);
            bs_k4_scale_min(2 * j + 1, scales, &s2, &m2);
            const __m512 D1 = _mm512_set1_ps(d * s1), M1 = _mm512_set1_ps(dmin * m1);
            const __m512 D2 = _mm512_set1_ps(d * s2), M2 = _mm512_set1_ps(dmin * m2);
            const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
            __m256i lo = _mm256_and_si256(q, m4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            __m512i t1, t2;
            if (q5) {
                lo = _mm256_mask_add_epi8(lo, _mm256_test_epi8_mask(hb, _mm256_set1_epi8((char)(1u << (2 * j)))), lo, _mm256_set1_epi8(16));
                hi = _mm256_mask_add_epi8(hi, _mm256_test_epi8_mask(hb, _mm256_set1_epi8((char)(2u << (2 * j)))), hi, _mm256_set1_epi8(16));
                t1 = (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmsub_ps(ramp16, D1, M1), _mm512_fmsub_ps(ramp, D1, M1));
                t2 = (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmsub_ps(ramp16, D2, M2), _mm512_fmsub_ps(ramp, D2, M2));
                store_lookup(dst, sb * 8 + 2 * j, _mm512_cvtepu8_epi16(lo), t1);
                store_lookup(dst, sb * 8 + 2 * j + 1, _mm512_cvtepu8_epi16(hi), t2);
            } else {
                /* one table for both sub-blocks: entries 0..15 for the first, 16..31 for the second */
                t1 = (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmsub_ps(ramp, D2, M2), _mm512_fmsub_ps(ramp, D1, M1));
                store_lookup(dst, sb * 8 + 2 * j, _mm512_cvtepu8_epi16(lo), t1);
                store_lookup(dst, sb * 8 + 2 * j + 1, _mm512_add_epi16(_mm512_cvtepu8_epi16(hi), _mm512_set1_epi16(16)), t1);
            }
        }
    }
}

/* Q6_K: w = d*sc*(q - 32), sub-blocks of 16, through f32 */
TGT_AVX512 static void bf16_q6_K(const uint8_t * row, int64_t k0, int64_t n_el, uint16_t * dst) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3), k32 = _mm256_set1_epi8(32);
    for (int64_t sb = 0; sb < n_el / QK; sb++) {
        const uint8_t * b = row + (size_t)(k0 / QK + sb) * 210;
        const float d = h2f(b + 208);
        const int8_t * sc = (const int8_t *)(b + 192);
        for (int n = 0; n < 2; n++) {
            const uint8_t * ql = b + 64 * n;
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            const __m256i h = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * n));
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(h, m3), 4));
            q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m3), 4));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m3), 4));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                   _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m3), 4));
            for (int i = 0; i < 4; i++) {
                const __m256i v = _mm256_sub_epi8(q[i], k32);
                const int j = 8 * n + 2 * i;
                store_bf16(dst, sb * 8 + 4 * n + i,
                           _mm512_mul_ps(i8x16_ps(_mm256_castsi256_si128(v)), _mm512_set1_ps(d * sc[j])),
                           _mm512_mul_ps(i8x16_ps(_mm256_extracti128_si256(v, 1)), _mm512_set1_ps(d * sc[j + 1])));
            }
        }
    }
}

TGT_AVX512 static void bf16_q8_0(const uint8_t * row, int64_t k0, int64_t n_el, uint16_t * dst) {
    for (int64_t kb = 0; kb < n_el / 32; kb++) {
        const uint8_t * b = row + (size_t)(k0 / 32 + kb) * 34;
        const __m512 d = _mm512_set1_ps(h2f(b));
        store_bf16(dst, kb, _mm512_mul_ps(i8x16_ps(_mm_loadu_si128((const __m128i *)(b + 2))), d),
                   _mm512_mul_ps(i8x16_ps(_mm_loadu_si128((const __m128i *)(b + 18))), d));
    }
}

TGT_AVX512 static void bf16_iq(enum ggml_type type, const uint8_t * row, int64_t k0, int64_t n_el, uint16_t * dst) {
    const size_t bb = ggml_type_size(type);
    for (int64_t sb = 0; sb < n_el / QK; sb++) {
        const uint8_t * b = row + (size_t)(k0 / QK + sb) * bb;
        for (int g = 0; g < 8; g++) {
            __m512 lo, hi;
            iq_group(type, b, g, &lo, &hi);
            store_bf16(dst, sb * 8 + g, lo, hi);
        }
    }
}

/* anything else: f32 through deq() (fast for Q4_0/Q4_1, ggml's dequantizer otherwise) */
TGT_AVX512 static void bf16_any(enum ggml_type type, const uint8_t * row, int64_t k0, int64_t n_el, uint16_t * dst,
                                float * tmp) {
    const int64_t ch = n_el % QK == 0 ? QK : 32;
    for (int64_t k = 0; k < n_el; k += ch) {
        deq(type, row, k0 + k, ch, tmp);
        for (int64_t j = 0; j < ch; j += 32) {
            store_bf16(dst, (k + j) / 32, _mm512_loadu_ps(tmp + j), _mm512_loadu_ps(tmp + j + 16));
        }
    }
}

/* elements [k0, k0 + n) of a row (n: multiple of 256 when the row's K allows, else of 32) */
TGT_AVX512 static void unpack_row_bf16(enum ggml_type type, const uint8_t * row, int64_t k0, int64_t n, uint16_t * dst,
                                       float * tmp) {
    if (n % QK == 0 && k0 % QK == 0) {
        switch (type) {
            case GGML_TYPE_Q2_K: bf16_q2_K(row, k0, n, dst); return;
            case GGML_TYPE_Q3_K: bf16_q3_K(row, k0, n, dst); return;
            case GGML_TYPE_Q4_K: bf16_q45_K(row, k0, n, dst, false); return;
            case GGML_TYPE_Q5_K: bf16_q45_K(row, k0, n, dst, true); return;
            case GGML_TYPE_Q6_K: bf16_q6_K(row, k0, n, dst); return;
            case GGML_TYPE_IQ2_XXS: case GGML_TYPE_IQ2_XS: case GGML_TYPE_IQ3_S:
                if (iq_decoded(type)) {
                    bf16_iq(type, row, k0, n, dst);
                    return;
                }
                break;
            default: break;
        }
    }
    if (type == GGML_TYPE_Q8_0) {
        bf16_q8_0(row, k0, n, dst);
        return;
    }
    bf16_any(type, row, k0, n, dst, tmp);
}

/* bf16(f32(W2) + f32(R)) of elements [k0, k0 + ch) of one row, in tile layout: one weight, one
 * product per column (tmp: 2 x ch floats) */
TGT_AVX512 static void unpack_row_sum_bf16(const bs_job * job, int64_t row, int64_t k0, int64_t ch, uint16_t * dst,
                                           float * tmp) {
    float * a = tmp, * r = tmp + ch;
    deq(job->w2_type, job->w2 + (size_t)row * job->w2_row_bytes, k0, ch, a);
    deq(job->r_type, job->r + (size_t)row * job->r_row_bytes, k0, ch, r);
    for (int64_t j = 0; j < ch; j += 32) {
        store_bf16(dst, j / 32, _mm512_add_ps(_mm512_loadu_ps(a + j), _mm512_loadu_ps(r + j)),
                   _mm512_add_ps(_mm512_loadu_ps(a + j + 16), _mm512_loadu_ps(r + j + 16)));
    }
}

/* Elements [k0, k0 + n) of rows [r0, r0+16) of base and residual as bf16 tiles: abuf[k/32][16][32]
 * (k relative to k0) and rbuf (same layout). Rows past N are zero. ``merged``: W2 + R summed in
 * f32 and rounded once into rbuf (abuf unused), so that a product reads one weight, not two. */
TGT_AVX512 static void unpack_rowblock(const bs_job * job, int64_t r0, int64_t k0, int64_t n, uint16_t * abuf,
                                       uint16_t * rbuf, float * tmp, bool merged) {
    const int64_t rows = job->N - r0 < BS_ROW_BLOCK ? job->N - r0 : BS_ROW_BLOCK;
    /* chunk by chunk, all rows of a chunk together: one row across all of K would write lines 1 KB
     * apart, which all fall into 4 of the 64 L1 sets and evict each other */
    const int64_t ch = (n % QK == 0 && k0 % QK == 0) ? QK : 32;
    for (int64_t c0 = 0; c0 < n; c0 += ch) {
        const size_t off = (size_t)(c0 / 32) * TILE_WORDS;
        for (int64_t i = 0; i < BS_ROW_BLOCK; i++) {
            if (i >= rows) {
                for (int64_t kc = 0; kc < ch / 32; kc++) {
                    memset(rbuf + off + (size_t)kc * TILE_WORDS + i * 32, 0, 64);
                    if (job->w2 && !merged) memset(abuf + off + (size_t)kc * TILE_WORDS + i * 32, 0, 64);
                }
                continue;
            }
            if (merged && job->w2) {
                unpack_row_sum_bf16(job, r0 + i, k0 + c0, ch, rbuf + off + i * 32, tmp);
                continue;
            }
            unpack_row_bf16(job->r_type, job->r + (size_t)(r0 + i) * job->r_row_bytes, k0 + c0, ch,
                            rbuf + off + i * 32, tmp);
            if (job->w2) {
                unpack_row_bf16(job->w2_type, job->w2 + (size_t)(r0 + i) * job->w2_row_bytes, k0 + c0, ch,
                                abuf + off + i * 32, tmp);
            }
        }
    }
}

static bool fast_types(const bs_job * job) {
    if (job->r == NULL || job->precision != BITSPLIT_PREC_BF16 || job->K % 32 != 0) {
        return false;
    }
    /* every quantized residual type split makes (--residual q4_k|q5_k|q6_k|q8_0 and auto's mixes):
     * each has its own unpacker; a superblock type needs whole superblocks in the unpack chunk */
    const enum ggml_type r = job->r_type;
    if (r != GGML_TYPE_Q4_K && r != GGML_TYPE_Q5_K && r != GGML_TYPE_Q6_K && r != GGML_TYPE_Q8_0) {
        return false;
    }
    const int64_t ch = job->K % QK == 0 ? QK : 32;
    if (ch % ggml_blck_size(r) != 0) {
        return false;
    }
    if (job->w2 == NULL) {
        return true;
    }
    const enum ggml_type w = job->w2_type;
    if (w == GGML_TYPE_F32 || w == GGML_TYPE_F16 || w == GGML_TYPE_BF16) {
        return false;
    }
    /* any other readable type: unpacked through ggml's dequantizer when it has no fast path;
     * its block must divide the unpack chunk */
    return bs_type_readable(w) && ch % ggml_blck_size(w) == 0;
}

/* ---------------------------------------------------------------------------------------------
 * avx512-bf16 family
 * ------------------------------------------------------------------------------------------- */

/* AVX-512 F, BW, VL, DQ and BF16, FMA, F16C (cpu_feats.c) */
static bool avx512_available(void) { return bs_cpu_has(BS_CPU_NEED_AVX512_BF16); }

static size_t avx512_acts_size(const bs_job * job) { return (size_t)job->K * (size_t)job->n_cols * 2 + 64; }

TGT_AVX512 static void avx512_prepare_acts(const bs_job * job, int64_t c0, int64_t c1) {
    uint16_t * a = job->acts;
    for (int64_t c = c0; c < c1; c++) {
        const float * x = job->x + c * job->ldx;
        uint16_t * o = a + (size_t)c * job->K;
        for (int64_t k = 0; k < job->K; k += 32) {
            const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(x + k));
            _mm512_storeu_si512((void *)(o + k), (__m512i)v);
        }
    }
}

TGT_AVX512 static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

/* rbuf (and abuf where `base`: a second weight buffer) times every activation column */
TGT_AVX512 static void avx512_block_product(const bs_job * job, const uint16_t * abuf, const uint16_t * rbuf, int64_t r0,
                                            bool base) {
    const int64_t K = job->K, nkc = K / 32;
    const uint16_t * acts = job->acts;
    const int64_t rows = job->N - r0 < BS_ROW_BLOCK ? job->N - r0 : BS_ROW_BLOCK;
    for (int64_t i0 = 0; i0 < rows; i0 += 4) {
        const int64_t ni = rows - i0 < 4 ? rows - i0 : 4;
        int64_t c = 0;
        for (; c + 4 <= job->n_cols; c += 4) {
            __m512 acc[4][4];
            for (int a = 0; a < 4; a++)
                for (int b = 0; b < 4; b++) acc[a][b] = _mm512_setzero_ps();
            for (int64_t kc = 0; kc < nkc; kc++) {
                __m512bh x[4];
                for (int b = 0; b < 4; b++) x[b] = (__m512bh)_mm512_loadu_si512(acts + (size_t)(c + b) * K + kc * 32);
                for (int a = 0; a < 4; a++) {
                    const size_t o = (size_t)kc * TILE_WORDS + (i0 + a) * 32;
                    const __m512bh wr = (__m512bh)_mm512_loadu_si512(rbuf + o);
                    if (base) {
                        const __m512bh wb = (__m512bh)_mm512_loadu_si512(abuf + o);
                        for (int b = 0; b < 4; b++) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], wb, x[b]);
                    }
                    for (int b = 0; b < 4; b++) acc[a][b] = _mm512_dpbf16_ps(acc[a][b], wr, x[b]);
                }
            }
            for (int a = 0; a < ni; a++)
                for (int b = 0; b < 4; b++) {
                    float * y = job->y + (c + b) * job->ldy + r0 + i0 + a;
                    const float v = hsum(acc[a][b]);
                    *y = job->accumulate ? *y + v : v;
                }
        }
        for (; c < job->n_cols; c++) {
            __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int64_t kc = 0; kc < nkc; kc++) {
                const __m512bh x = (__m512bh)_mm512_loadu_si512(acts + (size_t)c * K + kc * 32);
                for (int a = 0; a < 4; a++) {
                    const size_t o = (size_t)kc * TILE_WORDS + (i0 + a) * 32;
                    if (base) acc[a] = _mm512_dpbf16_ps(acc[a], (__m512bh)_mm512_loadu_si512(abuf + o), x);
                    acc[a] = _mm512_dpbf16_ps(acc[a], (__m512bh)_mm512_loadu_si512(rbuf + o), x);
                }
            }
            for (int a = 0; a < ni; a++) {
                float * y = job->y + c * job->ldy + r0 + i0 + a;
                const float v = hsum(acc[a]);
                *y = job->accumulate ? *y + v : v;
            }
        }
    }
}

/* two bf16 row blocks (base, residual), an f32 unpack buffer, an f32 16x16 tile */
static size_t rowblock_scratch(const bs_job * job) {
    return 2 * (size_t)job->K * BS_ROW_BLOCK * 2 + 2 * QK * sizeof(float) + 16 * 16 * sizeof(float) + 1024;
}

TGT_AVX512 static void avx512_rows(const bs_job * job, int64_t r0, int64_t r1, bs_scratch * scratch) {
    uint16_t * abuf = bs_scratch_get(scratch, rowblock_scratch(job));
    if (abuf == NULL) {
        return;
    }
    uint16_t * rbuf = abuf + (size_t)job->K * BS_ROW_BLOCK;
    float * tmp = (float *)(rbuf + (size_t)job->K * BS_ROW_BLOCK);
    for (int64_t r = r0; r < r1; r += BS_ROW_BLOCK) {
        unpack_rowblock(job, r, 0, job->K, abuf, rbuf, tmp, true);
        avx512_block_product(job, abuf, rbuf, r, false);
    }
}

const bs_kernel_family bs_family_avx512_bf16 = {
    "avx512-bf16", BS_ISA_AVX512, avx512_available, fast_types, avx512_acts_size, avx512_prepare_acts, avx512_rows, 0,
};

/* ---------------------------------------------------------------------------------------------
 * amx-bf16 family
 * ------------------------------------------------------------------------------------------- */

/* those and the tiles, with this process's permission to use them (cpu_feats.c) */
static bool amx_available(void) { return bs_cpu_amx_ready(); }

/* activations as B tiles: [group of 16 columns][k/32][16 k-pairs][16 columns][2] */
static size_t amx_acts_size(const bs_job * job) {
    const int64_t groups = (job->n_cols + 15) / 16;
    return (size_t)groups * (size_t)job->K * 16 * 2 + 64;
}

TGT_AVX512 static void amx_prepare_acts(const bs_job * job, int64_t c0, int64_t c1) {
    const int64_t K = job->K, nkc = K / 32;
    uint16_t * a = job->acts;
    /* each thread writes its own columns (4-byte pairs: no two threads touch the same bytes);
     * the thread ending at n_cols also zeroes the padding columns of the last group */
    const int64_t end = c1 == job->n_cols ? (job->n_cols + 15) / 16 * 16 : c1;
    for (int64_t c = c0; c < end; c++) {
        const int64_t g = c / 16, j = c % 16;
        uint16_t * tile0 = a + (size_t)g * (size_t)nkc * 512;
        const float * x = c < job->n_cols ? job->x + c * job->ldx : NULL;
        for (int64_t kc = 0; kc < nkc; kc++) {
            uint16_t * t = tile0 + (size_t)kc * 512;
            uint32_t pairs[16];
            if (x == NULL) {
                memset(pairs, 0, sizeof(pairs));
            } else {
                const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + kc * 32 + 16), _mm512_loadu_ps(x + kc * 32));
                _mm512_storeu_si512((void *)pairs, (__m512i)v);
            }
            for (int p = 0; p < 16; p++) {
                memcpy(t + p * 32 + 2 * j, &pairs[p], 4);
            }
        }
    }
}

/* accumulator tiles 0..ng-1 (columns c0 + 16 * tile ...) -> y rows [r0, r0 + rows) */
TGT_AMX static void store_tiles(const bs_job * job, int64_t r0, int64_t rows, int64_t c0, int64_t ng, float * ctmp) {
    for (int64_t gi = 0; gi < ng; gi++) {
        switch (gi) {
            case 0: BS_TILE_STORED(0, ctmp, 64); break;
            case 1: BS_TILE_STORED(1, ctmp, 64); break;
            case 2: BS_TILE_STORED(2, ctmp, 64); break;
            default: BS_TILE_STORED(3, ctmp, 64); break;
        }
        const int64_t cbase = c0 + gi * 16;
        const int64_t ncol = job->n_cols - cbase < 16 ? job->n_cols - cbase : 16;
        for (int64_t j = 0; j < ncol; j++) {
            float * y = job->y + (cbase + j) * job->ldy + r0;
            if (job->accumulate) {
                for (int64_t i = 0; i < rows; i++) y[i] += ctmp[i * 16 + j];
            } else {
                for (int64_t i = 0; i < rows; i++) y[i] = ctmp[i * 16 + j];
            }
        }
    }
}

/* GCC 12 drops the stores that fill a tile config passed to _tile_loadconfig (seen in llama.cpp's
 * AMX code); an asm memory operand keeps them. */
TGT_AMX static inline void load_cfg(const bs_tile_cfg * c) { __asm__ volatile("ldtilecfg %0" ::"m"(*c) : "memory"); }
TGT_AMX static inline void store_cfg(bs_tile_cfg * c) { __asm__ volatile("sttilecfg %0" : "=m"(*c)::"memory"); }

/* One K-chunk for up to 4 groups of 16 columns: tile 4 holds the W2 chunk (when there is a base),
 * tile 5 the residual chunk; activation tiles alternate between 6 and 7, accumulators are 0..3. */
#define BS_GROUP(C, B, OFF)                  \
    BS_TILE_LOADD(B, bt + (OFF) * gstride, 64); \
    if (base) _tile_dpbf16ps(C, 4, B);        \
    _tile_dpbf16ps(C, 5, B);
#define BS_TILE_GROUPS(bt, gstride, ng, base) \
    BS_GROUP(0, 6, 0)                         \
    if (ng > 1) { BS_GROUP(1, 7, 1) }         \
    if (ng > 2) { BS_GROUP(2, 6, 2) }         \
    if (ng > 3) { BS_GROUP(3, 7, 3) }

TGT_AMX static void amx_block_product(const bs_job * job, const uint16_t * abuf, const uint16_t * rbuf, int64_t r0,
                                      float * ctmp) {
    const int64_t K = job->K, nkc = K / 32;
    const int64_t groups = (job->n_cols + 15) / 16;
    const uint16_t * acts = job->acts;
    const bool base = job->w2 != NULL;
    const int64_t rows = job->N - r0 < BS_ROW_BLOCK ? job->N - r0 : BS_ROW_BLOCK;
    const size_t gstride = (size_t)nkc * TILE_WORDS;
    /* tiles: 0-3 accumulators (one per group of 16 columns), 4 base, 5 residual, 6/7 activations */
    for (int64_t g0 = 0; g0 < groups; g0 += 4) {
        const int64_t ng = groups - g0 < 4 ? groups - g0 : 4;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kc = 0; kc < nkc; kc++) {
            if (base) BS_TILE_LOADD(4, abuf + (size_t)kc * TILE_WORDS, 64);
            BS_TILE_LOADD(5, rbuf + (size_t)kc * TILE_WORDS, 64);
            const uint16_t * bt = acts + ((size_t)g0 * (size_t)nkc + (size_t)kc) * TILE_WORDS;
            BS_TILE_GROUPS(bt, gstride, ng, base)
        }
        store_tiles(job, r0, rows, g0 * 16, ng, ctmp);
    }
}

/* up to 64 columns: the 4 accumulator tiles stay resident while K streams through in chunks that
 * are unpacked into L1 (16 rows x 256 x 2 buffers = 16 KB) and multiplied at once */
TGT_AMX static void amx_block_streaming(const bs_job * job, int64_t r0, uint16_t * abuf, uint16_t * rbuf, float * tmp,
                                        float * ctmp) {
    const int64_t K = job->K, nkc = K / 32;
    const int64_t ng = (job->n_cols + 15) / 16;
    const int64_t ch = K % QK == 0 ? QK : 32;
    const uint16_t * acts = job->acts;
    const bool base = job->w2 != NULL;
    const size_t gstride = (size_t)nkc * TILE_WORDS;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k0 = 0; k0 < K; k0 += ch) {
        unpack_rowblock(job, r0, k0, ch, abuf, rbuf, tmp, false);
        for (int64_t t = 0; t < ch / 32; t++) {
            if (base) BS_TILE_LOADD(4, abuf + (size_t)t * TILE_WORDS, 64);
            BS_TILE_LOADD(5, rbuf + (size_t)t * TILE_WORDS, 64);
            const uint16_t * bt = acts + (size_t)(k0 / 32 + t) * TILE_WORDS;
            BS_TILE_GROUPS(bt, gstride, ng, base)
        }
    }
    const int64_t rows = job->N - r0 < BS_ROW_BLOCK ? job->N - r0 : BS_ROW_BLOCK;
    store_tiles(job, r0, rows, 0, ng, ctmp);
}

#undef BS_TILE_GROUPS
#undef BS_GROUP

TGT_AMX static void amx_rows(const bs_job * job, int64_t r0, int64_t r1, bs_scratch * scratch) {
    uint16_t * abuf = bs_scratch_get(scratch, rowblock_scratch(job));
    if (abuf == NULL) {
        return;
    }
    uint16_t * rbuf = abuf + (size_t)job->K * BS_ROW_BLOCK;
    float * tmp = (float *)(rbuf + (size_t)job->K * BS_ROW_BLOCK);
    float * ctmp = tmp + 2 * QK;
    bs_tile_cfg saved, cfg;
    bs_tile_cfg_8x16x64(&cfg);
    store_cfg(&saved); /* whoever else uses tiles on this thread (ggml's AMX code) gets its config back */
    load_cfg(&cfg);
    const bool streaming = job->n_cols <= 64;
    for (int64_t r = r0; r < r1; r += BS_ROW_BLOCK) {
        if (streaming) {
            amx_block_streaming(job, r, abuf, rbuf, tmp, ctmp);
        } else {
            unpack_rowblock(job, r, 0, job->K, abuf, rbuf, tmp, false);
            amx_block_product(job, abuf, rbuf, r, ctmp);
        }
    }
    if (saved.palette != 0) {
        load_cfg(&saved);
    } else {
        _tile_release();
    }
}

const bs_kernel_family bs_family_amx_bf16 = {
    "amx-bf16", BS_ISA_AMX, amx_available, fast_types, amx_acts_size, amx_prepare_acts, amx_rows, 0,
};

#endif /* __x86_64__ */
