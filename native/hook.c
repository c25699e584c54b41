/*
 * The eval callback. It is asked (ask=true) about every graph node before it is computed. For a
 * weight product of the base that has a residual and lives in host memory, it turns the node into
 * a ggml custom op whose function computes (W2 + R) . x (ggml then runs it on its own thread pool,
 * with no extra synchronisation); the original op is kept in the node's op_params (custom_op.c) and
 * restored the next time the node is seen with the callback disabled (llama.cpp reuses graphs). A node in a
 * device buffer is observed instead (ask returns true) and corrected afterwards (add mode). With
 * the residual off and the fast drafter on, base products of CPU nodes become custom ops too. In
 * batch-invariant mode, CPU products with the base's weights that have no residual (the output
 * head, tensors the split kept exact) are computed here as well, by the same pinned family, and so
 * is attention without flash attention (its two products of the KV cache and its softmax, attn.c):
 * ggml's own kernels switch paths with the batch size, and sum over cached cells in lanes that
 * masked cells shift.
 */
#define _GNU_SOURCE
#include "bitsplit.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bs_internal.h"
#include "ggml-backend.h"
#include "ggml.h"

/* ---------------------------------------------------------------------------------------------
 * custom ops (replace mode: ggml's CPU threads call these with ith/nth)
 * ------------------------------------------------------------------------------------------- */

/* n outputs NaN: what could not be computed (out of memory), never stale values (as bs_run_job) */
static void nan_fill(float * y, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        y[i] = NAN;
    }
}

static const uint8_t * base_rows(const bs_entry * e, const struct ggml_tensor * w) {
    /* llama.cpp's own copy when it is plain host memory in ggml's layout (mmap of the same file:
     * shared pages); otherwise (repacked or device weights) this library's map of base.gguf */
    if (w->data != NULL && w->buffer != NULL && ggml_backend_buffer_is_host(w->buffer) && w->extra == NULL) {
        return (const uint8_t *)w->data;
    }
    return e->base_data;
}

/* Emulated device numerics (bitsplit_ctx_set_numerics): the product's two jobs, W2 . xdev (x as the
 * device rounds it, exact weights) into y, then R . x added as add mode computes it on the host (jr.r
 * NULL: a weight without residual, W2 alone) */
static void numerics_jobs(const bitsplit_ctx * ctx, const bs_entry * e, const uint8_t * w2, const float * x,
                          const float * xdev, int64_t n_cols, float * y, bs_job * jb, bs_job * jr) {
    bs_fill_job(jb, e, w2, 0, e->ne[1]);
    jb->r = NULL;
    bs_job_columns(jb, ctx, xdev, n_cols, y);
    jb->acts = ctx->acts;
    bs_fill_job(jr, e, NULL, 0, e->ne[1]);
    bs_job_columns(jr, ctx, x, n_cols, y);
    jr->accumulate = true;
    jr->acts = ctx->acts;
}

static void mul_mat_numerics(struct ggml_tensor * dst, int ith, int nth, const bs_entry * e, uint64_t t0) {
    bitsplit_ctx * ctx = e->ctx;
    const struct ggml_tensor * x = dst->src[1];
    const int64_t K = e->ne[0], n = ggml_nrows(x);
    const int rule = bs_numerics_rule(ctx->numerics, e->base_type, n, K); /* checked when asked */
    if (rule < 0) {
        if (ith == 0) {
            nan_fill((float *)dst->data, n * e->ne[1]);
            bs_record_error(ctx, BITSPLIT_E_UNSUPPORTED, "device numerics: no rule for '%s'", e->name);
        }
        return;
    }
    const float * xs = (const float *)x->data;
    float * xd = (float *)ctx->xdev;
    /* each column's exact channels: the weight's fixed set (a dense slab of those columns on the host),
     * else the column's own m largest */
    const bool fixed = e->n_exact_ch > 0;
    /* once some weight has a fixed set (an imatrix's), one it does not name takes none */
    const int m = fixed || atomic_load(&ctx->n_exact_sets) > 0 ? 0
                  : ctx->numerics_outliers < K ? ctx->numerics_outliers : (int)K;
    int32_t * sel = (int32_t *)(xd + (size_t)n * (size_t)K);
    for (int64_t c = n * ith / nth; c < n * (ith + 1) / nth; c++) {
        if (fixed) { /* the whole set, or the row's own largest among it */
            const int take = ctx->numerics_outliers > 0 ? ctx->numerics_outliers : e->n_exact_ch;
            bs_numerics_round_pool(rule, xs + c * K, K, xd + c * K, take, e->exact_ch, e->n_exact_ch,
                                   sel + c * BITSPLIT_MAX_OUTLIERS);
        } else {
            bs_numerics_round(rule, xs + c * K, K, xd + c * K, m, sel + c * m);
        }
    }
    /* compensation (bitsplit_ctx_set_compensation): the error of the rule the host assumes, e = x - round(x),
     * as the device rounds it for its second product */
    float * xc = ctx->compensate != BITSPLIT_NUMERICS_HOST ? (float *)ctx->xcomp : NULL;
    if (xc != NULL) {
        const int crule = bs_numerics_rule(ctx->compensate, e->base_type, n, K); /* checked when asked */
        for (int64_t c = n * ith / nth; c < n * (ith + 1) / nth; c++) {
            bs_numerics_error(crule, xs + c * K, K, xc + c * K);
            bs_numerics_round(rule, xc + c * K, K, xc + c * K, 0, NULL);
        }
    }
    bs_barrier(ctx, nth); /* every column rounded */
    if (fixed && ith == 0) {
        atomic_fetch_add(&ctx->c_boutlier, (uint64_t)e->ne[1] * (uint64_t)e->n_exact_ch * 2u);
    }
    if (m > 0 && ith == 0) {
        /* the host's exact part, W2[:, S] . x[S], would read every row's blocks holding a channel of
         * some column's S: count those blocks' bytes */
        const int64_t blk = ggml_blck_size(e->base_type), nb = K / blk;
        uint8_t * seen = (uint8_t *)(sel + (size_t)n * (size_t)m);
        memset(seen, 0, (size_t)nb);
        int64_t blocks = 0;
        for (int64_t i = 0; i < n * m; i++) {
            const int64_t b = sel[i] / blk;
            blocks += seen[b] == 0;
            seen[b] = 1;
        }
        atomic_fetch_add(&ctx->c_boutlier, (uint64_t)blocks * (uint64_t)e->ne[1] * (e->base_row_bytes / (size_t)nb));
    }
    bs_job jb, jr;
    numerics_jobs(ctx, e, base_rows(e, dst->src[0]), xs, xd, n, (float *)dst->data, &jb, &jr);
    bs_run_job(ctx, &jb, ith, nth);
    if (xc != NULL) { /* the device's second product, W2 . e-rounded, added */
        bs_job jc = jb;
        bs_job_columns(&jc, ctx, xc, n, (float *)dst->data);
        jc.accumulate = true;
        jc.acts = ctx->acts;
        bs_barrier(ctx, nth); /* every thread done with the shared activations */
        bs_run_job(ctx, &jc, ith, nth);
    }
    if (jr.r != NULL) {
        bs_barrier(ctx, nth); /* every thread done with the shared activations (and its rows of W2 . xdev) */
        bs_run_job(ctx, &jr, ith, nth);
    }
    if (ith != 0) {
        return;
    }
    if (e->exact) {
        atomic_fetch_add(&ctx->c_exact, 1);
        atomic_fetch_add(&ctx->c_cols, (uint64_t)n);
        atomic_fetch_add(&ctx->c_bbase, (uint64_t)jb.N * jb.w2_row_bytes);
        atomic_fetch_add(&ctx->c_ns, bs_now_ns() - t0);
    } else {
        jb.r = jr.r; /* counted as the one product it stands for */
        jb.r_row_bytes = jr.r_row_bytes;
        bs_count_job(ctx, &jb, t0, false);
    }
}

