/*
 * A device's activation rounding, emulated on the host (bitsplit eval --device-numerics). With the base
 * on a device, the verifier is W2 . x as that device computes it plus R . x from the host: the device's
 * quantized kernels round x first (8 bits per block of 32, 64 or 256 values, or to half precision),
 * and that rounding, not the base or the residual, decides the verifier's fidelity. Here each rule is
 * written from the vendored llama.cpp source (the llama-cpp-python sdist this library is pinned to),
 * so that the host can compute W2 . x-rounded with an exact product and score the verifier a device
 * would give without the device:
 *
 *   cpu   ggml-cpu's vec_dot types: K-quant and IQ weights take Q8_K (ggml-quants.c,
 *         quantize_row_q8_K_ref: per 256 values iscale = -127 / (the value of largest magnitude),
 *         q = nearest (ties to even) of iscale x, at most 127, d = 1 / iscale); block-32 weights take
 *         Q8_0 / Q8_1 (arch/x86/quants.c, AVX2: per 32 values q = round-to-nearest-even of
 *         x * 127 / amax, d = amax / 127 stored as half); F16 / BF16 weights take x in that type.
 *   cuda  ggml-cuda: up to 8 rows (MMVQ_MAX_BATCH_SIZE) quantize_q8_1 for every quantized type
 *         (per 32 values d = amax / 127, q = roundf(x / d), d stored as half); above, mmq's
 *         quantize_mmq_q8_1 (q = roundf(x * (127 / amax)), d = 1 / that) in the weight type's layout
 *         (mmq_get_q8_1_ds_layout): D4 one float d per 32 values, DS4 a half d per 32, D2S6 (Q2_K)
 *         a half d per 64. Types mmq lacks (IQ1_M) and float weights: half activations (cuBLAS) above
 *         8 rows, floats at 1-8 (mul_mat_vec). Not emulated: D2S6's sums of the unrounded values
 *         (taken for the minimum term of Q2_K's first 96 values of each 128 in mmq), the half
 *         rounding of the partial sums; summation order everywhere.
 *   cuda-mmvq  quantize_q8_1 at every batch size: what a 1-8 row verify pass sees.
 *   metal ggml-metal: up to 8 rows (mul_mv) float activations; above (mul_mm) src1 stored as half
 *         (bfloat for BF16 weights) in threadgroup memory. Not emulated: mul_mm's half dequantized
 *         weights.
 *   float a device that keeps the activations as they are: what is left is the host's own add-mode
 *         R . x (its 8-bit activations where a block allows), the verifier's floor on any device.
 *
 * Outlier channels (bitsplit_ctx_set_numerics's `outliers`): a correction measured here before it is
 * built. Each row's m channels of largest magnitude are zeroed in what the device rounds (so they no
 * longer set their blocks' scales) and taken exactly, as the host would compute W2[:, S] . x[S] from
 * the base's blocks that hold them; hook.c counts those blocks' bytes (bytes_outlier_base). Or a fixed
 * set per weight (bitsplit_ctx_set_exact_channels: from an importance matrix), the same for every
 * row, which the host would keep as a dense slab of those columns (N x m halves, counted so); or,
 * with outliers > 0 too, each row's `outliers` largest among that set (the slab's bytes as well).
 *
 * fp16 / bf16 rounding is written here (round to nearest, ties to even, as CUDA's __float2half and
 * ggml's conversions), so nothing beyond the C library is called.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bitsplit.h"
#include "bs_internal.h"

/* f rounded to the nearest binary16 value (ties to even), as a float; beyond half's range +-inf */
static float to_half(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof(b));
    const uint32_t sign = b & 0x80000000u;
    uint32_t a = b ^ sign;
    if (a >= 0x7f800000u) {
        return f; /* inf, nan */
    }
    float af;
    memcpy(&af, &a, sizeof(af));
    if (af >= 65520.0f) { /* rounds past half's largest finite value, 65504 */
        a = 0x7f800000u;
    } else if (af < 6.103515625e-05f) { /* half's subnormals: multiples of 2^-24 (scalings exact) */
        af = rintf(af * 16777216.0f) * (1.0f / 16777216.0f);
        memcpy(&a, &af, sizeof(a));
    } else { /* keep 10 of the 23 mantissa bits, ties to even (a carry moves the exponent up) */
        a = (a + 0x0fffu + ((a >> 13) & 1u)) & ~0x1fffu;
    }
    a |= sign;
    memcpy(&f, &a, sizeof(f));
    return f;
}

/* f rounded to the nearest bfloat16 value (ties to even), as a float */
static float to_bf16(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof(b));
    if ((b & 0x7fffffffu) >= 0x7f800000u) {
        return f;
    }
    b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &b, sizeof(f));
    return f;
}

/* the rules, per block of values */
enum rule {
    R_NONE = 0,   /* floats as they are */
    R_Q8K,        /* ggml-cpu Q8_K, 256 */
    R_Q8_0,       /* ggml-cpu Q8_0 / Q8_1 (AVX2), 32 */
    R_HALF,       /* every value to half */
    R_BF16,       /* every value to bfloat16 */
    R_MMVQ,       /* ggml-cuda quantize_q8_1, 32 */
    R_MMQ_D4,     /* ggml-cuda quantize_mmq_q8_1, float d per 32 */
    R_MMQ_DS4,    /* half d per 32 */
    R_MMQ_D2S6,   /* half d per 64 */
    R_UNKNOWN = -1,
};

