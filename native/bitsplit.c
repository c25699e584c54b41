/*
 * bitsplit: residual tensors in host memory and the llama.cpp eval callback that applies them.
 * See bitsplit.h for the contract. This file holds the small public API: switches, counters, the
 * direct product and the kernel queries; it is the top of the library (native/README.md: the units
 * bottom to top). The rest, by file:
 *
 * - errors.c: the status strings and the first error of a context (bitsplit_ctx_take_error).
 * - loader.c: maps residual.gguf and base.gguf read-only and validates the residual against the
 *   base (bitsplit_ctx_load/free), the tensor lookup and info.
 * - pool.c: the thread pool, the barrier, the per-thread job runner and the product counters.
 * - hook.c: the eval callback: the custom ops of replace mode (MUL_MAT, GET_ROWS, MUL_MAT_ID, the
 *   fast drafter's base products), and add mode for observed nodes; custom_op.c: ggml's private
 *   custom-op layout, a node turned into this library's op and back.
 * - kernels.c, arch/<arch>/: the kernel families and the policy that picks one per product.
 */
#define _GNU_SOURCE
#include "bitsplit.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bs_internal.h"
#include "ggml.h"

void bitsplit_ctx_set_enabled(bitsplit_ctx * ctx, bool enabled) {
    if (ctx) atomic_store(&ctx->enabled, enabled);
}

void bitsplit_ctx_set_draft_kernel(bitsplit_ctx * ctx, bool on) {
    if (ctx) atomic_store(&ctx->draft_fast, on);
}

int bitsplit_ctx_set_draft_vocab(bitsplit_ctx * ctx, int64_t rows, int64_t tail) {
    if (ctx == NULL || rows < 0 || tail < rows) {
        return BITSPLIT_E_INVALID;
    }
    ctx->draft_rows = rows;
    ctx->draft_tail = tail;
    return BITSPLIT_OK;
}

bool bitsplit_ctx_get_enabled(const bitsplit_ctx * ctx) {
    return ctx ? atomic_load(&((bitsplit_ctx *)ctx)->enabled) : false;
}

int bitsplit_ctx_set_precision(bitsplit_ctx * ctx, int precision) {
    if (ctx == NULL || precision < BITSPLIT_PREC_AUTO || precision > BITSPLIT_PREC_BF16) {
        return BITSPLIT_E_INVALID;
    }
    ctx->precision = precision;
    return BITSPLIT_OK;
}

int bitsplit_ctx_set_act_bits(bitsplit_ctx * ctx, int act_bits) {
    if (ctx == NULL || act_bits < BITSPLIT_ACTS_AUTO || act_bits > BITSPLIT_ACTS_8) {
        return BITSPLIT_E_INVALID;
    }
    ctx->act_bits = act_bits;
    return BITSPLIT_OK;
}

int bitsplit_ctx_act_bits(const bitsplit_ctx * ctx, int res_type) {
    if (ctx == NULL) {
        return -1;
    }
    return bs_resolve_act8(ctx, (enum ggml_type)res_type) ? 8 : 16;
}

int bitsplit_ctx_set_numerics(bitsplit_ctx * ctx, int numerics, int outliers) {
    if (ctx == NULL || numerics < BITSPLIT_NUMERICS_HOST || numerics > BITSPLIT_NUMERICS_FLOAT || outliers < 0 ||
        outliers > BITSPLIT_MAX_OUTLIERS || (outliers > 0 && ctx->compensate != BITSPLIT_NUMERICS_HOST)) {
        return BITSPLIT_E_INVALID;
    }
    ctx->numerics = numerics;
    ctx->numerics_outliers = numerics == BITSPLIT_NUMERICS_HOST ? 0 : outliers;
    return BITSPLIT_OK;
}