/* ask time, with emulated device numerics: the product's rule, and room for its rounded activations
 * and the shared activations of both its jobs */
static bool numerics_ready(bitsplit_ctx * ctx, const bs_entry * e, int64_t n_cols) {
    if (ctx->compensate != BITSPLIT_NUMERICS_HOST) {
        if (bs_numerics_rule(ctx->compensate, e->base_type, n_cols, e->ne[0]) < 0) {
            bs_record_error(ctx, BITSPLIT_E_UNSUPPORTED,
                            "device numerics: cannot compensate weight '%s' of type %s (%lld wide) in a pass of %lld rows",
                            e->name, ggml_type_name(e->base_type), (long long)e->ne[0], (long long)n_cols);
            return false;
        }
        if (!bs_ensure(&ctx->xcomp, &ctx->xcomp_size, (size_t)n_cols * (size_t)e->ne[0] * sizeof(float) + 64)) {
            bs_record_error(ctx, BITSPLIT_E_NOMEM, "out of memory preparing the compensation of '%s' (%lld rows)",
                            e->name, (long long)n_cols);
            return false;
        }
    }
    if (bs_numerics_rule(ctx->numerics, e->base_type, n_cols, e->ne[0]) < 0) {
        bs_record_error(ctx, BITSPLIT_E_UNSUPPORTED,
                        "device numerics: no rounding rule for weight '%s' of type %s (%lld wide) in a pass of %lld rows",
                        e->name, ggml_type_name(e->base_type), (long long)e->ne[0], (long long)n_cols);
        return false;
    }
    bs_job jb, jr;
    numerics_jobs(ctx, e, e->base_data, NULL, NULL, n_cols, NULL, &jb, &jr);
    size_t need = bs_job_acts_size(ctx, &jb);
    if (jr.r != NULL && bs_job_acts_size(ctx, &jr) > need) {
        need = bs_job_acts_size(ctx, &jr);
    }
    if (!bs_ensure(&ctx->acts, &ctx->acts_size, need + 64) ||
        !bs_ensure(&ctx->xdev, &ctx->xdev_size, (size_t)n_cols * (size_t)e->ne[0] * sizeof(float) +
                                                    (size_t)n_cols * BITSPLIT_MAX_OUTLIERS * sizeof(int32_t) +
                                                    (size_t)e->ne[0] + 64)) {
        bs_record_error(ctx, BITSPLIT_E_NOMEM, "out of memory preparing the emulated device product of '%s'", e->name);
        return false;
    }
    return true;
}

