/*
 * Compensation of a device's activation rounding (bitsplit_ctx_set_compensation), in add mode.
 *
 * With the base on a device, W2 . x is computed by the device's quantized kernels, which round x
 * first (8 bits per block of 32 or 256 values: numerics.c gives each rule), and that rounding, not the
 * 2-bit base or the residual, sets the verifier's error. The host knows x and the rule, so it knows
 * the rounding's error e = x - round(x) exactly. Here the device that holds W2 computes a second
 * product, W2 . e, on a graph of its own (a backend of the weight's device, over its own buffer for
 * e and the result; for llama.cpp's RPC client the same connection as the model's), rounding e as it
 * rounds anything; e's scale is ~1/254 of x's, so what is left of the error is ~254 times smaller.
 * The host adds it with R . x. The host reads no extra weight bytes; the device computes each base
 * product twice, and e goes up and W2 . e comes down, once per shared input for all its products (one
 * write per rounding rule, one graph, one read). With the sum made on the device (bs_device_add, per
 * product), e goes up with the first product of its input and stays on the device for the others.
 *
 * The scheduler has synchronised the model's backend before the callback runs, and every call here
 * finishes its own work (synchronize) before it returns, so the two streams of work never overlap.
 */
#include "bitsplit.h"

#include <stdlib.h>
#include <string.h>

#include "bs_internal.h"
#include "ggml-backend.h"
#include "ggml.h"

#define COMP_DEVICES 8 /* devices a context compensates on (RPC servers, GPUs) */
#define COMP_CHUNK_BYTES ((size_t)64 << 20) /* the most of a device's memory one graph's e and results take */

/* COMP_CHUNK_BYTES, or BITSPLIT_COMP_CHUNK_KB (tests: small chunks on small models) */
static size_t chunk_bytes(void) {
    const char * v = getenv("BITSPLIT_COMP_CHUNK_KB");
    char * end = NULL;
    const long long kb = v != NULL ? strtoll(v, &end, 10) : 0;
    return v != NULL && end != v && *end == '\0' && kb > 0 && kb < (1LL << 30) ? (size_t)kb << 10 : COMP_CHUNK_BYTES;
}

typedef struct {
    ggml_backend_dev_t dev;
    ggml_backend_t backend;
    ggml_backend_buffer_type_t buft;
    ggml_backend_buffer_t buf; /* e and the results, grown as passes need */
    size_t size;
    /* the device's add (bs_device_add): the last e it uploaded, kept in a buffer of its own, and the
     * activations it was made from (host), so that the next product of the same input (k and v after
     * q, up after gate) uses it again instead of sending the same e once more */
    ggml_backend_buffer_t ebuf;
    size_t esize;
    void * ex;    /* the x that e was made from, n_cols x K floats (ex_cols 0: no e kept) */
    size_t ex_size;
    int64_t ex_cols, ex_k;
    int ex_rule;
    /* the device runs what it is sent in the order sent, whoever sends it: llama.cpp's RPC client, whose
     * backends and buffers on one server share one queue and one connection. The device's add needs no
     * synchronisation there: the model's next command waits behind it anyway */
    bool ordered;
} comp_dev;

struct bs_comp {
    comp_dev devs[COMP_DEVICES];
    int n_devs;
    void * meta; /* the graph's tensors and nodes (ggml_init over this memory, no data) */
    size_t meta_size;
    void * err; /* host: e for each distinct rule */
    size_t err_size;
    void * span; /* host: the results as read back in one piece */
    size_t span_size;
};

void bs_comp_free(bitsplit_ctx * ctx, bool lost) {
    bs_comp * c = ctx->comp;
    if (c == NULL) {
        return;
    }
    for (int i = 0; i < c->n_devs && !lost; i++) { /* a lost device's buffers and backends are let go unfreed */
        if (c->devs[i].buf != NULL) {
            ggml_backend_buffer_free(c->devs[i].buf);
        }
        if (c->devs[i].ebuf != NULL) {
            ggml_backend_buffer_free(c->devs[i].ebuf);
        }
        if (c->devs[i].backend != NULL) {
            ggml_backend_free(c->devs[i].backend);
        }
    }
    for (int i = 0; i < c->n_devs; i++) {
        bs_aligned_free(c->devs[i].ex);
    }
    bs_aligned_free(c->meta);
    bs_aligned_free(c->err);
    bs_aligned_free(c->span);
    free(c);
    ctx->comp = NULL;
}

