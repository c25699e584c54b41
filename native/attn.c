/*
 * Attention for batch-invariant verification: the products of the KV cache and the softmax.
 *
 * Without flash attention llama.cpp computes attention as KQ = K . q (one output per cached cell,
 * query row and head), softmax(KQ * scale + mask) per query row, and KQV = V^T . softmax (one
 * output per value dimension). ggml's CPU computes the products with llamafile's tiled GEMM from 2
 * query rows but with its own dot product for 1, two different float sums (a 1-row pass differed
 * from every larger one), and it sums a product and a softmax over the cached cells in SIMD lanes
 * by cell index: a masked cell (a tree sibling, a parked row, a hole) moves every later term to
 * another lane, so a row's result depended on where its visible cells sit in the cache. Here:
 *
 * - a product's every output is the sequential sum over k, in order, of f32(a[k]) * b[k], one
 *   fused multiply-add per term (the SIMD kernels vectorise over outputs, never over k): it depends
 *   on nothing but its two vectors, and a zero term (a masked cell's weight) leaves it unchanged,
 *   so it is skipped;
 * - the softmax's sum is exact: each exponential, computed element by element by one function,
 *   is rounded to a fixed point of 2^-40 and summed as a 64-bit integer, in any order.
 *
 * A row's attention then depends only on the cells it sees and their order in the cache (kept in
 * position order by the engine), not on its batch, the threads, or masked cells between them.
 * Activations stay f32 (ggml rounds them to f16 before its products); cached values are f16 or
 * f32.
 *
 * Product layout (ggml_mul_mat): a is [K, M, A2, A3] (rows of K values, nb[0] = element size), b
 * is [K, n, B2, B3] f32 with B2 % A2 == 0 and B3 % A3 == 0 (heads sharing a KV head), y is [M, n,
 * B2, B3] f32, contiguous. y[i0, i1, i2, i3] = sum_k a[k, i0, i2 / (B2 / A2), i3 / (B3 / A3)] *
 * b[k, i1, i2, i3].
 */
#define _GNU_SOURCE
#include <math.h>
#include <string.h>

#include "bs_internal.h"
#include "ggml.h"

#define ATTN_COLS 16 /* query columns per work item */

/* ---------------------------------------------------------------------------------------------
 * portable kernels
 * ------------------------------------------------------------------------------------------- */

void bs_attn_product_generic(const bs_attn_args * g, int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; c++) {
        const float * b = (const float *)(g->b + c * g->b_col);
        float * y = (float *)(g->y + c * g->y_col);
        for (int64_t i0 = 0; i0 < g->M; i0++) {
            y[i0] = 0.0f;
        }
        for (int64_t k = 0; k < g->K; k++) {
            const float w = b[k];
            if (w == 0.0f) {
                continue;
            }
            const float * t = g->t + k * g->t_row;
            for (int64_t i0 = 0; i0 < g->M; i0++) {
                y[i0] = fmaf(t[i0], w, y[i0]);
            }
        }
    }
}

/* exp(x) for x <= 0 (Cephes' reduction and polynomial): 0 below -87 */
static float exp_generic(float x) {
    if (!(x >= -87.0f)) {
        return 0.0f;
    }
    const float n = nearbyintf(x * 1.44269504088896341f);
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    const float y = fmaf(p, r * r, r) + 1.0f;
    int32_t bits;
    memcpy(&bits, &y, 4);
    bits += (int32_t)n * (1 << 23);
    float out;
    memcpy(&out, &bits, 4);
    return out;
}

void bs_attn_exp_row_generic(const float * x, float * y, int64_t n, float max) {
    for (int64_t i = 0; i < n; i++) {
        y[i] = exp_generic(x[i] - max);
    }
}