/* (W2 + R) . x, or W2 . x alone for the fast drafter (the residual is off) */
static void mul_mat(struct ggml_tensor * dst, int ith, int nth, const bs_entry * e, bool base_only) {
    bitsplit_ctx * ctx = e->ctx;
    const struct ggml_tensor * w = dst->src[0];
    const struct ggml_tensor * x = dst->src[1];
    const uint64_t t0 = ith == 0 ? bs_now_ns() : 0;
    if (ctx->numerics != BITSPLIT_NUMERICS_HOST && !base_only) {
        mul_mat_numerics(dst, ith, nth, e, t0);
        return;
    }
    bs_job job;
    bs_fill_job(&job, e, base_rows(e, w), 0, e->ne[1]);
    if (base_only) {
        job.r = NULL;
        job.draft = true;
    }
    bs_job_columns(&job, ctx, (const float *)x->data, ggml_nrows(x), (float *)dst->data);
    job.acts = ctx->acts;
    bs_run_job(ctx, &job, ith, nth);
    if (ith != 0) {
        return;
    }
    if (base_only) {
        atomic_fetch_add(&ctx->c_draft, 1);
        atomic_fetch_add(&ctx->c_ns_draft, bs_now_ns() - t0);
    } else if (e->exact) {
        atomic_fetch_add(&ctx->c_exact, 1);
        atomic_fetch_add(&ctx->c_cols, (uint64_t)job.n_cols);
        atomic_fetch_add(&ctx->c_bbase, (uint64_t)job.N * job.w2_row_bytes);
        atomic_fetch_add(&ctx->c_ns, bs_now_ns() - t0);
    } else {
        bs_count_job(ctx, &job, t0, false);
    }
}

static void op_mul_mat(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    mul_mat(dst, ith, nth, userdata, false);
}

static void op_mul_mat_base(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    mul_mat(dst, ith, nth, userdata, true);
}

/* the output head's rows kept by a draft vocabulary: [0, *p) and [*t, N) */
static void head_span(const bitsplit_ctx * ctx, int64_t N, int64_t * p, int64_t * t) {
    *p = ctx->draft_rows < N ? ctx->draft_rows : N;
    *t = ctx->draft_tail < N ? ctx->draft_tail : N;
}

/* rows [row0, row0 + n) of the head for the drafter, into the full-height columns y */
static void head_job(bs_job * job, const bitsplit_ctx * ctx, const bs_entry * e, const uint8_t * w2, const float * x,
                     int64_t n_cols, float * y, int64_t row0, int64_t n) {
    bs_fill_job(job, e, w2 != NULL ? w2 + (size_t)row0 * e->base_row_bytes : NULL, row0, n);
    job->r = NULL;
    job->draft = true;
    job->any_cols = true;
    bs_job_columns(job, ctx, x, n_cols, y != NULL ? y + row0 : NULL);
    job->ldy = e->ne[1];
    job->acts = ctx->acts;
}

/* The output head in a drafting pass with a draft vocabulary (bitsplit_ctx_set_draft_vocab): its
 * kept rows by the draft family, at any width (ggml's product cannot skip rows), the others -inf */
static void op_mul_mat_head(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const bs_entry * e = userdata;
    bitsplit_ctx * ctx = e->ctx;
    const struct ggml_tensor * x = dst->src[1];
    const uint64_t t0 = ith == 0 ? bs_now_ns() : 0;
    const int64_t N = e->ne[1], n_cols = ggml_nrows(x);
    int64_t p, t;
    head_span(ctx, N, &p, &t);
    const uint8_t * w2 = base_rows(e, dst->src[0]);
    float * y = (float *)dst->data;
    for (int64_t c = n_cols * ith / nth; c < n_cols * (ith + 1) / nth; c++) {
        for (int64_t r = p; r < t; r++) {
            y[c * N + r] = -INFINITY;
        }
    }
    bs_job job;
    head_job(&job, ctx, e, w2, (const float *)x->data, n_cols, y, 0, p);
    bs_run_job(ctx, &job, ith, nth);
    if (t < N) {
        bs_barrier(ctx, nth); /* every thread done with the shared activations */
        head_job(&job, ctx, e, w2, (const float *)x->data, n_cols, y, t, N - t);
        bs_run_job(ctx, &job, ith, nth);
    }
    if (ith == 0) {
        atomic_fetch_add(&ctx->c_draft, 1);
        atomic_fetch_add(&ctx->c_ns_draft, bs_now_ns() - t0);
    }
}

static void op_get_rows(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const bs_entry * e = userdata;
    bitsplit_ctx * ctx = e->ctx;
    const struct ggml_tensor * w = dst->src[0];
    const struct ggml_tensor * ids = dst->src[1];
    const uint8_t * w2 = base_rows(e, w);
    const int64_t K = e->ne[0];
    const int64_t n = ggml_nelements(ids);
    const int32_t * id = (const int32_t *)ids->data;
    if (!bs_thread_works(ith, &nth)) {
        return;
    }
    const int64_t i0 = n * ith / nth, i1 = n * (ith + 1) / nth;
    bs_scratch * s = &ctx->scratch[ith];
    float * tmp = i0 < i1 ? bs_scratch_get(s, (size_t)K * sizeof(float)) : NULL;
    if (i0 < i1 && tmp == NULL) {
        /* this thread's rows NaN, never the stale values the node held, and an error for the caller */
        for (int64_t i = i0; i < i1; i++) {
            nan_fill((float *)((char *)dst->data + i * dst->nb[1]), K);
        }
        bs_record_error(ctx, BITSPLIT_E_NOMEM,
                        "out of memory: the embedding lookup of '%s' could not allocate %llu bytes of scratch", e->name,
                        (unsigned long long)s->failed);
        return;
    }
    for (int64_t i = i0; i < i1; i++) {
        float * out = (float *)((char *)dst->data + i * dst->nb[1]);
        const int64_t row = id[i];
        if (row < 0 || row >= e->n_rows) {
            bs_record_error(ctx, BITSPLIT_E_INVALID, "token id %lld out of range for '%s' (%lld rows)", (long long)row,
                         e->name, (long long)e->n_rows);
            memset(out, 0, (size_t)K * sizeof(float));
            continue;
        }
        bs_dequant_row(e->base_type, w2 + (size_t)row * e->base_row_bytes, out, K);
        bs_dequant_row(e->res_type, e->res_data + (size_t)row * e->res_row_bytes, tmp, K);
        for (int64_t k = 0; k < K; k++) {
            out[k] += tmp[k];
        }
    }
    if (ith == 0) {
        atomic_fetch_add(&ctx->c_rows, 1);
    }
}

