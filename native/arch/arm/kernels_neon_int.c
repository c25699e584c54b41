/*
 * The ARM integer family ("neon-int16"): x86's avx2-int16 arithmetic with the Armv8.2 dot product
 * (SDOT: FEAT_DotProd, Apple M1 and later, Graviton 2/3/4, Ampere Altra, Cortex-A55/A76 and later),
 * for the batch sizes of decoding and verification, where neon-f32 spends most of its instructions
 * unpacking weights to f32.
 *
 * The same integers and the same float operations in the same order as avx2-int16
 * (native/arch/x86/kernels_avx2_int.c, which explains the scheme), so the two families give
 * bit-identical results: native/tests/neon_qemu.sh requires it, running this family under
 * qemu-aarch64-static against avx2-int16 on the same vectors. In short: each column's activations
 * are cut into blocks of QA values (256 where a superblock type is in the product, else 32), scaled
 * to integers |X| <= 32512 kept as two base-255 digits (one, |X| <= 127, for the fast drafter; a
 * product of the residual alone takes the high digit alone in the blocks without an outlier);
 * weights are per group of 32 values byte codes u with W = d * sc * u + O per half of 16 (superblock
 * types: integer scales sc, sums exact in int32 over a unit) or W = D u + O (block-32 types, D per
 * group); Q8_0 is taken as its signed bytes. Where avx2-int16 multiplies with vpmaddubsw +
 * vpmaddwd (8 lanes, each the sum over 4 consecutive values), SDOT gives the same 4-value sums,
 * 4 lanes per 16 values: avx2-int16's lanes 0-3 are the low half's, 4-7 the high half's, kept here
 * as two float32x4 in every accumulator, and summed at the end of a row in avx2-int16's order.
 *
 * Memory: one row at a time; each unit of weights (QA values) is decoded once into a buffer that
 * stays in L1, then applied to every column. Each weight block is read once per product.
 */
#if defined(__aarch64__)

#define _GNU_SOURCE
#include <arm_neon.h>
#include <stdlib.h>
#include <string.h>

#include "bitsplit.h"
#include "bs_internal.h"
#include "cpu_feats.h"

#define TGT __attribute__((target("arch=armv8.2-a+dotprod")))
#define INL TGT static inline __attribute__((always_inline))

#include "bs_codes.h" /* the type codes and the activation layout, avx2-int16's */

/* the dot product (FEAT_DotProd; cpu_feats.c) */
static bool dot_cpu(void) { return bs_cpu_has(BS_CPU_DOTPROD); }

/* the same jobs avx2-int16 takes (the types a split holds, rows a multiple of their block) */
static bool dot_supports(const bs_job * job) { return bs_f32_family_supports(job); }

static size_t dot_acts_size(const bs_job * job) { return (size_t)job->n_cols * int16_col_bytes(job) + 64; }

/* one column's integers, digits and sums (bs_codes.h's layout), as avx2-int16's int16_prepare_acts
 * computes them */
TGT static void dot_prepare_acts(const bs_job * job, int64_t c0, int64_t c1) {
    const int64_t K = job->K, qa = int16_qa(job);
    const bool coarse = job->draft; /* the fast drafter: one digit */
    const int xmax = coarse ? BS_XMAX1 : BS_XMAX2;
    const size_t cb = int16_col_bytes(job);
    const int32x4_t lim = vdupq_n_s32(xmax), nlim = vdupq_n_s32(-xmax);
    const float32x4_t inv255 = vdupq_n_f32(1.0f / 255.0f);
    for (int64_t c = c0; c < c1; c++) {
        const float * x = job->x + c * job->ldx;
        uint8_t * col = (uint8_t *)job->acts + (size_t)c * cb;
        int8_t * d0 = (int8_t *)col, * d1 = (int8_t *)col + K;
        float * xs16 = (float *)(col + 2 * K), * xh16 = xs16 + K / 16, * sv = xh16 + K / 16;
        uint8_t * hiv = (uint8_t *)(sv + K / qa);
        for (int64_t t = 0; t < K / qa; t++) {
            const float * xb = x + t * qa;
            float32x4_t mx = vdupq_n_f32(0.0f);
            for (int64_t i = 0; i < qa; i += 4) mx = vmaxq_f32(mx, vabsq_f32(vld1q_f32(xb + i)));
            const float amax = vmaxvq_f32(mx);
            sv[t] = amax / (float)xmax;
            const float32x4_t inv = vdupq_n_f32(amax > 0.0f ? (float)xmax / amax : 0.0f);
            int64_t sabs = 0; /* sum |X| over the block (exact) */
            for (int64_t i = 0; i < qa; i += 16) {
                int32_t sum = 0, sumh = 0;
                for (int64_t j = i; j < i + 16; j += 4) {
                    int32x4_t X = vcvtnq_s32_f32(vmulq_f32(vld1q_f32(xb + j), inv)); /* to nearest, ties to even */
                    X = vmaxq_s32(vminq_s32(X, lim), nlim);
                    sum += vaddvq_s32(X);
                    sabs += vaddvq_s32(vabsq_s32(X));
                    /* X = 255 hi + lo, hi = round(X / 255) as avx2-int16 computes it, |lo| <= 127 */
                    const int32x4_t hi = coarse ? vdupq_n_s32(0) : vcvtnq_s32_f32(vmulq_f32(vcvtq_f32_s32(X), inv255));
                    const int32x4_t lo = vsubq_s32(X, vmulq_n_s32(hi, 255));
                    sumh += vaddvq_s32(hi);
                    int32_t l4[4], h4[4];
                    vst1q_s32(l4, lo);
                    vst1q_s32(h4, hi);
                    for (int l = 0; l < 4; l++) {
                        d0[t * qa + j + l] = (int8_t)l4[l];
                        d1[t * qa + j + l] = (int8_t)h4[l];
                    }
                }
                xs16[(t * qa + i) / 16] = (float)sum;
                xh16[(t * qa + i) / 16] = 255.0f * (float)sumh;
            }
            hiv[t] = !coarse && (int64_t)BS_HI_SPAN * sabs >= qa * (int64_t)xmax;
        }
    }
}