/* a's slice transposed to f32, t[k * t_row + i0], rows padded with zeros to a multiple of 8 */
static void transpose_generic(const char * a, size_t a_row, bool f16, int64_t K, int64_t M, float * t, int64_t t_row) {
    for (int64_t i0 = 0; i0 < t_row; i0++) {
        const char * row = i0 < M ? a + i0 * a_row : NULL;
        for (int64_t k = 0; k < K; k++) {
            t[k * t_row + i0] = row == NULL ? 0.0f : f16 ? ggml_fp16_to_fp32(((const ggml_fp16_t *)row)[k])
                                                         : ((const float *)row)[k];
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * kernel choice: once per process (the same arithmetic for every pass), the SIMD kernels where
 * the avx2-f32 family runs (the CPU and the cap BITSPLIT_MAX_ISA)
 * ------------------------------------------------------------------------------------------- */

typedef struct attn_kernels {
    const char * name; /* in messages */
    void (*product)(const bs_attn_args * g, int64_t c0, int64_t c1);
    void (*exp_row)(const float * x, float * y, int64_t n, float max);
    void (*transpose)(const char * a, size_t a_row, bool f16, int64_t K, int64_t M, float * t, int64_t t_row);
} attn_kernels;

static const attn_kernels * kernels(void) {
    static const attn_kernels generic = {"generic", bs_attn_product_generic, bs_attn_exp_row_generic,
                                         transpose_generic};
#if defined(__x86_64__)
    static const attn_kernels avx2 = {"avx2", bs_attn_product_avx2, bs_attn_exp_row_avx2, bs_attn_transpose_avx2};
    static const attn_kernels * chosen = NULL;
    if (chosen == NULL) {
        chosen = bs_family_named("avx2-f32") != NULL ? &avx2 : &generic; /* a benign race: one answer */
    }
    return chosen;
#else
    return &generic;
#endif
}

/* ---------------------------------------------------------------------------------------------
 * the products
 * ------------------------------------------------------------------------------------------- */

/* n f32 outputs at p NaN: what a thread could not compute (out of memory), never stale values */
static void nan_fill(char * p, int64_t n) {
    float * y = (float *)p;
    for (int64_t i = 0; i < n; i++) {
        y[i] = NAN;
    }
}

bool bs_attn_shape_ok(const struct ggml_tensor * t) {
    const struct ggml_tensor * a = t->src[0];
    const struct ggml_tensor * b = t->src[1];
    if (t->op != GGML_OP_MUL_MAT || a == NULL || b == NULL || t->type != GGML_TYPE_F32 || b->type != GGML_TYPE_F32) {
        return false;
    }
    if (a->type != GGML_TYPE_F16 && a->type != GGML_TYPE_F32) {
        return false;
    }
    if (a->nb[0] != ggml_type_size(a->type) || b->nb[0] != sizeof(float) || !ggml_is_contiguous(t)) {
        return false;
    }
    if (a->ne[0] != b->ne[0] || a->ne[0] <= 0 || a->ne[1] <= 0 || a->ne[2] <= 0 || a->ne[3] <= 0 ||
        b->ne[2] % a->ne[2] != 0 || b->ne[3] % a->ne[3] != 0) {
        return false;
    }
    return t->ne[0] == a->ne[1] && t->ne[1] == b->ne[1] && t->ne[2] == b->ne[2] && t->ne[3] == b->ne[3] &&
           a->data != NULL && b->data != NULL && t->data != NULL;
}

void bs_attn_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    bitsplit_ctx * ctx = userdata;
    const struct ggml_tensor * a = dst->src[0];
    const struct ggml_tensor * b = dst->src[1];
    const uint64_t t0 = ith == 0 ? bs_now_ns() : 0;
    if (!bs_thread_works(ith, &nth)) {
        return;
    }
    const attn_kernels * kern = kernels();
    const int64_t K = a->ne[0], M = a->ne[1], n = b->ne[1];
    const int64_t A2 = a->ne[2], A3 = a->ne[3];
    const int64_t r2 = b->ne[2] / A2, r3 = b->ne[3] / A3;
    const int64_t t_row = (M + 7) & ~(int64_t)7;
    const int64_t col_blocks = (n + ATTN_COLS - 1) / ATTN_COLS;
    const int64_t items = A2 * A3 * col_blocks; /* (KV slice, column block); a slice's items are neighbours */
    const int64_t it0 = items * ith / nth, it1 = items * (ith + 1) / nth;
    /* one slice transposed at a time, every slice the same size */
    bs_scratch * s = &ctx->scratch[ith];
    float * t = it0 < it1 ? bs_scratch_get(s, (size_t)(K * t_row) * sizeof(float)) : NULL;
    if (it0 < it1 && t == NULL) {
        /* this thread's outputs NaN, never the stale values the node held, and an error for the caller */
        for (int64_t it = it0; it < it1; it++) {
            const int64_t slice = it / col_blocks, cb = it % col_blocks;
            const int64_t s2 = slice % A2, s3 = slice / A2;
            const int64_t c0 = cb * ATTN_COLS, c1 = c0 + ATTN_COLS < n ? c0 + ATTN_COLS : n;
            for (int64_t i3 = s3 * r3; i3 < (s3 + 1) * r3; i3++) {
                for (int64_t i2 = s2 * r2; i2 < (s2 + 1) * r2; i2++) {
                    for (int64_t c = c0; c < c1; c++) {
                        nan_fill((char *)dst->data + i2 * dst->nb[2] + i3 * dst->nb[3] + c * dst->nb[1], M);
                    }
                }
            }
        }
        bs_record_error(ctx, BITSPLIT_E_NOMEM,
                        "out of memory: attention's product '%s' (%s kernels) could not allocate %llu bytes of scratch",
                        dst->name, kern->name, (unsigned long long)s->failed);
        return;
    }
    int64_t have = -1; /* the slice transposed in t */
    for (int64_t it = it0; it < it1; it++) {
        const int64_t slice = it / col_blocks, cb = it % col_blocks;
        const int64_t s2 = slice % A2, s3 = slice / A2;
        if (slice != have) {
            kern->transpose((const char *)a->data + s2 * a->nb[2] + s3 * a->nb[3], a->nb[1], a->type == GGML_TYPE_F16, K,
                            M, t, t_row);
            have = slice;
        }
        const int64_t c0 = cb * ATTN_COLS, c1 = c0 + ATTN_COLS < n ? c0 + ATTN_COLS : n;
        /* every head (and outer index) of b that reads this slice */
        for (int64_t i3 = s3 * r3; i3 < (s3 + 1) * r3; i3++) {
            for (int64_t i2 = s2 * r2; i2 < (s2 + 1) * r2; i2++) {
                const bs_attn_args g = {
                    .t = t,
                    .t_row = t_row,
                    .b = (const char *)b->data + i2 * b->nb[2] + i3 * b->nb[3],
                    .b_col = b->nb[1],
                    .y = (char *)dst->data + i2 * dst->nb[2] + i3 * dst->nb[3],
                    .y_col = dst->nb[1],
                    .K = K,
                    .M = M,
                };
                kern->product(&g, c0, c1);
            }
        }
    }
    if (ith == 0 && ctx != NULL) {
        atomic_fetch_add(&ctx->c_attn, 1);
        atomic_fetch_add(&ctx->c_ns_attn, bs_now_ns() - t0);
    }
}

/* ---------------------------------------------------------------------------------------------
 * the softmax: ggml_soft_max_ext(x, mask, scale, max_bias) with optional sinks
 * ------------------------------------------------------------------------------------------- */

#define FIX_ONE 0x1p40f /* the fixed point of the exact sum */

bool bs_softmax_shape_ok(const struct ggml_tensor * t) {
    const struct ggml_tensor * x = t->src[0];
    const struct ggml_tensor * m = t->src[1];
    const struct ggml_tensor * s = t->src[2];
    if (t->op != GGML_OP_SOFT_MAX || x == NULL || x->type != GGML_TYPE_F32 || t->type != GGML_TYPE_F32 ||
        !ggml_is_contiguous(t) || x->nb[0] != sizeof(float) || !ggml_are_same_shape(x, t) || x->data == NULL ||
        t->data == NULL) {
        return false;
    }
    if (m != NULL) {
        if ((m->type != GGML_TYPE_F32 && m->type != GGML_TYPE_F16) || m->nb[0] != ggml_type_size(m->type) ||
            m->ne[0] != x->ne[0] || m->ne[1] < x->ne[1] || m->ne[2] <= 0 || m->ne[3] <= 0 ||
            x->ne[2] % m->ne[2] != 0 || x->ne[3] % m->ne[3] != 0 || m->data == NULL) {
            return false;
        }
    }
    if (s != NULL && (s->type != GGML_TYPE_F32 || !ggml_is_contiguous(s) || s->ne[0] < x->ne[2] || s->data == NULL)) {
        return false;
    }
    return x->ne[0] > 0 && x->ne[0] < ((int64_t)1 << 22); /* the fixed-point sum has room for 2^23 ones */
}

void bs_softmax_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    bitsplit_ctx * ctx = userdata;
    const struct ggml_tensor * x = dst->src[0];
    const struct ggml_tensor * m = dst->src[1];
    const struct ggml_tensor * s = dst->src[2];
    if (!bs_thread_works(ith, &nth)) {
        return;
    }
    float scale, max_bias; /* the node's own parameters, kept aside while it is a custom op (hook.c) */
    memcpy(&scale, (const char *)dst->op_params + BS_STASH_BYTES, sizeof(float));
    memcpy(&max_bias, (const char *)dst->op_params + BS_STASH_BYTES + sizeof(float), sizeof(float));
    const int64_t n = x->ne[0], rows = x->ne[1], heads = x->ne[2], outer = x->ne[3];
    const uint32_t n_head_log2 = 1u << (uint32_t)floor(log2((double)heads));
    const float m0 = powf(2.0f, -(max_bias) / n_head_log2);
    const float m1 = powf(2.0f, -(max_bias / 2.0f) / n_head_log2);
    const attn_kernels * kern = kernels();
    const int64_t total = rows * heads * outer;
    const int64_t r0 = total * ith / nth, r1 = total * (ith + 1) / nth;
    bs_scratch * sc = &ctx->scratch[ith];
    float * w = r0 < r1 ? bs_scratch_get(sc, (size_t)(n + 8) * sizeof(float)) : NULL;
    if (r0 < r1 && w == NULL) {
        /* this thread's rows NaN, never the stale values the node held, and an error for the caller */
        for (int64_t r = r0; r < r1; r++) {
            const int64_t i1 = r % rows, i2 = (r / rows) % heads, i3 = r / (rows * heads);
            nan_fill((char *)dst->data + i1 * dst->nb[1] + i2 * dst->nb[2] + i3 * dst->nb[3], n);
        }
        bs_record_error(ctx, BITSPLIT_E_NOMEM,
                        "out of memory: the softmax '%s' (%s kernels) could not allocate %llu bytes of scratch",
                        dst->name, kern->name, (unsigned long long)sc->failed);
        return;
    }
    for (int64_t r = r0; r < r1; r++) {
        const int64_t i1 = r % rows, i2 = (r / rows) % heads, i3 = r / (rows * heads);
        const float slope = max_bias > 0.0f ? (i2 < (int64_t)n_head_log2 ? powf(m0, (float)(i2 + 1))
                                                                         : powf(m1, (float)(2 * (i2 - n_head_log2) + 1)))
                                            : 1.0f;
        const float * xr = (const float *)((const char *)x->data + i1 * x->nb[1] + i2 * x->nb[2] + i3 * x->nb[3]);
        float * yr = (float *)((char *)dst->data + i1 * dst->nb[1] + i2 * dst->nb[2] + i3 * dst->nb[3]);
        const char * mr = m == NULL ? NULL
                                    : (const char *)m->data + i1 * m->nb[1] + (i2 % m->ne[2]) * m->nb[2] +
                                          (i3 % m->ne[3]) * m->nb[3];
        float mx = -INFINITY;
        for (int64_t i = 0; i < n; i++) {
            float v = xr[i] * scale;
            if (mr != NULL) {
                v += slope * (m->type == GGML_TYPE_F16 ? ggml_fp16_to_fp32(((const ggml_fp16_t *)mr)[i])
                                                      : ((const float *)mr)[i]);
            }
            w[i] = v;
            mx = v > mx ? v : mx;
        }
        const float sink = s != NULL ? ((const float *)s->data)[i2] : -INFINITY;
        mx = sink > mx ? sink : mx;
        if (mx == -INFINITY) { /* nothing visible: ggml would divide by zero; a row of zeros */
            memset(yr, 0, (size_t)n * sizeof(float));
            continue;
        }
        kern->exp_row(w, yr, n, mx);
        int64_t sum = 0;
        for (int64_t i = 0; i < n; i++) {
            sum += (int64_t)(yr[i] * FIX_ONE);
        }
        if (s != NULL) {
            sum += (int64_t)(exp_generic(sink - mx) * FIX_ONE);
        }
        const float inv = (float)((double)FIX_ONE / (double)sum);
        for (int64_t i = 0; i < n; i++) {
            yr[i] *= inv;
        }
    }
    if (ith == 0 && ctx != NULL) {
        atomic_fetch_add(&ctx->c_softmax, 1);
    }
}