/* the device that computes with weight w: its buffer's, or for host memory, whose buffer types name no
 * device (llama.cpp's CPU buffers), the CPU device bitsplit_ctx_set_compensation was given */
static ggml_backend_dev_t device_of(const bitsplit_ctx * ctx, const struct ggml_tensor * w) {
    if (w->buffer == NULL) {
        return NULL;
    }
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(ggml_backend_buffer_get_type(w->buffer));
    if (dev == NULL && ggml_backend_buffer_is_host(w->buffer)) {
        dev = (ggml_backend_dev_t)ctx->comp_cpu_dev;
    }
    return dev;
}

/* the backend for device dev (made once per context), or NULL */
static comp_dev * device_for(bitsplit_ctx * ctx, ggml_backend_dev_t dev, const char * name) {
    bs_comp * c = ctx->comp;
    if (dev == NULL) {
        bs_record_error(ctx, BITSPLIT_E_UNSUPPORTED, "compensation: the buffer of '%s' names no device", name);
        return NULL;
    }
    for (int i = 0; i < c->n_devs; i++) {
        if (c->devs[i].dev == dev) {
            return &c->devs[i];
        }
    }
    ggml_backend_buffer_type_t buft = ggml_backend_dev_buffer_type(dev);
    if (buft == NULL) {
        bs_record_error(ctx, BITSPLIT_E_UNSUPPORTED, "compensation: device %s has no buffer type (for '%s')",
                        ggml_backend_dev_name(dev), name);
        return NULL;
    }
    if (c->n_devs == COMP_DEVICES) {
        bs_record_error(ctx, BITSPLIT_E_UNSUPPORTED, "compensation: more than %d devices", COMP_DEVICES);
        return NULL;
    }
    ggml_backend_t backend = ggml_backend_dev_init(dev, NULL);
    if (backend == NULL) {
        bs_record_error(ctx, BITSPLIT_E_UNSUPPORTED, "compensation: could not start a backend on device %s (for '%s')",
                        ggml_backend_dev_name(dev), name);
        return NULL;
    }
    /* a CPU backend (the model's weights in host memory: add mode run locally) takes this library's
     * thread count instead of ggml's default */
    ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
    ggml_backend_set_n_threads_t set_threads =
        reg != NULL ? (ggml_backend_set_n_threads_t)ggml_backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads")
                    : NULL;
    if (set_threads != NULL && ctx->n_threads > 0) {
        set_threads(backend, ctx->n_threads);
    }
    comp_dev * d = &c->devs[c->n_devs++];
    memset(d, 0, sizeof(*d));
    d->dev = dev;
    d->backend = backend;
    d->buft = buft;
    d->ordered = reg != NULL && strcmp(ggml_backend_reg_name(reg), "RPC") == 0;
    return d;
}

static size_t round_up(size_t n, size_t a) {
    return (n + a - 1) / a * a;
}

/* *buf (one of d's buffers, *size its size) holding at least need bytes (its contents are not kept
 * when it grows); false after an error */
static bool grow_buffer(bitsplit_ctx * ctx, comp_dev * d, ggml_backend_buffer_t * buf, size_t * size, size_t need) {
    if (need <= *size) {
        return true;
    }
    if (*buf != NULL) {
        ggml_backend_buffer_free(*buf);
    }
    *size = 0;
    *buf = ggml_backend_buft_alloc_buffer(d->buft, need + need / 4);
    if (*buf == NULL) {
        bs_record_error(ctx, BITSPLIT_E_NOMEM, "device %s could not allocate %llu bytes for this library's graphs",
                        ggml_backend_dev_name(d->dev), (unsigned long long)(need + need / 4));
        return false;
    }
    *size = ggml_backend_buffer_get_size(*buf);
    return true;
}

/* one chunk of n_cols columns: e for each rule from x (the rules of the whole pass), the device's
 * graph over them, the results read back into out */