int bitsplit_ctx_set_compensation(bitsplit_ctx * ctx, int numerics, void * cpu_device) {
    if (ctx == NULL || numerics < BITSPLIT_NUMERICS_HOST || numerics > BITSPLIT_NUMERICS_FLOAT ||
        (numerics != BITSPLIT_NUMERICS_HOST && (ctx->numerics_outliers > 0 || atomic_load(&ctx->n_exact_sets) > 0))) {
        return BITSPLIT_E_INVALID;
    }
    ctx->compensate = numerics;
    if (cpu_device != NULL && cpu_device != ctx->comp_cpu_dev) {
        bs_overlap_drain(ctx);
        bs_comp_free(ctx, false); /* a backend of the old device is not the new one's */
        ctx->comp_cpu_dev = cpu_device;
    }
    return BITSPLIT_OK;
}

void bitsplit_ctx_set_device_add(bitsplit_ctx * ctx, bool on) {
    if (ctx != NULL) {
        bs_overlap_drain(ctx);
        ctx->device_add = on;
    }
}

void bitsplit_ctx_release_devices(bitsplit_ctx * ctx, bool lost) {
    if (ctx != NULL) {
        bs_overlap_drain(ctx);
        bs_comp_free(ctx, lost);
    }
}

int bitsplit_ctx_set_exact_channels(bitsplit_ctx * ctx, const char * name, int n, const int32_t * channels) {
    if (ctx == NULL || name == NULL || n < 0 || n > BITSPLIT_MAX_OUTLIERS || (n > 0 && channels == NULL) ||
        (n > 0 && ctx->compensate != BITSPLIT_NUMERICS_HOST)) {
        return BITSPLIT_E_INVALID;
    }
    bs_entry * e = (bs_entry *)bs_find_entry(ctx, name);
    if (e == NULL) {
        return BITSPLIT_E_INVALID;
    }
    for (int i = 0; i < n; i++) {
        if (channels[i] < 0 || channels[i] >= e->ne[0]) {
            return BITSPLIT_E_INVALID;
        }
    }
    memcpy(e->exact_ch, channels, (size_t)n * sizeof(int32_t));
    atomic_fetch_add(&ctx->n_exact_sets, (n > 0) - (e->n_exact_ch > 0));
    e->n_exact_ch = n;
    return BITSPLIT_OK;
}

int bitsplit_round_activations(int numerics, int weight_type, int64_t K, int64_t n_cols, int outliers, const float * x,
                               float * out) {
    if (numerics < BITSPLIT_NUMERICS_HOST || numerics > BITSPLIT_NUMERICS_FLOAT || weight_type < 0 ||
        weight_type >= GGML_TYPE_COUNT || K < 1 || n_cols < 0 || (n_cols > 0 && (x == NULL || out == NULL)) ||
        outliers < 0 || outliers > BITSPLIT_MAX_OUTLIERS) {
        return BITSPLIT_E_INVALID;
    }
    const int rule = bs_numerics_rule(numerics, (enum ggml_type)weight_type, n_cols, K);
    if (rule < 0) {
        return BITSPLIT_E_UNSUPPORTED;
    }
    int32_t sel[BITSPLIT_MAX_OUTLIERS];
    for (int64_t c = 0; c < n_cols; c++) {
        bs_numerics_round(rule, x + c * K, K, out + c * K, outliers, sel);
    }
    return BITSPLIT_OK;
}

int bitsplit_ctx_set_mode(bitsplit_ctx * ctx, int mode) {
    if (ctx == NULL || (mode != BITSPLIT_MODE_AUTO && mode != BITSPLIT_MODE_ADD)) {
        return BITSPLIT_E_INVALID;
    }
    ctx->mode = mode;
    return BITSPLIT_OK;
}

int bitsplit_ctx_set_overlap(bitsplit_ctx * ctx, int where) {
    if (ctx == NULL || where < BITSPLIT_OVERLAP_OFF || where > BITSPLIT_OVERLAP_PRODUCTS) {
        return BITSPLIT_E_INVALID;
    }
    if (!bs_overlap_enable(ctx, where != BITSPLIT_OVERLAP_OFF)) {
        return BITSPLIT_E_NOMEM;
    }
    ctx->overlap_at_products = where == BITSPLIT_OVERLAP_PRODUCTS;
    return BITSPLIT_OK;
}