/* MUL_MAT_ID: dst[:, i, t] = (W2_e + R_e) . x[:, i % ne11, t] with e = ids[i, t]; experts one by one,
 * each with the columns that chose it gathered, so a weight block is unpacked once per expert. */
static void op_mul_mat_id(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    const bs_entry * e = userdata;
    bitsplit_ctx * ctx = e->ctx;
    const struct ggml_tensor * w = dst->src[0];
    const struct ggml_tensor * x = dst->src[1];
    const struct ggml_tensor * ids = dst->src[2];
    const uint64_t t0 = ith == 0 ? bs_now_ns() : 0;
    const int64_t K = e->ne[0], N = e->ne[1], n_exp = e->ne[2];
    const int64_t n_used = ids->ne[0], n_tok = ids->ne[1];
    const int64_t n_pairs = n_used * n_tok;
    /* shared gather buffer layout: [pairs: int64 slot list][x columns K*pairs][y columns N*pairs] */
    int64_t * list = ctx->gather;
    float * xg = (float *)(list + n_pairs);
    float * yg = xg + (size_t)K * (size_t)n_pairs;
    const uint8_t * w2all = base_rows(e, w);
    for (int64_t ex = 0; ex < n_exp; ex++) {
        int64_t m = 0;
        for (int64_t t = 0; t < n_tok; t++) {
            for (int64_t i = 0; i < n_used; i++) {
                const int32_t id = *(const int32_t *)((const char *)ids->data + i * ids->nb[0] + t * ids->nb[1]);
                if (id == ex) {
                    if (ith == 0) {
                        list[m] = t * n_used + i;
                    }
                    m++;
                }
            }
        }
        if (m == 0) {
            continue;
        }
        bs_barrier(ctx, nth); /* list written */
        for (int64_t j = (int64_t)m * ith / nth; j < (int64_t)m * (ith + 1) / nth; j++) {
            const int64_t t = list[j] / n_used, i = list[j] % n_used;
            const float * src = (const float *)((const char *)x->data + (i % x->ne[1]) * x->nb[1] + t * x->nb[2]);
            memcpy(xg + (size_t)j * K, src, (size_t)K * sizeof(float));
        }
        bs_barrier(ctx, nth); /* columns gathered */
        bs_job job;
        bs_fill_job(&job, e, w2all + (size_t)(ex * N) * e->base_row_bytes, ex * N, N);
        bs_job_columns(&job, ctx, xg, m, yg);
        job.acts = ctx->acts;
        bs_run_job(ctx, &job, ith, nth);
        bs_barrier(ctx, nth); /* results complete */
        for (int64_t j = (int64_t)m * ith / nth; j < (int64_t)m * (ith + 1) / nth; j++) {
            const int64_t t = list[j] / n_used, i = list[j] % n_used;
            memcpy((char *)dst->data + i * dst->nb[1] + t * dst->nb[2], yg + (size_t)j * N, (size_t)N * sizeof(float));
        }
        bs_barrier(ctx, nth); /* list and buffers free for the next expert */
    }
    if (ith == 0) {
        atomic_fetch_add(&ctx->c_products, 1);
        atomic_fetch_add(&ctx->c_cols, (uint64_t)n_pairs);
        atomic_fetch_add(&ctx->c_ns, bs_now_ns() - t0);
    }
}

/* ---------------------------------------------------------------------------------------------
 * the callback
 * ------------------------------------------------------------------------------------------- */

static bool host(const struct ggml_tensor * t) {
    return bs_host_tensor(t);
}

/* The entry of a weight by its name in the graph. ggml's scheduler names its copy of a tensor for
 * another backend "BACKEND#name#N" (ggml-backend.cpp: llama.cpp's op offload computes a large
 * batch of a CPU weight on the GPU from such a copy): the same weight, so the same residual. */
static const bs_entry * find_weight(const bitsplit_ctx * ctx, const char * name) {
    const bs_entry * e = bs_find_entry(ctx, name);
    if (e != NULL) {
        return e;
    }
    const char * a = strchr(name, '#');
    const char * b = strrchr(name, '#');
    if (a == NULL || b <= a + 1 || b[1] == '\0') {
        return NULL;
    }
    for (const char * p = b + 1; *p != '\0'; p++) {
        if (*p < '0' || *p > '9') {
            return NULL;
        }
    }
    char inner[GGML_MAX_NAME];
    const size_t n = (size_t)(b - a - 1);
    if (n >= sizeof(inner)) {
        return NULL;
    }
    memcpy(inner, a + 1, n);
    inner[n] = '\0';
    return bs_find_entry(ctx, inner);
}