static bool run_chunk(bitsplit_ctx * ctx, comp_dev * d, const struct ggml_tensor * const * w, int n, const int * rule,
                      const int * first, int n_rules, const float * x, int64_t n_cols, float * const * out) {
    bs_comp * c = ctx->comp;
    const int64_t K = w[0]->ne[0];
    /* the graph: one tensor e per rule, one product per weight */
    const size_t xbytes = (size_t)n_cols * (size_t)K * sizeof(float);
    const size_t meta = ggml_tensor_overhead() * (size_t)(2 * n + 3) + ggml_graph_overhead_custom(2 * n + 2, false);
    if (!bs_ensure(&c->meta, &c->meta_size, meta) || !bs_ensure(&c->err, &c->err_size, xbytes * (size_t)n_rules)) {
        bs_record_error(ctx, BITSPLIT_E_NOMEM, "out of memory preparing the compensation of '%s'", w[0]->name);
        return false;
    }
    struct ggml_init_params ip = {.mem_size = meta, .mem_buffer = c->meta, .no_alloc = true};
    struct ggml_context * g = ggml_init(ip);
    if (g == NULL) {
        bs_record_error(ctx, BITSPLIT_E_NOMEM, "out of memory preparing the compensation of '%s'", w[0]->name);
        return false;
    }
    struct ggml_tensor * e[BS_OVERLAP_MAX] = {0}, * y[BS_OVERLAP_MAX];
    float * eh[BS_OVERLAP_MAX] = {0};
    int r = 0;
    for (int j = 0; j < n; j++) {
        y[j] = NULL;
        if (first[j] < 0) {
            continue;
        }
        if (first[j] == j) {
            e[j] = ggml_new_tensor_2d(g, GGML_TYPE_F32, K, n_cols);
            eh[j] = (float *)c->err + (size_t)r++ * (size_t)n_cols * (size_t)K;
            for (int64_t col = 0; col < n_cols; col++) {
                bs_numerics_error(rule[j], x + col * K, K, eh[j] + col * K);
            }
        }
        y[j] = ggml_mul_mat(g, (struct ggml_tensor *)w[j], e[first[j]]);
    }
    /* placed in this device's own buffer, grown when a pass needs more */
    const size_t align = ggml_backend_buft_get_alignment(d->buft);
    size_t need = 0;
    for (int j = 0; j < n; j++) {
        need += (e[j] != NULL ? round_up(ggml_backend_buft_get_alloc_size(d->buft, e[j]), align) : 0) +
                (y[j] != NULL ? round_up(ggml_backend_buft_get_alloc_size(d->buft, y[j]), align) : 0);
    }
    if (!grow_buffer(ctx, d, &d->buf, &d->size, need)) {
        ggml_free(g);
        return false;
    }
    /* the results first, one after another, so that one read brings them all back (a span over them) */
    char * const base = (char *)ggml_backend_buffer_get_base(d->buf);
    char * at = base;
    size_t yoff[BS_OVERLAP_MAX] = {0};
    int n_y = 0;
    for (int j = 0; j < n; j++) {
        if (y[j] != NULL) {
            ggml_backend_tensor_alloc(d->buf, y[j], at);
            yoff[j] = (size_t)(at - base);
            at += round_up(ggml_backend_buft_get_alloc_size(d->buft, y[j]), align);
            n_y++;
        }
    }
    const size_t span_bytes = (size_t)(at - base);
    for (int j = 0; j < n; j++) {
        if (e[j] != NULL) {
            ggml_backend_tensor_alloc(d->buf, e[j], at);
            at += round_up(ggml_backend_buft_get_alloc_size(d->buft, e[j]), align);
        }
    }
    struct ggml_tensor * span = NULL;
    if (n_y > 1) {
        span = ggml_new_tensor_1d(g, GGML_TYPE_F32, (int64_t)(span_bytes / sizeof(float)));
        ggml_backend_tensor_alloc(d->buf, span, base);
        if (!bs_ensure(&c->span, &c->span_size, span_bytes)) {
            ggml_free(g);
            bs_record_error(ctx, BITSPLIT_E_NOMEM, "out of memory reading back the compensation of '%s'", w[0]->name);
            return false;
        }
    }
    struct ggml_cgraph * gf = ggml_new_graph_custom(g, 2 * n + 2, false);
    for (int j = 0; j < n; j++) {
        if (e[j] != NULL) {
            ggml_backend_tensor_set(e[j], eh[j], 0, xbytes);
            atomic_fetch_add(&ctx->c_bdev_out, xbytes);
        }
        if (y[j] != NULL) {
            ggml_build_forward_expand(gf, y[j]);
        }
    }
    const enum ggml_status st = ggml_backend_graph_compute(d->backend, gf);
    ggml_backend_synchronize(d->backend);
    if (st != GGML_STATUS_SUCCESS) {
        ggml_free(g);
        bs_record_error(ctx, BITSPLIT_E_UNSUPPORTED, "compensation: device %s failed the product of '%s' (%s)",
                        ggml_backend_dev_name(d->dev), w[0]->name, ggml_status_to_string(st));
        return false;
    }
    if (span != NULL) { /* one read for every result */
        ggml_backend_tensor_get(span, c->span, 0, span_bytes);
        atomic_fetch_add(&ctx->c_bdev_in, span_bytes);
    }
    for (int j = 0; j < n; j++) {
        if (y[j] == NULL) {
            continue;
        }
        const size_t ybytes = (size_t)n_cols * (size_t)w[j]->ne[1] * sizeof(float);
        if (span != NULL) {
            memcpy(out[j], (const char *)c->span + yoff[j], ybytes);
        } else {
            ggml_backend_tensor_get(y[j], out[j], 0, ybytes);
            atomic_fetch_add(&ctx->c_bdev_in, ybytes);
        }
    }
    ggml_free(g);
    return true;
}