/* ggml's abort hook: one message, then the process ends (see bitsplit_set_abort_message) */
static char abort_msg[1024];

static void on_ggml_abort(const char * message) {
    /* async-signal-safe calls only: another thread may hold stdio's locks */
    bs_stderr_write(abort_msg, strnlen(abort_msg, sizeof(abort_msg)));
    bs_stderr_write("\n  llama.cpp: ", 14);
    if (message != NULL) {
        const size_t m = strnlen(message, 4096);
        bs_stderr_write(message, m > 0 && message[m - 1] == '\n' ? m - 1 : m);
    }
    bs_stderr_write("\n", 1);
    bs_exit_now(1);
}

void bitsplit_set_abort_message(const char * msg) {
    if (msg == NULL) {
        ggml_set_abort_callback(NULL);
        abort_msg[0] = '\0';
        return;
    }
    snprintf(abort_msg, sizeof(abort_msg), "%s", msg);
    ggml_set_abort_callback(on_ggml_abort);
}

int bitsplit_ctx_set_batch_invariant(bitsplit_ctx * ctx, bool on) {
    if (ctx == NULL) {
        return BITSPLIT_E_INVALID;
    }
    ctx->invariant = on;
    return BITSPLIT_OK;
}

bool bitsplit_ctx_get_batch_invariant(const bitsplit_ctx * ctx) { return ctx != NULL && ctx->invariant; }

int bitsplit_ctx_set_prompt(bitsplit_ctx * ctx, bool on) {
    if (ctx == NULL) {
        return BITSPLIT_E_INVALID;
    }
    ctx->prompt = on;
    return BITSPLIT_OK;
}

bool bitsplit_ctx_get_prompt(const bitsplit_ctx * ctx) { return ctx != NULL && ctx->prompt; }

int bitsplit_ctx_set_threads(bitsplit_ctx * ctx, int n_threads) {
    if (ctx == NULL || n_threads < 1 || n_threads > BS_MAX_THREADS) {
        return BITSPLIT_E_INVALID;
    }
    if (n_threads != ctx->n_threads) {
        bs_overlap_drain(ctx);
        bs_pool_free(ctx->pool);
        ctx->pool = NULL;
        ctx->n_threads = n_threads;
    }
    return BITSPLIT_OK;
}

void bitsplit_ctx_get_counters(const bitsplit_ctx * c, bitsplit_counters * out) {
    if (c == NULL || out == NULL) {
        return;
    }
    bitsplit_ctx * ctx = (bitsplit_ctx *)c;
    out->n_products = atomic_load(&ctx->c_products);
    out->n_add_products = atomic_load(&ctx->c_add);
    out->n_get_rows = atomic_load(&ctx->c_rows);
    out->n_columns = atomic_load(&ctx->c_cols);
    out->bytes_residual = atomic_load(&ctx->c_bres);
    out->bytes_base = atomic_load(&ctx->c_bbase);
    out->bytes_outlier_base = atomic_load(&ctx->c_boutlier);
    out->n_compensated = atomic_load(&ctx->c_comp);
    out->ns_compensate = atomic_load(&ctx->c_ns_comp);
    out->ns_inside = atomic_load(&ctx->c_ns);
    out->n_errors = atomic_load(&ctx->c_err);
    out->n_draft_products = atomic_load(&ctx->c_draft);
    out->ns_draft = atomic_load(&ctx->c_ns_draft);
    out->bytes_from_device = atomic_load(&ctx->c_bdev_in);
    out->bytes_to_device = atomic_load(&ctx->c_bdev_out);
    out->ns_transfer = atomic_load(&ctx->c_ns_xfer);
    out->n_overlapped = atomic_load(&ctx->c_overlap);
    out->ns_wait = atomic_load(&ctx->c_ns_wait);
    out->n_stops = atomic_load(&ctx->c_stops);
    out->n_exact_products = atomic_load(&ctx->c_exact);
    out->n_attn_products = atomic_load(&ctx->c_attn);
    out->ns_attn = atomic_load(&ctx->c_ns_attn);
    out->n_softmax = atomic_load(&ctx->c_softmax);
}

