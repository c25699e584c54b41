/*
 * The ARM family ("neon-f32"): AArch64 Advanced SIMD (every ARMv8-A CPU: Apple silicon, Graviton,
 * Ampere, Snapdragon, Raspberry Pi 4/5).
 *
 * The same contract and structure as x86's avx2-f32: both halves decoded to f32 and added,
 * W = f32(W2) + f32(R), times f32 activations, accumulated in f32 per (row, column) in a fixed
 * order (batch-invariant); 4 rows decoded together a chunk at a time into a buffer that stays in
 * cache, then applied to every column, two at a time, from registers. Types: Q2_K, Q3_K, Q4_K, Q5_K,
 * Q6_K, Q8_0, Q4_0, Q4_1.
 *
 * Run without ARM hardware by native/tests/neon_qemu.sh (tests/test_neon_qemu.py): the parity
 * harness native/tests/kernel_parity.c, built static for AArch64, under qemu-aarch64-static, against
 * float64 products of ggml's dequantised weights (every base type alone and with a Q6_K or Q8_0
 * residual, each residual alone), batches 1..16. The decoders and the summation are the same
 * operations in the same order as avx2-f32's, so the two families give bit-identical results today
 * (the script reports it; only the tolerance is checked).
 */
#if defined(__aarch64__)

#define _GNU_SOURCE
#include <arm_neon.h>
#include <stdlib.h>
#include <string.h>

#include "bitsplit.h"
#include "bs_internal.h"
#include "cpu_feats.h"

#define KC 2048
#define RB 4

static bool neon_cpu(void) { return bs_cpu_has(BS_CPU_NEON); /* every AArch64 CPU (cpu_feats.c) */ }

static bool neon_supports(const bs_job * job) { return bs_f32_family_supports(job); }

static size_t neon_acts_size(const bs_job * job) {
    (void)job;
    return 0;
}

static void neon_prepare_acts(const bs_job * job, int64_t c0, int64_t c1) {
    (void)job;
    (void)c0;
    (void)c1;
}

static inline float h2f(const uint8_t * p) {
    __fp16 h;
    memcpy(&h, p, 2);
    return (float)h;
}

/* out[0..15] (+)= D * u + O for 16 unsigned byte codes */
static inline void put16(float * out, uint8x16_t u, float D, float O, bool add) {
    const uint16x8_t lo = vmovl_u8(vget_low_u8(u)), hi = vmovl_u8(vget_high_u8(u));
    const uint32x4_t q[4] = {vmovl_u16(vget_low_u16(lo)), vmovl_u16(vget_high_u16(lo)), vmovl_u16(vget_low_u16(hi)),
                             vmovl_u16(vget_high_u16(hi))};
    const float32x4_t vD = vdupq_n_f32(D), vO = vdupq_n_f32(O);
    for (int i = 0; i < 4; i++) {
        const float32x4_t v = vfmaq_f32(vO, vD, vcvtq_f32_u32(q[i]));
        vst1q_f32(out + 4 * i, add ? vaddq_f32(vld1q_f32(out + 4 * i), v) : v);
    }
}

static void deq_q2_K(const uint8_t * b, float * out, bool add) {
    const uint8_t * sc = b;
    const uint8_t * qs = b + 16;
    const float d = h2f(b + 80), dmin = h2f(b + 82);
    const uint8x16_t m3 = vdupq_n_u8(3);
    for (int n = 0; n < 2; n++) {
        const uint8x16_t q0 = vld1q_u8(qs + 32 * n), q1 = vld1q_u8(qs + 32 * n + 16);
        for (int j = 0; j < 4; j++) {
            const int s = 8 * n + 2 * j;
            const int8x16_t sh = vdupq_n_s8((int8_t)(-2 * j));
            put16(out + 128 * n + 32 * j, vandq_u8(vshlq_u8(q0, sh), m3), d * (float)(sc[s] & 15),
                  -dmin * (float)(sc[s] >> 4), add);
            put16(out + 128 * n + 32 * j + 16, vandq_u8(vshlq_u8(q1, sh), m3), d * (float)(sc[s + 1] & 15),
                  -dmin * (float)(sc[s + 1] >> 4), add);
        }
    }
}

static void deq_q3_K(const uint8_t * b, float * out, bool add) {
    int8_t sc[16];
    bs_q3k_scales(b + 96, sc);
    const float d = h2f(b + 108);
    const uint8x16_t hm[2] = {vld1q_u8(b), vld1q_u8(b + 16)};
    const uint8_t * qs = b + 32;
    const uint8x16_t m3 = vdupq_n_u8(3), four = vdupq_n_u8(4);
    for (int n = 0; n < 2; n++) {
        for (int j = 0; j < 4; j++) {
            const int8x16_t sh = vdupq_n_s8((int8_t)(-2 * j));
            const uint8x16_t bit = vdupq_n_u8((uint8_t)(1u << (4 * n + j)));
            for (int h = 0; h < 2; h++) {
                const int s = 8 * n + 2 * j + h;
                const uint8x16_t q = vandq_u8(vshlq_u8(vld1q_u8(qs + 32 * n + 16 * h), sh), m3);
                const uint8x16_t u = vaddq_u8(q, vandq_u8(vtstq_u8(hm[h], bit), four));
                const float D = d * (float)(sc[s] - 32);
                put16(out + 128 * n + 32 * j + 16 * h, u, D, -4.0f * D, add);
            }
        }
    }
}