static inline float h2f(const uint8_t * p) {
    __fp16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

/* one unit of one half of a row, decoded: per group of 32 values the codes (values 0-15 in w[g][0],
 * 16-31 in w[g][1]; Q8_0's signed bytes), the integer scales of the 16 halves (superblock types)
 * and d, or the groups' float scales D (block-32 types); offsets O per half of 16 values */
typedef struct {
    int8x16_t w[8][2];
    int32_t sc[16];
    float D[8];
    float O[16];
    float d;
} unit_buf;

INL void put_codes(unit_buf * h, int g, uint8x16_t lo, uint8x16_t hi) {
    h->w[g][0] = vreinterpretq_s8_u8(lo);
    h->w[g][1] = vreinterpretq_s8_u8(hi);
}

/* the unit at p of type t: avx2-int16's iscales / decode_group, value for value */
INL void decode_unit(int t, const uint8_t * b, int ng, unit_buf * h) {
    const uint8x16_t m3 = vdupq_n_u8(3), m4 = vdupq_n_u8(0x0F);
    switch (t) {
        case T_Q2_K: {
            h->d = h2f(b + 80);
            const float dm = -h2f(b + 82);
            for (int i = 0; i < 16; i++) {
                h->sc[i] = b[i] & 15;
                h->O[i] = dm * (float)(b[i] >> 4);
            }
            for (int g = 0; g < 8; g++) { /* value 128n + 32j + l: bits 2j of qs[32n + l] */
                const int n = g >> 2, j = g & 3;
                const int8x16_t sh = vdupq_n_s8((int8_t)(-2 * j));
                put_codes(h, g, vandq_u8(vshlq_u8(vld1q_u8(b + 16 + 32 * n), sh), m3),
                          vandq_u8(vshlq_u8(vld1q_u8(b + 32 + 32 * n), sh), m3));
            }
            break;
        }
        case T_Q3_K:
        case T_Q6_K: {
            int8_t v[16];
            if (t == T_Q3_K) {
                bs_q3k_scales(b + 96, v);
                for (int i = 0; i < 16; i++) v[i] = (int8_t)(v[i] - 32);
                h->d = h2f(b + 108);
            } else {
                memcpy(v, b + 192, 16);
                h->d = h2f(b + 208);
            }
            const float z = (t == T_Q3_K ? -4.0f : -32.0f) * h->d;
            for (int i = 0; i < 16; i++) {
                h->sc[i] = v[i];
                h->O[i] = z * (float)v[i];
            }
            if (t == T_Q3_K) { /* + 4 where the hmask bit (4n + j) is set */
                const uint8x16_t hm0 = vld1q_u8(b), hm1 = vld1q_u8(b + 16), four = vdupq_n_u8(4);
                for (int g = 0; g < 8; g++) {
                    const int n = g >> 2, j = g & 3;
                    const int8x16_t sh = vdupq_n_s8((int8_t)(-2 * j));
                    const uint8x16_t bit = vdupq_n_u8((uint8_t)(1u << (4 * n + j)));
                    const uint8x16_t q0 = vandq_u8(vshlq_u8(vld1q_u8(b + 32 + 32 * n), sh), m3);
                    const uint8x16_t q1 = vandq_u8(vshlq_u8(vld1q_u8(b + 48 + 32 * n), sh), m3);
                    put_codes(h, g, vaddq_u8(q0, vandq_u8(vtstq_u8(hm0, bit), four)),
                              vaddq_u8(q1, vandq_u8(vtstq_u8(hm1, bit), four)));
                }
            } else { /* value 128n + 32m + l: nibble of ql[64n + 32(m&1) + l], 2 bits of qh[32n + l] */
                for (int g = 0; g < 8; g++) {
                    const int n = g >> 2, m = g & 3;
                    uint8x16_t u[2];
                    for (int s = 0; s < 2; s++) {
                        const uint8x16_t l = vld1q_u8(b + 64 * n + 32 * (m & 1) + 16 * s);
                        const uint8x16_t qh = vld1q_u8(b + 128 + 32 * n + 16 * s);
                        const uint8x16_t lo = m >= 2 ? vshrq_n_u8(l, 4) : vandq_u8(l, m4);
                        const uint8x16_t hb = vshlq_n_u8(vandq_u8(vshlq_u8(qh, vdupq_n_s8((int8_t)(-2 * m))), m3), 4);
                        u[s] = vorrq_u8(lo, hb);
                    }
                    put_codes(h, g, u[0], u[1]);
                }
            }
            break;
        }
        case T_Q4_K:
        case T_Q5_K: { /* value 64z + l: low nibble of qs[32z + l]; 64z + 32 + l: high nibble */
            const bool q5 = t == T_Q5_K;
            const float dmin = h2f(b + 2);
            h->d = h2f(b);
            uint64_t s8, m8;
            bs_k4_scales_mins(b + 4, &s8, &m8);
            for (int j = 0; j < 8; j++) {
                const uint8_t s1 = (uint8_t)(s8 >> (8 * j)), m = (uint8_t)(m8 >> (8 * j));
                h->sc[2 * j] = h->sc[2 * j + 1] = s1;
                h->O[2 * j] = h->O[2 * j + 1] = -dmin * (float)m;
            }
            const uint8x16_t sixteen = vdupq_n_u8(16);
            for (int g = 0; g < 8; g++) {
                const int z = g >> 1, hi = g & 1;
                uint8x16_t u[2];
                for (int s = 0; s < 2; s++) {
                    const uint8x16_t q = vld1q_u8(b + (q5 ? 48 : 16) + 32 * z + 16 * s);
                    u[s] = hi ? vshrq_n_u8(q, 4) : vandq_u8(q, m4);
                    if (q5) {
                        const uint8x16_t bit = vdupq_n_u8((uint8_t)(1u << g));
                        u[s] = vaddq_u8(u[s], vandq_u8(vtstq_u8(vld1q_u8(b + 16 + 16 * s), bit), sixteen));
                    }
                }
                put_codes(h, g, u[0], u[1]);
            }
            break;
        }
        case T_Q8_0:
            for (int g = 0; g < ng; g++) {
                const uint8_t * blk = b + 34 * g;
                h->w[g][0] = vld1q_s8((const int8_t *)(blk + 2));
                h->w[g][1] = vld1q_s8((const int8_t *)(blk + 18));
                h->D[g] = h2f(blk);
            }
            break;
        case T_Q4_0:
        case T_Q4_1: { /* Q4_0: W = d (q - 8); Q4_1: W = d q + m; low nibbles are values 0..15 */
            const bool q41 = t == T_Q4_1;
            for (int g = 0; g < ng; g++) {
                const uint8_t * blk = b + (q41 ? 20 : 18) * g;
                const uint8x16_t q = vld1q_u8(blk + (q41 ? 4 : 2));
                put_codes(h, g, vandq_u8(q, m4), vshrq_n_u8(q, 4));
                const float d = h2f(blk);
                h->D[g] = d;
                h->O[2 * g] = h->O[2 * g + 1] = q41 ? h2f(blk + 2) : -8.0f * d;
            }
            break;
        }
        default:
            break;
    }
}

/* a vector of avx2-int16's 8 lanes: lanes 0-3 (values 0-15 of each group) and 4-7 (16-31) */
typedef struct {
    float32x4_t a, b;
} f8;

INL f8 f8_zero(void) {
    f8 r = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
    return r;
}

INL f8 f8_add(f8 x, f8 y) {
    f8 r = {vaddq_f32(x.a, y.a), vaddq_f32(x.b, y.b)};
    return r;
}

/* x * y + z, fused (as _mm256_fmadd_ps) */
INL f8 f8_fma(f8 x, f8 y, f8 z) {
    f8 r = {vfmaq_f32(z.a, x.a, y.a), vfmaq_f32(z.b, x.b, y.b)};
    return r;
}

INL f8 f8_scale(f8 x, float s) {
    f8 r = {vmulq_n_f32(x.a, s), vmulq_n_f32(x.b, s)};
    return r;
}

INL f8 f8_load(const float * p) {
    f8 r = {vld1q_f32(p), vld1q_f32(p + 4)};
    return r;
}

INL f8 f8_cvt(int32x4_t a, int32x4_t b) {
    f8 r = {vcvtq_f32_s32(a), vcvtq_f32_s32(b)};
    return r;
}

/* one half's value over the unit for one column (before the block scale): digits e (e1: the high
 * digit where two are taken, else NULL), the unit's groups as avx2-int16's apply_group and
 * sums_end compute them; hi: e is the high digit alone (x 255 at the end, offsets from xh16) */
INL f8 half_value(int t, int ng, const unit_buf * h, const int8_t * e, const int8_t * e1, bool hi, const float * xs16) {
    const int32x4_t z = vdupq_n_s32(0);
    f8 v;
    if (superblock(t)) {
        int32x4_t il0 = z, il1 = z, ih0 = z, ih1 = z;
        for (int g = 0; g < 8; g++) {
            const int8x16_t a0 = vld1q_s8(e + 32 * g), a1 = vld1q_s8(e + 32 * g + 16);
            il0 = vmlaq_n_s32(il0, vdotq_s32(z, h->w[g][0], a0), h->sc[2 * g]);
            il1 = vmlaq_n_s32(il1, vdotq_s32(z, h->w[g][1], a1), h->sc[2 * g + 1]);
            if (e1 != NULL) {
                const int8x16_t b0 = vld1q_s8(e1 + 32 * g), b1 = vld1q_s8(e1 + 32 * g + 16);
                ih0 = vmlaq_n_s32(ih0, vdotq_s32(z, h->w[g][0], b0), h->sc[2 * g]);
                ih1 = vmlaq_n_s32(ih1, vdotq_s32(z, h->w[g][1], b1), h->sc[2 * g + 1]);
            }
        }
        f8 T = f8_cvt(il0, il1);
        if (e1 != NULL) {
            const f8 k255 = {vdupq_n_f32(255.0f), vdupq_n_f32(255.0f)};
            T = f8_fma(f8_cvt(ih0, ih1), k255, T);
        }
        v = f8_scale(T, hi ? 255.0f * h->d : h->d);
    } else {
        f8 f[2] = {f8_zero(), f8_zero()};
        for (int g = 0; g < ng; g++) {
            const int8x16_t a0 = vld1q_s8(e + 32 * g), a1 = vld1q_s8(e + 32 * g + 16);
            int32x4_t p0 = vdotq_s32(z, h->w[g][0], a0), p1 = vdotq_s32(z, h->w[g][1], a1);
            if (e1 != NULL) { /* 255 p1 + p0, exact in int32 */
                p0 = vmlaq_n_s32(p0, vdotq_s32(z, h->w[g][0], vld1q_s8(e1 + 32 * g)), 255);
                p1 = vmlaq_n_s32(p1, vdotq_s32(z, h->w[g][1], vld1q_s8(e1 + 32 * g + 16)), 255);
            }
            const f8 D = {vdupq_n_f32(h->D[g]), vdupq_n_f32(h->D[g])};
            f[g & 1] = f8_fma(f8_cvt(p0, p1), D, f[g & 1]);
        }
        v = f8_add(f[0], f[1]);
        if (hi) v = f8_scale(v, 255.0f);
    }
    if (t == T_Q8_0) {
        return v; /* no offset */
    }
    if (ng == 8) {
        return f8_fma(f8_load(h->O + 8), f8_load(xs16 + 8), f8_fma(f8_load(h->O), f8_load(xs16), v));
    }
    /* one group (units of 32): two halves, in lanes 0 and 1 */
    const float o[4] = {h->O[0], h->O[1], 0.0f, 0.0f}, xx[4] = {xs16[0], xs16[1], 0.0f, 0.0f};
    v.a = vaddq_f32(v.a, vmulq_f32(vld1q_f32(o), vld1q_f32(xx)));
    v.b = vaddq_f32(v.b, vdupq_n_f32(0.0f)); /* as avx2-int16 adds its zero upper lanes */
    return v;
}

/* every (row, column) sees the same operations in the same order as in avx2-int16 */
TGT static void dot_rows(const bs_job * job, int64_t r0, int64_t r1, bs_scratch * scratch) {
    const int64_t K = job->K, nc = job->n_cols;
    const int bt = tcode(job->w2, job->w2_type), rt = tcode(job->r, job->r_type);
    if (nc < 1 || bt < 0 || rt < 0 || bt > T_Q4_1 || rt > T_Q4_1 || (bt == T_NONE && rt == T_NONE)) {
        return; /* dot_supports admitted the job: cannot happen */
    }
    const bool coarse = job->draft;
    const int qa = unit_of(bt, rt), ng = qa / 32;
    const size_t cb = int16_col_bytes(job);
    uint8_t * mem = bs_scratch_get(scratch, 2 * sizeof(unit_buf) + (size_t)nc * sizeof(f8) + 64);
    if (mem == NULL) {
        return; /* out of memory: bs_run_job reports it (scratch->failed) */
    }
    unit_buf * hb = (unit_buf *)mem, * hr = hb + 1;
    f8 * tot = (f8 *)(hr + 1);
    const size_t bub = bt != T_NONE ? (size_t)(qa / T_BLCK[bt]) * (size_t)T_SIZE[bt] : 0;
    const size_t rub = rt != T_NONE ? (size_t)(qa / T_BLCK[rt]) * (size_t)T_SIZE[rt] : 0;
    for (int64_t r = r0; r < r1; r++) {
        for (int64_t c = 0; c < nc; c++) tot[c] = f8_zero();
        for (int64_t k0 = 0; k0 < K; k0 += qa) {
            const int64_t t = k0 / qa;
            if (bt != T_NONE) decode_unit(bt, job->w2 + (size_t)r * job->w2_row_bytes + (size_t)t * bub, ng, hb);
            if (rt != T_NONE) decode_unit(rt, job->r + (size_t)r * job->r_row_bytes + (size_t)t * rub, ng, hr);
            for (int64_t c = 0; c < nc; c++) {
                const uint8_t * col = (const uint8_t *)job->acts + (size_t)c * cb;
                const int8_t * d0 = (const int8_t *)col + k0, * d1 = (const int8_t *)col + K + k0;
                const float * xs16 = (const float *)(col + 2 * K) + k0 / 16, * xh16 = xs16 + K / 16;
                const float * sv = (const float *)(col + 2 * K) + 2 * (K / 16);
                /* the high digit alone: R alone (add mode), or both halves with act8 (avx2-int16's r_alone_hi) */
                const bool hi = (bt == T_NONE || job->act8) && rt != T_NONE && !coarse &&
                                ((const uint8_t *)(sv + K / qa))[t] != 0;
                f8 v = f8_zero();
                if (bt != T_NONE) {
                    v = hi ? half_value(bt, ng, hb, d1, NULL, true, xh16) : half_value(bt, ng, hb, d0, coarse ? NULL : d1, false, xs16);
                }
                if (rt != T_NONE) {
                    v = f8_add(v, hi ? half_value(rt, ng, hr, d1, NULL, true, xh16)
                                     : half_value(rt, ng, hr, d0, coarse ? NULL : d1, false, xs16));
                }
                const f8 s = {vdupq_n_f32(sv[t]), vdupq_n_f32(sv[t])};
                tot[c] = f8_fma(s, v, tot[c]);
            }
        }
        for (int64_t c = 0; c < nc; c++) { /* avx2-int16's hsum8: (s0 + s2) + (s1 + s3), s = lanes 0-3 + 4-7 */
            const float32x4_t s = vaddq_f32(tot[c].a, tot[c].b);
            const float v = (vgetq_lane_f32(s, 0) + vgetq_lane_f32(s, 2)) + (vgetq_lane_f32(s, 1) + vgetq_lane_f32(s, 3));
            float * y = job->y + c * job->ldy + r;
            *y = job->accumulate ? *y + v : v;
        }
    }
}

const bs_kernel_family bs_family_neon_int16 = {
    "neon-int16", BS_ISA_NEON, dot_cpu, dot_supports, dot_acts_size, dot_prepare_acts, dot_rows,
    /* not used for drafting: ggml's own AArch64 K-quant products use the dot product too, and
     * no measurement on ARM hardware says this family beats them */
    0,
    /* preferred up to 6 columns for W2 + R and 32 for R alone, avx2-int16's measured crossovers
     * with the f32 family (2-core Zen 3): NOT measured on ARM hardware (none lent so far); the
     * arithmetic is avx2-int16's, 4 SDOT + 4 MLA per 32 weights and column against neon-f32's 8
     * FMAs on weights it first widens to f32 */
    6,
    .alone_max_cols = 32,
    .exact_weights = true,
};

#endif /* __aarch64__ */