/* The residual entry for the weight of node t, after checking the graph's weight against it. */
static const bs_entry * entry_for(bitsplit_ctx * ctx, const struct ggml_tensor * t) {
    const struct ggml_tensor * w = t->src[0];
    if (w == NULL || w->name[0] == '\0') {
        return NULL;
    }
    const bs_entry * e = find_weight(ctx, w->name);
    if (e == NULL) {
        return NULL;
    }
    if (w->type != e->base_type || w->ne[0] != e->ne[0] || w->ne[1] != e->ne[1] || w->ne[2] != e->ne[2] ||
        w->ne[3] != e->ne[3]) {
        bs_record_error(ctx, BITSPLIT_E_MISMATCH,
                     "weight '%s' in the graph is %s %lldx%lldx%lld but the residual was made for %s %lldx%lldx%lld",
                     w->name, ggml_type_name(w->type), (long long)w->ne[0], (long long)w->ne[1], (long long)w->ne[2],
                     ggml_type_name(e->base_type), (long long)e->ne[0], (long long)e->ne[1], (long long)e->ne[2]);
        return NULL;
    }
    return e;
}

static bool plain_f32_matrix(const struct ggml_tensor * t) {
    return t->type == GGML_TYPE_F32 && ggml_is_contiguous(t);
}

/* attention in a batch-invariant verifier pass on the CPU (attn.c): its two products of the KV
 * cache (a MUL_MAT whose first source is a view that names no weight) and its softmax */
static void ask_attention(bitsplit_ctx * ctx, struct ggml_tensor * t) {
    if (!ctx->invariant || ctx->mode == BITSPLIT_MODE_ADD || !ctx->replace_ok || !host(t)) {
        return;
    }
    ggml_custom_op_t fn;
    if (t->op == GGML_OP_MUL_MAT && bs_attn_shape_ok(t) && t->src[0]->view_src != NULL &&
        find_weight(ctx, t->src[0]->name) == NULL) {
        fn = bs_attn_op;
    } else if (t->op == GGML_OP_SOFT_MAX && bs_softmax_shape_ok(t)) {
        fn = bs_softmax_op;
    } else {
        return;
    }
    for (int i = 0; i < 3; i++) { /* sources: a, b / x, mask, sinks */
        if (t->src[i] != NULL && !host(t->src[i])) {
            return;
        }
    }
    bs_overlap_drain(ctx);
    bs_custom_mutate(t, fn, ctx);
}

/* ask == true for a hooked node: decide replace (mutate, return false) or add (return true) */
static bool ask_node(bitsplit_ctx * ctx, struct ggml_tensor * t) {
    const enum ggml_op op = t->op;
    const bs_entry * e = entry_for(ctx, t);
    if (e == NULL) {
        if (op == GGML_OP_MUL_MAT) {
            ask_attention(ctx, t); /* not a weight: attention's product of the KV cache? */
        }
        return false;
    }
    const struct ggml_tensor * x = t->src[1];
    const bool cpu = host(t) && x != NULL && host(x);
    if (e->exact && op == GGML_OP_MUL_MAT && ctx->compensate != BITSPLIT_NUMERICS_HOST &&
        (!cpu || ctx->mode == BITSPLIT_MODE_ADD) && x != NULL && ggml_nrows(x) > 0 &&
        bs_numerics_rule(ctx->compensate, e->base_type, ggml_nrows(x), e->ne[0]) != 0) {
        return true; /* a weight without residual, its device's rounding compensated after the node */
    }
    if (e->exact && (op != GGML_OP_MUL_MAT || !cpu || !ctx->invariant || ctx->mode == BITSPLIT_MODE_ADD)) {
        return false; /* nothing to add: ggml's own product is the verifier's */
    }
    if (op == GGML_OP_GET_ROWS) {
        if (!cpu || ctx->mode == BITSPLIT_MODE_ADD || x->type != GGML_TYPE_I32 || !ggml_is_contiguous(x) ||
            t->type != GGML_TYPE_F32 || t->ne[0] != e->ne[0] || e->ne[2] != 1 || e->ne[3] != 1 || !ctx->replace_ok) {
            return true; /* add mode: observe, correct after the node is computed */
        }
        bs_overlap_drain(ctx);
        bs_custom_mutate(t, op_get_rows, e);
        return false;
    }
    if (op == GGML_OP_MUL_MAT) {
        const bool shapes = e->ne[2] == 1 && e->ne[3] == 1 && plain_f32_matrix(x) && plain_f32_matrix(t) &&
                            x->ne[0] == e->ne[0] && t->ne[0] == e->ne[1];
        if (cpu && shapes && ctx->replace_ok && ctx->mode != BITSPLIT_MODE_ADD) {
            bs_job job;
            bs_fill_job(&job, e, e->base_data, 0, e->ne[1]);
            bs_job_columns(&job, ctx, NULL, ggml_nrows(x), NULL);
            if (!bs_ensure(&ctx->acts, &ctx->acts_size, bs_job_acts_size(ctx, &job) + 64)) {
                bs_record_error(ctx, BITSPLIT_E_NOMEM, "out of memory preparing the product of '%s'", e->name);
                return false;
            }
            if (ctx->numerics != BITSPLIT_NUMERICS_HOST && !numerics_ready(ctx, e, ggml_nrows(x))) {
                return false;
            }
            bs_overlap_drain(ctx);
            bs_custom_mutate(t, op_mul_mat, e);
            return false;
        }
        return true; /* add mode: observe, correct after the node is computed */
    }
    if (op == GGML_OP_MUL_MAT_ID) {
        const struct ggml_tensor * ids = t->src[2];
        if (ctx->numerics != BITSPLIT_NUMERICS_HOST) {
            bs_record_error(ctx, BITSPLIT_E_UNSUPPORTED, "device numerics are not emulated for expert weights ('%s')",
                            e->name);
            return false;
        }
        if (cpu && ids != NULL && host(ids) && ids->type == GGML_TYPE_I32 && x->type == GGML_TYPE_F32 &&
            t->type == GGML_TYPE_F32 && x->ne[0] == e->ne[0] && t->ne[0] == e->ne[1] && ctx->replace_ok &&
            x->nb[0] == sizeof(float) && t->nb[0] == sizeof(float) && e->ne[3] == 1) {
            const int64_t pairs = ids->ne[0] * ids->ne[1];
            bs_job job;
            bs_fill_job(&job, e, e->base_data, 0, e->ne[1]);
            bs_job_columns(&job, ctx, NULL, pairs, NULL);
            const size_t g = (size_t)pairs * (sizeof(int64_t) + (size_t)(e->ne[0] + e->ne[1]) * sizeof(float));
            if (!bs_ensure(&ctx->acts, &ctx->acts_size, bs_job_acts_size(ctx, &job) + 64) ||
                !bs_ensure(&ctx->gather, &ctx->gather_size, g + 64)) {
                bs_record_error(ctx, BITSPLIT_E_NOMEM, "out of memory preparing the experts of '%s'", e->name);
                return false;
            }
            bs_overlap_drain(ctx);
            bs_custom_mutate(t, op_mul_mat_id, e);
            return false;
        }
        bs_record_error(ctx, BITSPLIT_E_UNSUPPORTED, "expert weights '%s' outside host memory are not supported yet",
                     e->name);
        return false;
    }
    return false;
}