static void deq_q45_K(const uint8_t * b, float * out, bool q5, bool add) {
    const float d = h2f(b), dmin = h2f(b + 2);
    const uint8_t * scales = b + 4;
    const uint8_t * qs = b + (q5 ? 48 : 16);
    const uint8x16_t m4 = vdupq_n_u8(0x0F), sixteen = vdupq_n_u8(16);
    const uint8x16_t qh[2] = {q5 ? vld1q_u8(b + 16) : vdupq_n_u8(0), q5 ? vld1q_u8(b + 32) : vdupq_n_u8(0)};
    for (int z = 0; z < 4; z++) {
        uint8_t s0, m0, s1, m1;
        bs_k4_scale_min(2 * z, scales, &s0, &m0);
        bs_k4_scale_min(2 * z + 1, scales, &s1, &m1);
        const uint8x16_t b0 = vdupq_n_u8((uint8_t)(1u << (2 * z))), b1 = vdupq_n_u8((uint8_t)(2u << (2 * z)));
        for (int h = 0; h < 2; h++) {
            const uint8x16_t q = vld1q_u8(qs + 32 * z + 16 * h);
            uint8x16_t lo = vandq_u8(q, m4), hi = vshrq_n_u8(q, 4);
            if (q5) {
                lo = vaddq_u8(lo, vandq_u8(vtstq_u8(qh[h], b0), sixteen));
                hi = vaddq_u8(hi, vandq_u8(vtstq_u8(qh[h], b1), sixteen));
            }
            put16(out + 64 * z + 16 * h, lo, d * (float)s0, -dmin * (float)m0, add);
            put16(out + 64 * z + 32 + 16 * h, hi, d * (float)s1, -dmin * (float)m1, add);
        }
    }
}

static void deq_q6_K(const uint8_t * b, float * out, bool add) {
    const int8_t * sc = (const int8_t *)(b + 192);
    const float d = h2f(b + 208);
    const uint8x16_t m4 = vdupq_n_u8(0x0F), m3 = vdupq_n_u8(3);
    for (int n = 0; n < 2; n++) {
        for (int h = 0; h < 2; h++) {
            const uint8x16_t l0 = vld1q_u8(b + 64 * n + 16 * h), l1 = vld1q_u8(b + 64 * n + 32 + 16 * h);
            const uint8x16_t qh = vld1q_u8(b + 128 + 32 * n + 16 * h);
            const uint8x16_t u[4] = {
                vorrq_u8(vandq_u8(l0, m4), vshlq_n_u8(vandq_u8(qh, m3), 4)),
                vorrq_u8(vandq_u8(l1, m4), vshlq_n_u8(vandq_u8(vshrq_n_u8(qh, 2), m3), 4)),
                vorrq_u8(vshrq_n_u8(l0, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(qh, 4), m3), 4)),
                vorrq_u8(vshrq_n_u8(l1, 4), vshlq_n_u8(vshrq_n_u8(qh, 6), 4)),
            };
            for (int m = 0; m < 4; m++) {
                const int s = 8 * n + 2 * m + h;
                const float D = d * (float)sc[s];
                put16(out + 128 * n + 32 * m + 16 * h, u[m], D, -32.0f * D, add);
            }
        }
    }
}

static void deq_q8_0(const uint8_t * b, float * out, bool add) {
    const float d = h2f(b);
    const uint8x16_t flip = vdupq_n_u8(0x80);
    for (int h = 0; h < 2; h++) {
        put16(out + 16 * h, veorq_u8(vld1q_u8(b + 2 + 16 * h), flip), d, -128.0f * d, add);
    }
}

static void deq_q4_01(const uint8_t * b, float * out, bool q41, bool add) {
    const float d = h2f(b), O = q41 ? h2f(b + 2) : -8.0f * d;
    const uint8x16_t q = vld1q_u8(b + (q41 ? 4 : 2));
    put16(out, vandq_u8(q, vdupq_n_u8(0x0F)), d, O, add);
    put16(out + 16, vshrq_n_u8(q, 4), d, O, add);
}

static void deq_range(enum ggml_type type, const uint8_t * row, int64_t k0, int64_t n, float * out, bool add) {
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
            break;
    }
}