void bitsplit_ctx_reset_counters(bitsplit_ctx * ctx) {
    if (ctx == NULL) {
        return;
    }
    atomic_store(&ctx->c_products, 0);
    atomic_store(&ctx->c_add, 0);
    atomic_store(&ctx->c_rows, 0);
    atomic_store(&ctx->c_cols, 0);
    atomic_store(&ctx->c_bres, 0);
    atomic_store(&ctx->c_bbase, 0);
    atomic_store(&ctx->c_boutlier, 0);
    atomic_store(&ctx->c_comp, 0);
    atomic_store(&ctx->c_ns_comp, 0);
    atomic_store(&ctx->c_ns, 0);
    atomic_store(&ctx->c_err, 0);
    atomic_store(&ctx->c_draft, 0);
    atomic_store(&ctx->c_ns_draft, 0);
    atomic_store(&ctx->c_bdev_in, 0);
    atomic_store(&ctx->c_bdev_out, 0);
    atomic_store(&ctx->c_ns_xfer, 0);
    atomic_store(&ctx->c_overlap, 0);
    atomic_store(&ctx->c_ns_wait, 0);
    atomic_store(&ctx->c_stops, 0);
    atomic_store(&ctx->c_exact, 0);
    atomic_store(&ctx->c_attn, 0);
    atomic_store(&ctx->c_ns_attn, 0);
    atomic_store(&ctx->c_softmax, 0);
}

/* the job of bitsplit_ctx_matmul (x, y may be NULL: to ask which family would compute it) */
static int matmul_job(bitsplit_ctx * ctx, const char * name, const float * x, int64_t n_cols, float * y,
                      bool with_base, bs_job * job) {
    if (ctx == NULL || name == NULL || n_cols < 0) {
        return BITSPLIT_E_INVALID;
    }
    const bs_entry * e = bs_find_entry(ctx, name);
    if (e == NULL || e->ne[2] != 1 || e->ne[3] != 1 || (e->exact && !with_base)) {
        return BITSPLIT_E_INVALID; /* a weight without residual has no R . x */
    }
    bs_fill_job(job, e, with_base ? e->base_data : NULL, 0, e->ne[1]);
    bs_job_columns(job, ctx, x, n_cols, y);
    return BITSPLIT_OK;
}

int bitsplit_ctx_matmul(bitsplit_ctx * ctx, const char * name, const float * x, int64_t n_cols, float * y,
                        bool with_base) {
    if (x == NULL || y == NULL) {
        return BITSPLIT_E_INVALID;
    }
    const uint64_t t0 = bs_now_ns();
    bs_job job;
    if (matmul_job(ctx, name, x, n_cols, y, with_base, &job) != BITSPLIT_OK) {
        return BITSPLIT_E_INVALID;
    }
    bs_overlap_drain(ctx);
    const int st = bs_run_on_pool(ctx, &job);
    if (st == BITSPLIT_OK) {
        bs_count_job(ctx, &job, t0, !with_base);
    }
    return st;
}

/* the fast drafter's product W2 . x of a weight with residual, as the callback computes it with the
 * residual off (8-bit activations, the draft policy's family), on this library's threads */
int bitsplit_ctx_draft_matmul(bitsplit_ctx * ctx, const char * name, const float * x, int64_t n_cols, float * y) {
    if (ctx == NULL || name == NULL || x == NULL || y == NULL || n_cols < 1) {
        return BITSPLIT_E_INVALID;
    }
    const bs_entry * e = bs_find_entry(ctx, name);
    if (e == NULL || e->exact || e->ne[2] != 1 || e->ne[3] != 1) {
        return BITSPLIT_E_INVALID; /* the drafter computes base products of weights with residual only */
    }
    bs_job job;
    bs_fill_job(&job, e, e->base_data, 0, e->ne[1]);
    job.r = NULL;
    job.draft = true;
    bs_job_columns(&job, ctx, x, n_cols, y);
    if (bs_draft_policy(&job) == NULL) {
        return BITSPLIT_E_UNSUPPORTED; /* ggml's own kernel drafts this product */
    }
    const uint64_t t0 = bs_now_ns();
    bs_overlap_drain(ctx);
    const int st = bs_run_on_pool(ctx, &job);
    if (st == BITSPLIT_OK) {
        atomic_fetch_add(&ctx->c_draft, 1);
        atomic_fetch_add(&ctx->c_ns_draft, bs_now_ns() - t0);
    }
    return st;
}