/* ask == true with the residual off and the fast drafter on: base products of CPU nodes here, and
 * with a draft vocabulary the exact output head's kept rows (op_mul_mat_head) */
static bool ask_draft(bitsplit_ctx * ctx, struct ggml_tensor * t) {
    const bs_entry * e = entry_for(ctx, t);
    const struct ggml_tensor * x = t->src[1];
    if (e == NULL || x == NULL || !host(t) || !host(x) || !ctx->replace_ok || e->ne[2] != 1 || e->ne[3] != 1 ||
        !plain_f32_matrix(x) || !plain_f32_matrix(t) || x->ne[0] != e->ne[0] || t->ne[0] != e->ne[1]) {
        return false;
    }
    bs_job job;
    ggml_custom_op_t fn;
    if (e->exact) {
        if (ctx->draft_rows <= 0 || ctx->draft_rows >= e->ne[1] || strcmp(e->name, "output.weight") != 0) {
            return false; /* no draft vocabulary, or not the head: ggml's product */
        }
        int64_t p, tail;
        head_span(ctx, e->ne[1], &p, &tail);
        head_job(&job, ctx, e, e->base_data, NULL, ggml_nrows(x), NULL, 0, p);
        fn = op_mul_mat_head;
    } else {
        bs_fill_job(&job, e, e->base_data, 0, e->ne[1]);
        job.r = NULL;
        job.draft = true;
        bs_job_columns(&job, ctx, NULL, ggml_nrows(x), NULL);
        fn = op_mul_mat_base;
    }
    if (bs_draft_policy(&job) == NULL) {
        return false; /* ggml's own kernel is as fast or faster here, or the only one for this type */
    }
    bs_overlap_drain(ctx);
    if (!bs_ensure(&ctx->acts, &ctx->acts_size, bs_job_acts_size(ctx, &job) + 64)) {
        return false; /* out of memory: ggml's own kernel will do */
    }
    bs_custom_mutate(t, fn, e);
    return false;
}

/* bytes moved between a device buffer and the host (none for host tensors); t0: when it started,
 * 0 to count the bytes alone */
static void count_transfer(bitsplit_ctx * ctx, const struct ggml_tensor * t, size_t bytes, bool to_host,
                           uint64_t t0) {
    if (!host(t)) {
        atomic_fetch_add(to_host ? &ctx->c_bdev_in : &ctx->c_bdev_out, bytes);
    }
    if (t0 != 0) {
        atomic_fetch_add(&ctx->c_ns_xfer, bs_now_ns() - t0);
    }
}

/* add mode could not correct node t (F32, contiguous) for lack of memory: an error for the caller,
 * and the node's values NaN where the host can write them, never W2 . x passed off as the verifier's
 * (a node in a device buffer keeps them: writing there needs the host buffer that was missing) */
static void add_out_of_memory(bitsplit_ctx * ctx, struct ggml_tensor * t, const bs_entry * e) {
    if (host(t)) {
        nan_fill((float *)t->data, ggml_nelements(t));
    }
    bs_record_error(ctx, BITSPLIT_E_NOMEM, "out of memory correcting '%s'%s", e->name,
                    host(t) ? "" : " (the node in a device buffer keeps the base's product)");
}

/* compensation (bitsplit_ctx_set_compensation) of one product t = W2 . x computed in add mode: the
 * device's W2 . (x - round(x)) added to d (n_cols x N, on the host); false after recording an error */