bool bs_compensate(bitsplit_ctx * ctx, const struct ggml_tensor * const * w, int n, const float * x, int64_t n_cols,
                   float * const * out) {
    if (n_cols == 0) {
        return true; /* a pass that wants no rows of this product (no logits asked for) */
    }
    if (n < 1 || n > BS_OVERLAP_MAX || n_cols < 0 || x == NULL) {
        bs_record_error(ctx, BITSPLIT_E_INVALID, "compensation: %d products of %lld columns", n, (long long)n_cols);
        return false;
    }
    if (w[0] == NULL) {
        bs_record_error(ctx, BITSPLIT_E_INVALID, "compensation: no weight");
        return false;
    }
    const uint64_t t0 = bs_now_ns();
    const int64_t K = w[0]->ne[0];
    int rule[BS_OVERLAP_MAX], first[BS_OVERLAP_MAX]; /* each product's rule, and the first product with it */
    ggml_backend_dev_t dev = device_of(ctx, w[0]);
    int n_rules = 0;
    for (int j = 0; j < n; j++) {
        const struct ggml_tensor * wj = w[j];
        if (wj == NULL || wj->buffer == NULL || device_of(ctx, wj) != dev || wj->ne[0] != K ||
            wj->ne[2] != 1 || wj->ne[3] != 1 || out[j] == NULL) {
            bs_record_error(ctx, BITSPLIT_E_UNSUPPORTED,
                            "compensation: the products of one input must be 2-D weights %lld wide in one device's buffers "
                            "('%s')", (long long)K, wj != NULL ? wj->name : "?");
            return false;
        }
        rule[j] = bs_numerics_rule(ctx->compensate, wj->type, n_cols, K);
        if (rule[j] < 0) {
            bs_record_error(ctx, BITSPLIT_E_UNSUPPORTED,
                            "compensation: no rounding rule for weight '%s' of type %s (%lld wide) in a pass of %lld rows",
                            wj->name, ggml_type_name(wj->type), (long long)K, (long long)n_cols);
            return false;
        }
        first[j] = j;
        if (rule[j] == 0) { /* a rule that rounds nothing (float weights): nothing to correct */
            memset(out[j], 0, (size_t)n_cols * (size_t)wj->ne[1] * sizeof(float));
            first[j] = -1;
            continue;
        }
        for (int k = 0; k < j; k++) {
            if (rule[k] == rule[j]) {
                first[j] = first[k];
                break;
            }
        }
        n_rules += first[j] == j;
    }
    if (n_rules == 0) {
        return true;
    }
    if (ctx->comp == NULL && (ctx->comp = calloc(1, sizeof(bs_comp))) == NULL) {
        bs_record_error(ctx, BITSPLIT_E_NOMEM, "out of memory starting compensation");
        return false;
    }
    comp_dev * d = device_for(ctx, dev, w[0]->name);
    if (d == NULL) {
        return false;
    }
    /* in chunks of columns, so that the device's buffer stays within COMP_CHUNK_BYTES (the output head's
     * results for a 512-row pass would take 300 MB of a GPU's memory at once); each column's e and result
     * are the same whatever chunk it is in */
    size_t col_bytes = (size_t)n_rules * (size_t)K * sizeof(float);
    for (int j = 0; j < n; j++) {
        col_bytes += first[j] >= 0 ? (size_t)w[j]->ne[1] * sizeof(float) : 0;
    }
    const size_t cap = chunk_bytes();
    const int64_t chunk = (int64_t)(cap / col_bytes) > 0 ? (int64_t)(cap / col_bytes) : 1;
    for (int64_t c0 = 0; c0 < n_cols; c0 += chunk) {
        const int64_t nc = n_cols - c0 < chunk ? n_cols - c0 : chunk;
        float * outs[BS_OVERLAP_MAX];
        for (int j = 0; j < n; j++) {
            outs[j] = out[j] + (size_t)c0 * (size_t)w[j]->ne[1];
        }
        if (!run_chunk(ctx, d, w, n, rule, first, n_rules, x + (size_t)c0 * (size_t)K, nc, outs)) {
            return false;
        }
    }
    int n_done = 0;
    for (int j = 0; j < n; j++) {
        n_done += first[j] >= 0;
    }
    atomic_fetch_add(&ctx->c_comp, (uint64_t)n_done);
    atomic_fetch_add(&ctx->c_ns_comp, bs_now_ns() - t0);
    return true;
}