/* acc[r][c] (two float32x4 each: 8 lanes, as avx2-f32) += W[r] . x[c] over n values */
#define MICRO(NR, NC)                                                                                      \
    static inline void micro_##NR##_##NC(const float * w, const float * const * xc, int64_t n,             \
                                         float32x4_t * acc, int64_t acc_stride) {                          \
        float32x4_t a[NR][NC][2];                                                                          \
        for (int r = 0; r < NR; r++)                                                                       \
            for (int c = 0; c < NC; c++)                                                                   \
                for (int h = 0; h < 2; h++) a[r][c][h] = acc[2 * (r * acc_stride + c) + h];                \
        for (int64_t k = 0; k < n; k += 8) {                                                               \
            float32x4_t wv[NR][2];                                                                         \
            for (int r = 0; r < NR; r++) {                                                                 \
                wv[r][0] = vld1q_f32(w + r * KC + k);                                                      \
                wv[r][1] = vld1q_f32(w + r * KC + k + 4);                                                  \
            }                                                                                              \
            for (int c = 0; c < NC; c++) {                                                                 \
                const float32x4_t x0 = vld1q_f32(xc[c] + k), x1 = vld1q_f32(xc[c] + k + 4);                \
                for (int r = 0; r < NR; r++) {                                                             \
                    a[r][c][0] = vfmaq_f32(a[r][c][0], wv[r][0], x0);                                      \
                    a[r][c][1] = vfmaq_f32(a[r][c][1], wv[r][1], x1);                                      \
                }                                                                                          \
            }                                                                                              \
        }                                                                                                  \
        for (int r = 0; r < NR; r++)                                                                       \
            for (int c = 0; c < NC; c++)                                                                   \
                for (int h = 0; h < 2; h++) acc[2 * (r * acc_stride + c) + h] = a[r][c][h];                \
    }
MICRO(4, 2)
MICRO(4, 1)
MICRO(1, 2)
MICRO(1, 1)

static void neon_rows(const bs_job * job, int64_t r0, int64_t r1, bs_scratch * scratch) {
    const int64_t K = job->K, nc = job->n_cols;
    const size_t wbytes = (size_t)RB * KC * sizeof(float);
    uint8_t * mem = bs_scratch_get(scratch, wbytes + (size_t)RB * (size_t)(nc > 0 ? nc : 1) * 2 * sizeof(float32x4_t) + 64);
    if (mem == NULL) {
        return;
    }
    float * w = (float *)mem;
    float32x4_t * acc = (float32x4_t *)(mem + wbytes);
    const float * xc[2];
    for (int64_t r = r0; r < r1; r += RB) {
        const int nr = r1 - r >= RB ? RB : (int)(r1 - r);
        for (int64_t i = 0; i < 2 * (int64_t)nr * nc; i++) {
            acc[i] = vdupq_n_f32(0.0f);
        }
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t n = K - k0 < KC ? K - k0 : KC;
            for (int i = 0; i < nr; i++) {
                float * wr = w + i * KC;
                bool have = false;
                if (job->w2 != NULL) {
                    deq_range(job->w2_type, job->w2 + (size_t)(r + i) * job->w2_row_bytes, k0, n, wr, false);
                    have = true;
                }
                if (job->r != NULL) {
                    deq_range(job->r_type, job->r + (size_t)(r + i) * job->r_row_bytes, k0, n, wr, have);
                }
            }
            int64_t c = 0;
            for (; c + 2 <= nc; c += 2) {
                xc[0] = job->x + c * job->ldx + k0;
                xc[1] = job->x + (c + 1) * job->ldx + k0;
                if (nr == RB) {
                    micro_4_2(w, xc, n, acc + 2 * c, nc);
                } else {
                    for (int i = 0; i < nr; i++) micro_1_2(w + i * KC, xc, n, acc + 2 * (i * nc + c), nc);
                }
            }
            if (c < nc) {
                xc[0] = job->x + c * job->ldx + k0;
                if (nr == RB) {
                    micro_4_1(w, xc, n, acc + 2 * c, nc);
                } else {
                    for (int i = 0; i < nr; i++) micro_1_1(w + i * KC, xc, n, acc + 2 * (i * nc + c), nc);
                }
            }
        }
        for (int i = 0; i < nr; i++) {
            for (int64_t cc = 0; cc < nc; cc++) {
                const float32x4_t s = vaddq_f32(acc[2 * (i * nc + cc)], acc[2 * (i * nc + cc) + 1]);
                float * y = job->y + cc * job->ldy + r + i;
                const float v = (vgetq_lane_f32(s, 0) + vgetq_lane_f32(s, 2)) + (vgetq_lane_f32(s, 1) + vgetq_lane_f32(s, 3));
                *y = job->accumulate ? *y + v : v;
            }
        }
    }
}

const bs_kernel_family bs_family_neon_f32 = {
    "neon-f32", BS_ISA_NEON, neon_cpu, neon_supports, neon_acts_size, neon_prepare_acts, neon_rows, 0,
    .exact_weights = true,
};

#endif /* __aarch64__ */