static bool compensate_one(bitsplit_ctx * ctx, const struct ggml_tensor * t, const float * xs, int64_t n_cols,
                           float * d) {
    const size_t ybytes = (size_t)n_cols * (size_t)t->src[0]->ne[1] * sizeof(float);
    if (ybytes == 0) {
        return true; /* no rows wanted (a pass that asks for no logits) */
    }
    float * c = bs_scratch_get(&ctx->host_c, ybytes);
    if (c == NULL) {
        bs_record_error(ctx, BITSPLIT_E_NOMEM, "out of memory compensating '%s'", t->src[0]->name);
        return false;
    }
    const struct ggml_tensor * w = t->src[0];
    if (!bs_compensate(ctx, &w, 1, xs, n_cols, &c)) {
        return false;
    }
    for (size_t i = 0; i < ybytes / sizeof(float); i++) {
        d[i] += c[i];
    }
    return true;
}

/* a weight without residual, observed for compensation alone: t += the device's W2 . e */
static void compensate_exact(bitsplit_ctx * ctx, struct ggml_tensor * t, const bs_entry * e) {
    const struct ggml_tensor * x = t->src[1];
    if (t->op != GGML_OP_MUL_MAT || !plain_f32_matrix(x) || !plain_f32_matrix(t) || e->ne[2] != 1 ||
        x->ne[0] != e->ne[0] || t->ne[0] != e->ne[1]) {
        bs_record_error(ctx, BITSPLIT_E_UNSUPPORTED, "product with '%s' has an unsupported layout for compensation",
                        e->name);
        return;
    }
    bs_overlap_drain(ctx);
    const int64_t n_cols = ggml_nrows(x), K = e->ne[0], N = e->ne[1];
    const size_t xbytes = (size_t)(n_cols * K) * sizeof(float), ybytes = (size_t)(n_cols * N) * sizeof(float);
    float * xs = bs_scratch_get(&ctx->host_x, xbytes);
    if (xs == NULL) {
        bs_record_error(ctx, BITSPLIT_E_NOMEM, "out of memory compensating '%s'", e->name);
        return;
    }
    const uint64_t tx = bs_now_ns();
    ggml_backend_tensor_get(x, xs, 0, xbytes);
    count_transfer(ctx, x, xbytes, true, tx);
    if (ctx->device_add && !host(t)) { /* W2 . e added on the device, in place: no host copy of t */
        bs_device_add(ctx, t, NULL, xs);
        return;
    }
    float * ys = bs_scratch_get(&ctx->host_y, ybytes);
    if (ys == NULL) {
        bs_record_error(ctx, BITSPLIT_E_NOMEM, "out of memory compensating '%s'", e->name);
        return;
    }
    ggml_backend_tensor_get(t, ys, 0, ybytes);
    count_transfer(ctx, t, ybytes, true, tx);
    if (compensate_one(ctx, t, xs, n_cols, ys)) {
        const uint64_t ts = bs_now_ns();
        ggml_backend_tensor_set(t, ys, 0, ybytes);
        count_transfer(ctx, t, ybytes, false, ts);
    }
}