/* e (a tensor of n_cols x K floats, not yet placed) placed at the start of d's e buffer; true where the
 * buffer already holds e for these activations: the last e placed there was made from the same x
 * (bit for bit), rule and shape, so k and v use q's, up uses gate's. Else the caller computes e, sends
 * it and then keeps x as the key of what the buffer holds (keep_e_key): not before, so that a pass that
 * fails in between leaves no key to an e never sent. On an allocation failure e stays unplaced (an
 * error recorded). */
static bool kept_e(bitsplit_ctx * ctx, comp_dev * d, struct ggml_tensor * e, const float * x, int64_t n_cols,
                   int64_t K, int rule) {
    const size_t xbytes = (size_t)n_cols * (size_t)K * sizeof(float);
    const size_t need = ggml_backend_buft_get_alloc_size(d->buft, e);
    const bool same = d->ex_cols > 0 && d->ex_cols == n_cols && d->ex_k == K && d->ex_rule == rule &&
                      d->ebuf != NULL && need <= d->esize && memcmp(d->ex, x, xbytes) == 0;
    if (!same && !grow_buffer(ctx, d, &d->ebuf, &d->esize, need)) {
        d->ex_cols = 0;
        return false;
    }
    if (ggml_backend_tensor_alloc(d->ebuf, e, ggml_backend_buffer_get_base(d->ebuf)) != GGML_STATUS_SUCCESS) {
        e->buffer = NULL;
        d->ex_cols = 0;
        bs_record_error(ctx, BITSPLIT_E_UNSUPPORTED, "device %s: cannot place the compensation's activations",
                        ggml_backend_dev_name(d->dev));
        return false;
    }
    if (!same) {
        d->ex_cols = 0; /* the buffer's e is about to be overwritten */
    }
    return same;
}

/* e made from x (n_cols x K, by rule) is now in d's e buffer */
static void keep_e_key(comp_dev * d, const float * x, int64_t n_cols, int64_t K, int rule) {
    const size_t xbytes = (size_t)n_cols * (size_t)K * sizeof(float);
    if (!bs_ensure(&d->ex, &d->ex_size, xbytes)) {
        return; /* no key kept: the next product sends its e again */
    }
    memcpy(d->ex, x, xbytes);
    d->ex_cols = n_cols;
    d->ex_k = K;
    d->ex_rule = rule;
}