static bool k_or_iq(enum ggml_type t) {
    switch (t) {
        case GGML_TYPE_Q2_K: case GGML_TYPE_Q3_K: case GGML_TYPE_Q4_K: case GGML_TYPE_Q5_K: case GGML_TYPE_Q6_K:
        case GGML_TYPE_IQ2_XXS: case GGML_TYPE_IQ2_XS: case GGML_TYPE_IQ2_S: case GGML_TYPE_IQ3_XXS:
        case GGML_TYPE_IQ3_S: case GGML_TYPE_IQ1_S: case GGML_TYPE_IQ1_M: case GGML_TYPE_IQ4_XS:
            return true;
        default:
            return false;
    }
}

static bool block32(enum ggml_type t) {
    switch (t) {
        case GGML_TYPE_Q4_0: case GGML_TYPE_Q4_1: case GGML_TYPE_Q5_0: case GGML_TYPE_Q5_1: case GGML_TYPE_Q8_0:
        case GGML_TYPE_IQ4_NL: case GGML_TYPE_MXFP4:
            return true;
        default:
            return false;
    }
}

/* mmq's layout for a quantized type (mmq_get_q8_1_ds_layout); R_UNKNOWN: mmq does not take it */
static enum rule mmq_rule(enum ggml_type t) {
    switch (t) {
        case GGML_TYPE_Q2_K:
            return R_MMQ_D2S6;
        case GGML_TYPE_Q4_0: case GGML_TYPE_Q4_1: case GGML_TYPE_Q5_1: case GGML_TYPE_Q4_K: case GGML_TYPE_Q5_K:
        case GGML_TYPE_IQ1_S:
            return R_MMQ_DS4;
        case GGML_TYPE_Q5_0: case GGML_TYPE_Q8_0: case GGML_TYPE_Q3_K: case GGML_TYPE_Q6_K: case GGML_TYPE_IQ2_XXS:
        case GGML_TYPE_IQ2_XS: case GGML_TYPE_IQ2_S: case GGML_TYPE_IQ3_XXS: case GGML_TYPE_IQ3_S:
        case GGML_TYPE_IQ4_XS: case GGML_TYPE_IQ4_NL: case GGML_TYPE_MXFP4:
            return R_MMQ_D4;
        default:
            return R_UNKNOWN;
    }
}

static bool float_type(enum ggml_type t) {
    return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16;
}

/* the rule of `numerics` for weights of type t in a pass of n_rows rows */
static enum rule rule_for(int numerics, enum ggml_type t, int64_t n_rows) {
    switch (numerics) {
        case BITSPLIT_NUMERICS_HOST:
            return R_NONE;
        case BITSPLIT_NUMERICS_CPU:
            if (k_or_iq(t)) return R_Q8K;
            if (block32(t)) return R_Q8_0;
            if (t == GGML_TYPE_F16) return R_HALF;
            if (t == GGML_TYPE_BF16) return R_BF16;
            if (t == GGML_TYPE_F32) return R_NONE;
            return R_UNKNOWN;
        case BITSPLIT_NUMERICS_CUDA:
        case BITSPLIT_NUMERICS_CUDA_MMVQ:
            if (float_type(t)) {
                if (numerics == BITSPLIT_NUMERICS_CUDA_MMVQ || n_rows <= 8 || t == GGML_TYPE_F32) return R_NONE;
                return R_HALF;
            }
            if (!k_or_iq(t) && !block32(t)) return R_UNKNOWN;
            if (numerics == BITSPLIT_NUMERICS_CUDA_MMVQ || n_rows <= 8) return R_MMVQ;
            return mmq_rule(t) == R_UNKNOWN ? R_HALF : mmq_rule(t);
        case BITSPLIT_NUMERICS_METAL:
            if (!k_or_iq(t) && !block32(t) && !float_type(t)) return R_UNKNOWN;
            if (n_rows <= 8) return R_NONE;
            return t == GGML_TYPE_BF16 ? R_BF16 : R_HALF;
        case BITSPLIT_NUMERICS_FLOAT:
            return R_NONE;
        default:
            return R_UNKNOWN;
    }
}

static int64_t rule_block(enum rule r) {
    switch (r) {
        case R_Q8K: return 256;
        case R_MMQ_D2S6: return 64;
        case R_Q8_0: case R_MMVQ: case R_MMQ_D4: case R_MMQ_DS4: return 32;
        default: return 1;
    }
}