const char * bitsplit_ctx_family_of(bitsplit_ctx * ctx, const char * name, int64_t n_cols, bool with_base) {
    bs_job job;
    if (n_cols < 1 || matmul_job(ctx, name, NULL, n_cols, NULL, with_base, &job) != BITSPLIT_OK) {
        return "";
    }
    return bs_family_for(ctx, &job)->name;
}

const char * bitsplit_kernel_name(void) {
    const char * env = getenv("BITSPLIT_KERNEL");
    const bs_kernel_family * f = env != NULL && env[0] != '\0' ? bs_family_named(env) : NULL;
    return f != NULL ? f->name : bs_policy(1, false, NULL)->name;
}

const char * bitsplit_kernel_for_batch(int64_t n_cols, bool residual_alone) {
    const char * env = getenv("BITSPLIT_KERNEL");
    const bs_kernel_family * f = env != NULL && env[0] != '\0' ? bs_family_named(env) : NULL;
    return f != NULL ? f->name : bs_policy(n_cols < 1 ? 1 : n_cols, residual_alone, NULL)->name;
}

const char * bitsplit_draft_kernel(void) {
    const bs_kernel_family * f = bs_draft_policy(NULL);
    return f != NULL ? f->name : "";
}

int bitsplit_draft_min_cols(void) {
    const bs_kernel_family * f = bs_draft_policy(NULL);
    return f != NULL ? f->draft_min_cols : 0;
}

bool bitsplit_half_rate_512(void) { return bs_half_rate_in_force(); }

const char * bitsplit_max_isa(void) {
    int cap;
    bs_isa_cap(&cap);
    return bs_isa_name(cap);
}

int bitsplit_set_measured_policy(bool residual_alone, const int64_t * cols, const char * const * families, int n) {
    return bs_policy_set_measured(residual_alone, cols, families, n);
}

int bitsplit_measured_policy(bool residual_alone, int64_t * cols, const char ** families, int max) {
    return bs_policy_measured(residual_alone, cols, families, max < 0 ? 0 : max);
}

int bitsplit_kernel_families(const char ** names, int max) {
    const bs_kernel_family * list[BS_MAX_FAMILIES];
    const int n = bs_policy_list(1, false, NULL, list, BS_MAX_FAMILIES);
    for (int i = 0; i < n && i < max; i++) {
        names[i] = list[i]->name;
    }
    return n;
}

int bitsplit_ctx_set_kernel(bitsplit_ctx * ctx, const char * name) {
    if (ctx == NULL) {
        return BITSPLIT_E_INVALID;
    }
    if (name == NULL || name[0] == '\0') {
        if (!ctx->pin_all) ctx->pinned = NULL;
        return BITSPLIT_OK;
    }
    const bs_kernel_family * f = bs_family_named(name);
    if (f == NULL) {
        return BITSPLIT_E_UNSUPPORTED;
    }
    ctx->pinned = f;
    ctx->pin_all = false;
    return BITSPLIT_OK;
}

const char * bitsplit_ctx_choose_kernel(bitsplit_ctx * ctx, int64_t n_cols, bool residual_alone) {
    if (ctx == NULL) {
        return "";
    }
    if (!ctx->pin_all) {
        ctx->pinned = bs_policy(n_cols < 1 ? 1 : n_cols, residual_alone, NULL);
    }
    return ctx->pinned->name;
}

const char * bitsplit_ctx_kernel(const bitsplit_ctx * ctx) {
    if (ctx == NULL) {
        return "";
    }
    return ctx->pinned != NULL ? ctx->pinned->name : bs_policy(1, false, NULL)->name;
}