/* ask == false for an observed node: add R . x (the node holds W2 . x, possibly on a device) */
static bool add_residual(bitsplit_ctx * ctx, struct ggml_tensor * t) {
    const bs_entry * e = entry_for(ctx, t);
    if (e != NULL && e->exact && ctx->compensate != BITSPLIT_NUMERICS_HOST && t->op == GGML_OP_MUL_MAT) {
        compensate_exact(ctx, t, e);
        return true;
    }
    if (e == NULL || e->exact) {
        return true;
    }
    const uint64_t t0 = bs_now_ns();
    const struct ggml_tensor * x = t->src[1];
    if (t->op == GGML_OP_GET_ROWS) {
        if (x->type != GGML_TYPE_I32 || !ggml_is_contiguous(x) || t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t)) {
            bs_record_error(ctx, BITSPLIT_E_UNSUPPORTED, "embedding lookup of '%s' has an unsupported layout", e->name);
            return true;
        }
        const int64_t n = ggml_nelements(x), K = e->ne[0];
        int32_t * ids = bs_scratch_get(&ctx->host_x, (size_t)n * sizeof(int32_t));
        float * rows = bs_scratch_get(&ctx->host_y, (size_t)(n * K) * sizeof(float));
        float * tmp = bs_scratch_get(&ctx->host_d, (size_t)(n * K) * sizeof(float));
        if (ids == NULL || rows == NULL || tmp == NULL) {
            add_out_of_memory(ctx, t, e);
            return true;
        }
        const uint64_t tx = bs_now_ns();
        ggml_backend_tensor_get(x, ids, 0, (size_t)n * sizeof(int32_t));
        ggml_backend_tensor_get(t, rows, 0, (size_t)(n * K) * sizeof(float));
        count_transfer(ctx, x, (size_t)n * sizeof(int32_t), true, 0);
        count_transfer(ctx, t, (size_t)(n * K) * sizeof(float), true, tx);
        for (int64_t i = 0; i < n; i++) {
            if (ids[i] < 0 || ids[i] >= e->n_rows) {
                bs_record_error(ctx, BITSPLIT_E_INVALID, "token id %d out of range for '%s'", ids[i], e->name);
                return true;
            }
            bs_dequant_row(e->res_type, e->res_data + (size_t)ids[i] * e->res_row_bytes, tmp + i * K, K);
            for (int64_t k = 0; k < K; k++) {
                rows[i * K + k] += tmp[i * K + k];
            }
        }
        const uint64_t ts = bs_now_ns();
        ggml_backend_tensor_set(t, rows, 0, (size_t)(n * K) * sizeof(float));
        count_transfer(ctx, t, (size_t)(n * K) * sizeof(float), false, ts);
        atomic_fetch_add(&ctx->c_rows, 1);
        return true;
    }
    if (t->op != GGML_OP_MUL_MAT || !plain_f32_matrix(x) || !plain_f32_matrix(t) || e->ne[2] != 1 ||
        x->ne[0] != e->ne[0] || t->ne[0] != e->ne[1]) {
        bs_record_error(ctx, BITSPLIT_E_UNSUPPORTED, "product with '%s' has an unsupported layout for add mode", e->name);
        return true;
    }
    const int64_t n_cols = ggml_nrows(x), K = e->ne[0], N = e->ne[1];
    const size_t ybytes = (size_t)(n_cols * N) * sizeof(float);
    bs_overlap_learn(ctx, x, e, t->src[0]);
    bs_overlap_start_at(ctx, x, e); /* with the overlap at products */
    /* R . x: started when x was computed (overlap), or computed now */
    const float * delta = bs_overlap_take(ctx, t, e);
    const float * xcopy = NULL; /* the host's x, for compensation on the device */
    bs_job job;
    if (delta == NULL) {
        bs_overlap_drain(ctx);
        float * d = bs_scratch_get(&ctx->host_d, ybytes);
        const float * xs = NULL;
        if (host(x)) {
            xs = x->data;
        } else {
            float * buf = bs_scratch_get(&ctx->host_x, (size_t)(n_cols * K) * sizeof(float));
            if (buf != NULL) {
                const uint64_t tx = bs_now_ns();
                ggml_backend_tensor_get(x, buf, 0, (size_t)(n_cols * K) * sizeof(float));
                count_transfer(ctx, x, (size_t)(n_cols * K) * sizeof(float), true, tx);
            }
            xs = buf;
        }
        if (xs == NULL || d == NULL) {
            add_out_of_memory(ctx, t, e);
            return true;
        }
        bs_fill_job(&job, e, NULL, 0, N);
        bs_job_columns(&job, ctx, xs, n_cols, d);
        if (bs_run_on_pool(ctx, &job) != BITSPLIT_OK) {
            add_out_of_memory(ctx, t, e);
            return true;
        }
        bs_count_job(ctx, &job, t0, true);
        if (ctx->compensate != BITSPLIT_NUMERICS_HOST && !(ctx->device_add && !host(t))) {
            compensate_one(ctx, t, xs, n_cols, d); /* on failure: an error for the pass */
        }
        delta = d;
        xcopy = xs;
    } else {
        xcopy = bs_overlap_x(ctx, t);
    }
    if (ctx->device_add && !host(t)) { /* R . x (and W2 . e) added on the device: nothing comes back */
        bs_device_add(ctx, t, delta, xcopy); /* on failure: an error for the pass */
        return true;
    }
    float * ys = host(t) ? t->data : bs_scratch_get(&ctx->host_y, ybytes);
    if (ys == NULL) {
        add_out_of_memory(ctx, t, e);
        return true;
    }
    if (!host(t)) {
        const uint64_t tx = bs_now_ns();
        ggml_backend_tensor_get(t, ys, 0, ybytes);
        count_transfer(ctx, t, ybytes, true, tx);
    }
    for (int64_t i = 0; i < n_cols * N; i++) {
        ys[i] += delta[i];
    }
    if (!host(t)) {
        const uint64_t tx = bs_now_ns();
        ggml_backend_tensor_set(t, ys, 0, ybytes);
        count_transfer(ctx, t, ybytes, false, tx);
    }
    return true;
}

bool bitsplit_eval_callback(struct ggml_tensor * t, bool ask, void * user_data) {
    bitsplit_ctx * ctx = user_data;
    if (ctx == NULL || t == NULL) {
        return ask ? false : true;
    }
    if (ask) {
        if (bs_custom_is_ours(t)) {
            /* a graph reused from an earlier pass still carries our op: give the node back its own,
             * then decide afresh (the callback may have been switched off since) */
            bs_custom_restore(t);
        }
        if (!atomic_load_explicit(&ctx->enabled, memory_order_relaxed)) {
            if (t->op == GGML_OP_MUL_MAT && atomic_load_explicit(&ctx->draft_fast, memory_order_relaxed)) {
                return ask_draft(ctx, t);
            }
            return false;
        }
        if (t->op == GGML_OP_MUL_MAT || t->op == GGML_OP_GET_ROWS || t->op == GGML_OP_MUL_MAT_ID) {
            return ask_node(ctx, t);
        }
        if (t->op == GGML_OP_SOFT_MAX) {
            ask_attention(ctx, t);
            return false;
        }
        /* the input of residual products (learned): stop here to start their R . x early */
        return bs_overlap_is_feed(ctx, t);
    }
    /* returning false would abort the graph: always continue */
    if (atomic_load_explicit(&ctx->enabled, memory_order_relaxed) && !bs_custom_is_ours(t)) {
        atomic_fetch_add_explicit(&ctx->c_stops, 1, memory_order_relaxed);
        if (t->op == GGML_OP_MUL_MAT || t->op == GGML_OP_GET_ROWS || t->op == GGML_OP_MUL_MAT_ID) {
            add_residual(ctx, t);
        }
        if (bs_overlap_is_feed(ctx, t)) {
            bs_overlap_start(ctx, t);
        }
    }
    return true;
}