/* add mode on the device (bitsplit_ctx_set_device_add): t, a product node in a device buffer holding
 * W2 . x, += delta (R . x from the host, n_cols x N) and, compensating, + W2 . e (e = x - round(x) from
 * the host's x), by a graph of the device's own that adds in place: the sum never comes to the host.
 * Per product: delta (and e) up, nothing down; on llama.cpp's RPC client no round trip at all. */
bool bs_device_add(bitsplit_ctx * ctx, struct ggml_tensor * t, const float * delta, const float * x) {
    const struct ggml_tensor * w = t->src[0];
    const int64_t n_cols = ggml_nrows(t->src[1]), K = w->ne[0], N = w->ne[1];
    if (n_cols == 0) {
        return true;
    }
    if (t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t) || t->ne[0] != N || ggml_nrows(t) != n_cols ||
        t->buffer == NULL || t->data == NULL) {
        bs_record_error(ctx, BITSPLIT_E_UNSUPPORTED, "device add: the product of '%s' has an unsupported layout",
                        w->name);
        return false;
    }
    const uint64_t t0 = bs_now_ns();
    const int rule = ctx->compensate != BITSPLIT_NUMERICS_HOST ? bs_numerics_rule(ctx->compensate, w->type, n_cols, K) : 0;
    if (rule < 0) {
        bs_record_error(ctx, BITSPLIT_E_UNSUPPORTED,
                        "compensation: no rounding rule for weight '%s' of type %s (%lld wide) in a pass of %lld rows",
                        w->name, ggml_type_name(w->type), (long long)K, (long long)n_cols);
        return false;
    }
    if (delta == NULL && rule == 0) {
        return true; /* nothing to add */
    }
    if (rule > 0 && x == NULL) {
        bs_record_error(ctx, BITSPLIT_E_INVALID, "device add: no activations to compensate '%s' with", w->name);
        return false;
    }
    if (ctx->comp == NULL && (ctx->comp = calloc(1, sizeof(bs_comp))) == NULL) {
        bs_record_error(ctx, BITSPLIT_E_NOMEM, "out of memory starting the device's add");
        return false;
    }
    bs_comp * c = ctx->comp;
    comp_dev * d = device_for(ctx, device_of(ctx, w), w->name);
    if (d == NULL) {
        return false;
    }
    const size_t col_bytes = (size_t)((delta != NULL ? N : 0) + (rule > 0 ? 2 * N + K : 0)) * sizeof(float);
    const size_t cap = chunk_bytes();
    const int64_t chunk = (int64_t)(cap / col_bytes) > 0 ? (int64_t)(cap / col_bytes) : 1;
    const size_t meta = ggml_tensor_overhead() * 8 + ggml_graph_overhead_custom(8, false);
    const size_t align = ggml_backend_buft_get_alignment(d->buft);
    if (!bs_ensure(&c->meta, &c->meta_size, meta) ||
        (rule > 0 && !bs_ensure(&c->err, &c->err_size, (size_t)(n_cols < chunk ? n_cols : chunk) * (size_t)K * sizeof(float)))) {
        bs_record_error(ctx, BITSPLIT_E_NOMEM, "out of memory preparing the device's add of '%s'", w->name);
        return false;
    }
    for (int64_t c0 = 0; c0 < n_cols; c0 += chunk) {
        const int64_t nc = n_cols - c0 < chunk ? n_cols - c0 : chunk;
        struct ggml_init_params ip = {.mem_size = meta, .mem_buffer = c->meta, .no_alloc = true};
        struct ggml_context * g = ggml_init(ip);
        if (g == NULL) {
            bs_record_error(ctx, BITSPLIT_E_NOMEM, "out of memory preparing the device's add of '%s'", w->name);
            return false;
        }
        struct ggml_tensor * dd = delta != NULL ? ggml_new_tensor_2d(g, GGML_TYPE_F32, N, nc) : NULL, * sum = dd;
        struct ggml_tensor * ee = NULL, * m = NULL;
        if (rule > 0) {
            ee = ggml_new_tensor_2d(g, GGML_TYPE_F32, K, nc);
            m = ggml_mul_mat(g, (struct ggml_tensor *)w, ee);
            sum = dd != NULL ? ggml_add(g, dd, m) : m;
        }
        /* a pass in one chunk keeps its e in the e buffer (kept_e), one in several chunks beside the rest */
        const bool whole = rule > 0 && nc == n_cols;
        bool e_sent = false; /* e already on the device: the same x, rule and shape as the last one sent */
        if (whole) {
            e_sent = kept_e(ctx, d, ee, x, n_cols, K, rule);
            if (ee->buffer == NULL) { /* the e buffer could not be had */
                ggml_free(g);
                return false;
            }
        }
        struct ggml_tensor * own[4] = {dd, whole ? NULL : ee, m, sum != dd && sum != m ? sum : NULL};
        size_t need = 0;
        for (int i = 0; i < 4; i++) {
            need += own[i] != NULL ? round_up(ggml_backend_buft_get_alloc_size(d->buft, own[i]), align) : 0;
        }
        if (!grow_buffer(ctx, d, &d->buf, &d->size, need)) {
            ggml_free(g);
            return false;
        }
        char * at = (char *)ggml_backend_buffer_get_base(d->buf);
        for (int i = 0; i < 4; i++) {
            if (own[i] != NULL) {
                ggml_backend_tensor_alloc(d->buf, own[i], at);
                at += round_up(ggml_backend_buft_get_alloc_size(d->buft, own[i]), align);
            }
        }
        /* t's columns [c0, c0 + nc), added to in place: a tensor of this graph's own over the node's memory
         * (t itself would bring the model's whole graph behind it into this one) */
        struct ggml_tensor * tv = ggml_new_tensor_2d(g, GGML_TYPE_F32, N, nc);
        struct ggml_tensor * out = ggml_add_inplace(g, tv, sum);
        if (ggml_backend_tensor_alloc(t->buffer, tv, (char *)t->data + (size_t)c0 * t->nb[1]) != GGML_STATUS_SUCCESS ||
            ggml_backend_view_init(out) != GGML_STATUS_SUCCESS) {
            ggml_free(g);
            bs_record_error(ctx, BITSPLIT_E_UNSUPPORTED, "device add: cannot view the node of '%s'", w->name);
            return false;
        }
        /* sent without waiting (llama.cpp's RPC client copies the data into its queue; a GPU's backend
         * has taken it by the synchronisation below) */
        if (dd != NULL) {
            ggml_backend_tensor_set_async(d->backend, dd, delta + (size_t)c0 * (size_t)N, 0, (size_t)nc * (size_t)N * sizeof(float));
            atomic_fetch_add(&ctx->c_bdev_out, (size_t)nc * (size_t)N * sizeof(float));
        }
        if (rule > 0 && !e_sent) {
            float * eh = (float *)c->err;
            for (int64_t col = 0; col < nc; col++) {
                bs_numerics_error(rule, x + (size_t)(c0 + col) * (size_t)K, K, eh + (size_t)col * (size_t)K);
            }
            ggml_backend_tensor_set_async(d->backend, ee, eh, 0, (size_t)nc * (size_t)K * sizeof(float));
            atomic_fetch_add(&ctx->c_bdev_out, (size_t)nc * (size_t)K * sizeof(float));
            if (whole) {
                keep_e_key(d, x, n_cols, K, rule);
            }
        }
        struct ggml_cgraph * gf = ggml_new_graph_custom(g, 8, false);
        ggml_build_forward_expand(gf, out);
        const enum ggml_status st = ggml_backend_graph_compute_async(d->backend, gf);
        if (!d->ordered) { /* done before the model's graph goes on (a GPU's: on another stream) */
            ggml_backend_synchronize(d->backend);
        }
        ggml_free(g);
        if (st != GGML_STATUS_SUCCESS) {
            d->ex_cols = 0; /* what the device holds is not known any more */
            bs_record_error(ctx, BITSPLIT_E_UNSUPPORTED, "device add: device %s failed the sum of '%s' (%s)",
                            ggml_backend_dev_name(d->dev), w->name, ggml_status_to_string(st));
            return false;
        }
    }
    if (rule > 0) {
        atomic_fetch_add(&ctx->c_comp, 1);
        atomic_fetch_add(&ctx->c_ns_comp, bs_now_ns() - t0);
    }
    atomic_fetch_add(&ctx->c_ns_xfer, bs_now_ns() - t0);
    return true;
}