/* one block of n values by rule r (a quantizing rule) into out */
static void round_block(enum rule r, const float * x, int64_t n, float * out) {
    float amax = 0.0f, max = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float a = fabsf(x[i]);
        if (a > amax) {
            amax = a;
            max = x[i];
        }
    }
    if (amax == 0.0f || !isfinite(amax)) { /* zeros (every rule's q = 0); non-finite: left as they are */
        for (int64_t i = 0; i < n; i++) out[i] = amax == 0.0f ? 0.0f : x[i];
        return;
    }
    switch (r) {
        case R_Q8K: {
            const float iscale = -127.0f / max, d = 1.0f / iscale;
            for (int64_t i = 0; i < n; i++) {
                float q = rintf(iscale * x[i]);
                if (q > 127.0f) q = 127.0f;
                out[i] = q * d;
            }
            return;
        }
        case R_Q8_0: {
            const float id = 127.0f / amax, d = to_half(amax / 127.0f);
            for (int64_t i = 0; i < n; i++) out[i] = rintf(x[i] * id) * d;
            return;
        }
        case R_MMVQ: {
            const float d = amax / 127.0f, dh = to_half(d);
            for (int64_t i = 0; i < n; i++) out[i] = roundf(x[i] / d) * dh;
            return;
        }
        default: { /* mmq: q = roundf(x * d_inv), d = 1 / d_inv, as float (D4) or half */
            const float d_inv = 127.0f / amax, d = 1.0f / d_inv, ds = r == R_MMQ_D4 ? d : to_half(d);
            for (int64_t i = 0; i < n; i++) out[i] = roundf(x[i] * d_inv) * ds;
            return;
        }
    }
}

int bs_numerics_rule(int numerics, enum ggml_type t, int64_t n_rows, int64_t K) {
    const enum rule r = rule_for(numerics, t, n_rows);
    if (r == R_UNKNOWN || K % rule_block(r) != 0) {
        return -1;
    }
    return (int)r;
}

/* the m (<= K) channels of x of largest magnitude, into idx (in no particular order) */
static void top_channels(const float * x, int64_t K, int m, int32_t * idx) {
    float val[BITSPLIT_MAX_OUTLIERS];
    int lo = 0; /* the smallest kept */
    for (int64_t k = 0; k < K; k++) {
        const float a = fabsf(x[k]);
        if (k < m) {
            val[k] = a;
            idx[k] = (int32_t)k;
            if (a < val[lo]) lo = (int)k;
            continue;
        }
        if (!(a > val[lo])) {
            continue;
        }
        val[lo] = a;
        idx[lo] = (int32_t)k;
        for (int j = 0; j < m; j++) {
            if (val[j] < val[lo]) lo = j;
        }
    }
}

static void round_rule(enum rule r, const float * x, int64_t K, float * out);

/* the m channels sel (each in [0, K)) exact, the rest rounded without them */
static void round_fixed(int rule, const float * x, int64_t K, float * out, int m, const int32_t * sel);

void bs_numerics_round_pool(int rule, const float * x, int64_t K, float * out, int m, const int32_t * pool, int npool,
                            int32_t * sel) {
    if (m >= npool) {
        round_fixed(rule, x, K, out, npool, pool);
        return;
    }
    float g[BITSPLIT_MAX_OUTLIERS];
    int32_t at[BITSPLIT_MAX_OUTLIERS];
    for (int j = 0; j < npool; j++) g[j] = x[pool[j]];
    top_channels(g, npool, m, at); /* the row's m largest among the pool */
    for (int j = 0; j < m; j++) sel[j] = pool[at[j]];
    round_fixed(rule, x, K, out, m, sel);
}

void bs_numerics_round(int rule, const float * x, int64_t K, float * out, int outliers, int32_t * sel) {
    if (outliers <= 0) {
        round_rule((enum rule)rule, x, K, out);
        return;
    }
    const int m = outliers < K ? outliers : (int)K;
    top_channels(x, K, m, sel);
    round_fixed(rule, x, K, out, m, sel);
}

static void round_fixed(int rule, const float * x, int64_t K, float * out, int m, const int32_t * sel) {
    float keep[BITSPLIT_MAX_OUTLIERS];
    for (int j = 0; j < m; j++) keep[j] = x[sel[j]];
    if (out != x) memcpy(out, x, (size_t)K * sizeof(float));
    for (int j = 0; j < m; j++) out[sel[j]] = 0.0f; /* the device sees x without them */
    round_rule((enum rule)rule, out, K, out);
    for (int j = 0; j < m; j++) out[sel[j]] = keep[j]; /* the host takes them exactly */
}

static void round_rule(enum rule r, const float * x, int64_t K, float * out) {
    switch (r) {
        case R_NONE:
            if (out != x) memcpy(out, x, (size_t)K * sizeof(float));
            return;
        case R_HALF:
            for (int64_t i = 0; i < K; i++) out[i] = to_half(x[i]);
            return;
        case R_BF16:
            for (int64_t i = 0; i < K; i++) out[i] = to_bf16(x[i]);
            return;
        default: {
            const int64_t b = rule_block(r);
            for (int64_t k = 0; k < K; k += b) round_block(r, x + k, b, out + k);
            return;
        }
    }
}

void bs_numerics_error(int rule, const float * x, int64_t K, float * out) {
    round_rule((enum rule)rule, x, K, out);
    for (int64_t k = 0; k < K; k++) {
        out[k] = x[k] - out[k];
    }
}
