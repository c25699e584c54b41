/*
 * Attention for batch-invariant verification (native/attn.c) with AVX2 + FMA + F16C.
 *
 * Products: vectorised over outputs (8 per register, 32 x 2 columns per step), each output a
 * sequential fused multiply-add over k: bit-identical to the portable kernel's fmaf chain, and
 * the same whatever the block it falls in. Exponentials: the portable function's operations lane
 * by lane (the same values).
 */
#if defined(__x86_64__)

#define _GNU_SOURCE
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "bs_internal.h"

#define TGT __attribute__((target("avx2,fma,f16c")))
#define INL TGT static inline __attribute__((always_inline))

/* ---------------------------------------------------------------------------------------------
 * products
 * ------------------------------------------------------------------------------------------- */

/* outputs [i, i + 8 * NV) of NC columns */
#define BLOCK(NC, NV)                                                                                       \
    do {                                                                                                    \
        __m256 acc[NC][NV];                                                                                 \
        for (int c_ = 0; c_ < (NC); c_++)                                                                   \
            for (int v_ = 0; v_ < (NV); v_++) acc[c_][v_] = _mm256_setzero_ps();                            \
        for (int64_t k = 0; k < K; k++) {                                                                   \
            float w_[NC];                                                                                   \
            bool any_ = false;                                                                              \
            for (int c_ = 0; c_ < (NC); c_++) {                                                             \
                w_[c_] = bs_[c_][k];                                                                        \
                any_ |= w_[c_] != 0.0f;                                                                     \
            }                                                                                               \
            if (!any_) continue; /* a zero term leaves every sum as it is */                                \
            const float * tk = g->t + k * T + i;                                                            \
            __m256 t_[NV];                                                                                  \
            for (int v_ = 0; v_ < (NV); v_++) t_[v_] = _mm256_loadu_ps(tk + 8 * v_);                        \
            for (int c_ = 0; c_ < (NC); c_++) {                                                             \
                const __m256 wv_ = _mm256_set1_ps(w_[c_]);                                                  \
                for (int v_ = 0; v_ < (NV); v_++) acc[c_][v_] = _mm256_fmadd_ps(t_[v_], wv_, acc[c_][v_]);  \
            }                                                                                               \
        }                                                                                                   \
        for (int c_ = 0; c_ < (NC); c_++)                                                                   \
            for (int v_ = 0; v_ < (NV); v_++) store_part(ys_[c_] + i + 8 * v_, acc[c_][v_], M - i - 8 * v_); \
    } while (0)

INL void store_part(float * y, __m256 v, int64_t room) {
    if (room >= 8) {
        _mm256_storeu_ps(y, v);
    } else if (room > 0) {
        float tmp[8];
        _mm256_storeu_ps(tmp, v);
        memcpy(y, tmp, (size_t)room * sizeof(float));
    }
}

INL void columns(const bs_attn_args * g, const float * const * bs_, float * const * ys_, int nc) {
    const int64_t K = g->K, M = g->M, T = g->t_row;
    int64_t i = 0;
    if (nc == 2) {
        for (; i + 32 <= T; i += 32) BLOCK(2, 4);
        for (; i < T; i += 8) BLOCK(2, 1);
    } else {
        for (; i + 32 <= T; i += 32) BLOCK(1, 4);
        for (; i < T; i += 8) BLOCK(1, 1);
    }
}

TGT void bs_attn_product_avx2(const bs_attn_args * g, int64_t c0, int64_t c1) {
    int64_t c = c0;
    for (; c + 1 < c1; c += 2) {
        const float * bs[2] = {(const float *)(g->b + c * g->b_col), (const float *)(g->b + (c + 1) * g->b_col)};
        float * ys[2] = {(float *)(g->y + c * g->y_col), (float *)(g->y + (c + 1) * g->y_col)};
        columns(g, bs, ys, 2);
    }
    if (c < c1) {
        const float * bs[1] = {(const float *)(g->b + c * g->b_col)};
        float * ys[1] = {(float *)(g->y + c * g->y_col)};
        columns(g, bs, ys, 1);
    }
}

/* ---------------------------------------------------------------------------------------------
 * transposition of a cache slice to f32 (8 x 8 blocks)
 * ------------------------------------------------------------------------------------------- */

INL __m256 load_row8(const char * row, bool f16, int64_t k) {
    if (f16) {
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + k * 2)));
    }
    return _mm256_loadu_ps((const float *)row + k);
}

INL void transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

TGT void bs_attn_transpose_avx2(const char * a, size_t a_row, bool f16, int64_t K, int64_t M, float * t, int64_t t_row) {
    const int64_t K8 = K & ~(int64_t)7;
    for (int64_t i0 = 0; i0 < t_row; i0 += 8) {
        const char * rows[8];
        for (int r = 0; r < 8; r++) {
            rows[r] = i0 + r < M ? a + (i0 + r) * a_row : NULL;
        }
        for (int64_t k = 0; k < K8; k += 8) {
            __m256 v[8];
            for (int r = 0; r < 8; r++) {
                v[r] = rows[r] != NULL ? load_row8(rows[r], f16, k) : _mm256_setzero_ps();
            }
            transpose8(v);
            for (int j = 0; j < 8; j++) {
                _mm256_storeu_ps(t + (k + j) * t_row + i0, v[j]);
            }
        }
        for (int64_t k = K8; k < K; k++) {
            for (int r = 0; r < 8; r++) {
                t[k * t_row + i0 + r] = rows[r] == NULL ? 0.0f
                                        : f16           ? _cvtsh_ss(((const uint16_t *)rows[r])[k])
                                                        : ((const float *)rows[r])[k];
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * exponentials: attn.c's exp_generic, lane by lane
 * ------------------------------------------------------------------------------------------- */

INL __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.0f);
    const __m256 valid = _mm256_cmp_ps(x, lo, _CMP_GE_OQ); /* false for -inf and NaN: 0 */
    x = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
    const __m256 out = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(y), e));
    return _mm256_and_ps(out, valid);
}

TGT void bs_attn_exp_row_avx2(const float * x, float * y, int64_t n, float max) {
    const __m256 m = _mm256_set1_ps(max);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        _mm256_storeu_ps(y + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), m)));
    }
    if (i < n) {
        float tmp[8];
        for (int j = 0; j < 8; j++) {
            tmp[j] = i + j < n ? x[i + j] : -INFINITY;
        }
        _mm256_storeu_ps(tmp, exp8(_mm256_sub_ps(_mm256_loadu_ps(tmp), m)));
        memcpy(y + i, tmp, (size_t)(n - i) * sizeof(float));
    }
}

#endif /* __x86_64__ */
