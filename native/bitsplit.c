/*
 * bitsplit: residual tensors in host memory and the llama.cpp eval callback that applies them.
 * See bitsplit.h for the contract. Internals:
 *
 * - Loading maps residual.gguf and base.gguf read-only (no copy) and checks every residual tensor
 *   against the base's header before anything is read: names, shapes, types, and that each
 *   tensor's bytes lie inside its file.
 * - The callback is asked (ask=true) about every graph node before it is computed. For a weight
 *   product of the base that has a residual and lives in host memory, it turns the node into a
 *   ggml custom op whose function computes (W2 + R) . x (ggml then runs it on its own thread pool,
 *   with no extra synchronisation); the original op is kept in the node's op_params and restored
 *   the next time the node is seen with the callback disabled (llama.cpp reuses graphs). A node in
 *   a device buffer is observed instead (ask returns true) and corrected afterwards (add mode).
 */
#define _GNU_SOURCE
#include "bitsplit.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bs_internal.h"
#include "ggml-backend.h"
#include "ggml.h"
#include "gguf.h"

/* ggml-impl.h's struct ggml_custom_op_params (private to ggml; checked at load, see
 * custom_layout_ok) */
struct bs_custom_params {
    ggml_custom_op_t fun;
    int n_tasks;
    void * userdata;
};

#define BS_MAGIC 0x4c505342 /* "BSPL": marks a node this library turned into a custom op */
#define BS_STASH_MAGIC 8    /* op_params[8]: magic, [9]: original op, bytes 40..63: original params */
#define BS_STASH_OP 9
#define BS_STASH_BYTES 40

typedef struct bs_pool bs_pool;

struct bitsplit_ctx {
    int fd_res, fd_base;
    void * map_res;
    size_t map_res_size;
    void * map_base;
    size_t map_base_size;

    bs_entry * entries;
    int64_t n_entries;
    int64_t * table; /* open addressing: name hash -> entry index, -1 empty */
    int64_t table_size;

    atomic_bool enabled;
    atomic_bool draft_fast;
    int precision;
    int mode;
    bool replace_ok; /* custom-op layout check passed */
    /* A family pinned for decode passes (<= BS_DECODE_COLS columns) by bitsplit_ctx_set_kernel /
     * choose_kernel, so that every pass of a generation runs the same arithmetic; with pin_all
     * (BITSPLIT_KERNEL) it serves every batch. NULL: the kernel policy decides per product. */
    const bs_kernel_family * pinned;
    bool pin_all;

    /* shared by the threads of one product (nodes run one after another) */
    void * acts;
    size_t acts_size;
    void * gather; /* MUL_MAT_ID: gathered columns and results */
    size_t gather_size;
    bs_scratch scratch[BS_MAX_THREADS];
    atomic_int bar_count;
    atomic_int bar_gen;

    /* add mode and bitsplit_ctx_matmul */
    int n_threads;
    bs_pool * pool;
    bs_scratch host_x, host_y, host_d;

    /* counters (updated by thread 0 of a product) */
    atomic_uint_fast64_t c_products, c_add, c_rows, c_cols, c_bres, c_bbase, c_ns, c_err, c_draft, c_ns_draft;

    pthread_mutex_t err_lock;
    int err_status;
    char err_msg[512];
};

const char * bitsplit_status_str(int status) {
    switch (status) {
        case BITSPLIT_OK: return "ok";
        case BITSPLIT_E_IO: return "I/O error";
        case BITSPLIT_E_FORMAT: return "malformed file";
        case BITSPLIT_E_MISMATCH: return "residual does not match the base";
        case BITSPLIT_E_UNSUPPORTED: return "unsupported tensor type or shape";
        case BITSPLIT_E_NOMEM: return "out of memory";
        case BITSPLIT_E_INVALID: return "invalid argument";
        case BITSPLIT_E_STATE: return "error during graph evaluation";
        default: return "unknown status";
    }
}

static int fail(char * err, size_t n, int status, const char * fmt, ...) {
    if (err != NULL && n > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, n, fmt, ap);
        va_end(ap);
    }
    return status;
}

static void record_error(bitsplit_ctx * ctx, int status, const char * fmt, ...) {
    atomic_fetch_add(&ctx->c_err, 1);
    pthread_mutex_lock(&ctx->err_lock);
    if (ctx->err_status == BITSPLIT_OK) {
        ctx->err_status = status;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(ctx->err_msg, sizeof(ctx->err_msg), fmt, ap);
        va_end(ap);
    }
    pthread_mutex_unlock(&ctx->err_lock);
}

/* ---------------------------------------------------------------------------------------------
 * name table
 * ------------------------------------------------------------------------------------------- */

static uint64_t hash_name(const char * s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) {
        h = (h ^ (uint8_t)*s) * 1099511628211ull;
    }
    return h;
}

static const bs_entry * find_entry(const bitsplit_ctx * ctx, const char * name) {
    if (ctx->table_size == 0) {
        return NULL;
    }
    uint64_t i = hash_name(name) & (uint64_t)(ctx->table_size - 1);
    for (;;) {
        int64_t idx = ctx->table[i];
        if (idx < 0) {
            return NULL;
        }
        if (strncmp(ctx->entries[idx].name, name, GGML_MAX_NAME) == 0) {
            return &ctx->entries[idx];
        }
        i = (i + 1) & (uint64_t)(ctx->table_size - 1);
    }
}

/* ---------------------------------------------------------------------------------------------
 * loading
 * ------------------------------------------------------------------------------------------- */

static int map_file(const char * path, int * fd_out, void ** map_out, size_t * size_out, char * err, size_t n) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        return fail(err, n, BITSPLIT_E_IO, "%s: cannot open: %s", path, strerror(errno));
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return fail(err, n, BITSPLIT_E_IO, "%s: not a regular file", path);
    }
    if (st.st_size <= 0) {
        close(fd);
        return fail(err, n, BITSPLIT_E_FORMAT, "%s: empty file", path);
    }
    void * map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) {
        close(fd);
        return fail(err, n, BITSPLIT_E_IO, "%s: cannot map: %s", path, strerror(errno));
    }
    *fd_out = fd;
    *map_out = map;
    *size_out = (size_t)st.st_size;
    return BITSPLIT_OK;
}

static bool residual_type_ok(enum ggml_type t) {
    return t == GGML_TYPE_Q6_K || t == GGML_TYPE_Q8_0 || t == GGML_TYPE_F16 || t == GGML_TYPE_F32;
}

/* nbytes of a tensor of this type and shape, or 0 on a bad shape / overflow */
static size_t tensor_bytes(enum ggml_type type, const int64_t ne[4]) {
    const int64_t blck = ggml_blck_size(type);
    const size_t ts = ggml_type_size(type);
    if (blck <= 0 || ts == 0) {
        return 0;
    }
    for (int d = 0; d < 4; d++) {
        if (ne[d] <= 0 || ne[d] > ((int64_t)1 << 40)) {
            return 0;
        }
    }
    if (ne[0] % blck != 0) {
        return 0;
    }
    const int64_t rows = ne[1] * ne[2] * ne[3];
    if (rows <= 0 || rows > ((int64_t)1 << 40)) {
        return 0;
    }
    const size_t row = (size_t)(ne[0] / blck) * ts;
    if (row != 0 && (size_t)rows > SIZE_MAX / row) {
        return 0;
    }
    return row * (size_t)rows;
}

static bool custom_layout_ok(void);

int bitsplit_ctx_load(const char * residual_path, const char * base_path, bitsplit_ctx ** out, char * err,
                      size_t err_size) {
    if (out == NULL || residual_path == NULL || base_path == NULL) {
        return fail(err, err_size, BITSPLIT_E_INVALID, "bitsplit_ctx_load: NULL argument");
    }
    *out = NULL;
    bitsplit_ctx * ctx = calloc(1, sizeof(*ctx));
    if (ctx == NULL) {
        return fail(err, err_size, BITSPLIT_E_NOMEM, "out of memory");
    }
    ctx->fd_res = ctx->fd_base = -1;
    pthread_mutex_init(&ctx->err_lock, NULL);
    ctx->n_threads = 1;

    struct ggml_context * meta_res = NULL;
    struct ggml_context * meta_base = NULL;
    struct gguf_context * g_res = NULL;
    struct gguf_context * g_base = NULL;
    int st = map_file(residual_path, &ctx->fd_res, &ctx->map_res, &ctx->map_res_size, err, err_size);
    if (st != BITSPLIT_OK) {
        goto fail;
    }
    st = map_file(base_path, &ctx->fd_base, &ctx->map_base, &ctx->map_base_size, err, err_size);
    if (st != BITSPLIT_OK) {
        goto fail;
    }
    if (ctx->map_res_size < 8 || memcmp(ctx->map_res, "GGUF", 4) != 0) {
        st = fail(err, err_size, BITSPLIT_E_FORMAT, "%s: not a GGUF file", residual_path);
        goto fail;
    }
    if (ctx->map_base_size < 8 || memcmp(ctx->map_base, "GGUF", 4) != 0) {
        st = fail(err, err_size, BITSPLIT_E_FORMAT, "%s: not a GGUF file", base_path);
        goto fail;
    }
    struct gguf_init_params p_res = {.no_alloc = true, .ctx = &meta_res};
    g_res = gguf_init_from_buffer(ctx->map_res, ctx->map_res_size, p_res);
    if (g_res == NULL) {
        st = fail(err, err_size, BITSPLIT_E_FORMAT, "%s: malformed GGUF (ggml's reader refused it)", residual_path);
        goto fail;
    }
    struct gguf_init_params p_base = {.no_alloc = true, .ctx = &meta_base};
    g_base = gguf_init_from_buffer(ctx->map_base, ctx->map_base_size, p_base);
    if (g_base == NULL) {
        st = fail(err, err_size, BITSPLIT_E_FORMAT, "%s: malformed GGUF (ggml's reader refused it)", base_path);
        goto fail;
    }
    const int64_t kv = gguf_find_key(g_res, "bitsplit.format_version");
    if (kv < 0 || gguf_get_kv_type(g_res, kv) != GGUF_TYPE_UINT32 || gguf_get_val_u32(g_res, kv) != 1) {
        st = fail(err, err_size, BITSPLIT_E_FORMAT, "%s: not a bitsplit residual (format version 1 expected)",
                  residual_path);
        goto fail;
    }

    const int64_t n = gguf_get_n_tensors(g_res);
    if (n < 0 || n > (1 << 20)) {
        st = fail(err, err_size, BITSPLIT_E_FORMAT, "%s: absurd tensor count %lld", residual_path, (long long)n);
        goto fail;
    }
    ctx->n_entries = n;
    ctx->entries = calloc((size_t)(n > 0 ? n : 1), sizeof(bs_entry));
    ctx->table_size = 16;
    while (ctx->table_size < 2 * n + 2) {
        ctx->table_size *= 2;
    }
    ctx->table = malloc((size_t)ctx->table_size * sizeof(int64_t));
    if (ctx->entries == NULL || ctx->table == NULL) {
        st = fail(err, err_size, BITSPLIT_E_NOMEM, "out of memory");
        goto fail;
    }
    for (int64_t i = 0; i < ctx->table_size; i++) {
        ctx->table[i] = -1;
    }
    const size_t res_data0 = gguf_get_data_offset(g_res);
    const size_t base_data0 = gguf_get_data_offset(g_base);
    for (int64_t i = 0; i < n; i++) {
        const char * name = gguf_get_tensor_name(g_res, i);
        bs_entry * e = &ctx->entries[i];
        if (name == NULL || strlen(name) >= GGML_MAX_NAME) {
            st = fail(err, err_size, BITSPLIT_E_FORMAT, "%s: tensor #%lld has no usable name", residual_path, (long long)i);
            goto fail;
        }
        snprintf(e->name, sizeof(e->name), "%s", name);
        e->ctx = ctx;
        const struct ggml_tensor * tr = ggml_get_tensor(meta_res, name);
        const int64_t bi = gguf_find_tensor(g_base, name);
        if (bi < 0) {
            st = fail(err, err_size, BITSPLIT_E_MISMATCH, "%s: tensor '%s' has no weight of that name in the base %s",
                      residual_path, name, base_path);
            goto fail;
        }
        const struct ggml_tensor * tb = ggml_get_tensor(meta_base, name);
        if (tr == NULL || tb == NULL) {
            st = fail(err, err_size, BITSPLIT_E_FORMAT, "%s: tensor '%s' missing from ggml's view of the file",
                      residual_path, name);
            goto fail;
        }
        for (int d = 0; d < 4; d++) {
            if (tr->ne[d] != tb->ne[d]) {
                st = fail(err, err_size, BITSPLIT_E_MISMATCH,
                          "%s: tensor '%s' is %lldx%lldx%lldx%lld but the base has %lldx%lldx%lldx%lld", residual_path,
                          name, (long long)tr->ne[0], (long long)tr->ne[1], (long long)tr->ne[2], (long long)tr->ne[3],
                          (long long)tb->ne[0], (long long)tb->ne[1], (long long)tb->ne[2], (long long)tb->ne[3]);
                goto fail;
            }
            e->ne[d] = tr->ne[d];
        }
        e->res_type = tr->type;
        e->base_type = tb->type;
        if (!residual_type_ok(e->res_type)) {
            st = fail(err, err_size, BITSPLIT_E_UNSUPPORTED, "%s: tensor '%s' has type %s; residuals must be Q6_K, Q8_0, F16 or F32",
                      residual_path, name, ggml_type_name(e->res_type));
            goto fail;
        }
        if (!bs_type_readable(e->base_type)) {
            st = fail(err, err_size, BITSPLIT_E_UNSUPPORTED, "%s: base tensor '%s' has type %s, which this library cannot read",
                      base_path, name, ggml_type_name(e->base_type));
            goto fail;
        }
        const size_t rb = tensor_bytes(e->res_type, e->ne);
        const size_t bb = tensor_bytes(e->base_type, e->ne);
        if (rb == 0 || bb == 0) {
            st = fail(err, err_size, BITSPLIT_E_FORMAT, "%s: tensor '%s' has an invalid shape for its type", residual_path, name);
            goto fail;
        }
        const size_t ro = res_data0 + gguf_get_tensor_offset(g_res, i);
        const size_t bo = base_data0 + gguf_get_tensor_offset(g_base, bi);
        if (ro < res_data0 || ro > ctx->map_res_size || rb > ctx->map_res_size - ro) {
            st = fail(err, err_size, BITSPLIT_E_FORMAT, "%s: truncated: tensor '%s' extends past the end of the file",
                      residual_path, name);
            goto fail;
        }
        if (bo < base_data0 || bo > ctx->map_base_size || bb > ctx->map_base_size - bo) {
            st = fail(err, err_size, BITSPLIT_E_FORMAT, "%s: truncated: tensor '%s' extends past the end of the file",
                      base_path, name);
            goto fail;
        }
        e->n_rows = e->ne[1] * e->ne[2] * e->ne[3];
        e->res_row_bytes = ggml_row_size(e->res_type, e->ne[0]);
        e->base_row_bytes = ggml_row_size(e->base_type, e->ne[0]);
        e->res_data = (const uint8_t *)ctx->map_res + ro;
        e->base_data = (const uint8_t *)ctx->map_base + bo;
        uint64_t h = hash_name(name) & (uint64_t)(ctx->table_size - 1);
        while (ctx->table[h] >= 0) {
            if (strcmp(ctx->entries[ctx->table[h]].name, name) == 0) {
                st = fail(err, err_size, BITSPLIT_E_FORMAT, "%s: duplicate tensor '%s'", residual_path, name);
                goto fail;
            }
            h = (h + 1) & (uint64_t)(ctx->table_size - 1);
        }
        ctx->table[h] = i;
    }
    gguf_free(g_res);
    gguf_free(g_base);
    ggml_free(meta_res);
    ggml_free(meta_base);
    g_res = g_base = NULL;
    meta_res = meta_base = NULL;
    ctx->replace_ok = custom_layout_ok();
    {
        int cap;
        if (!bs_isa_cap(&cap)) {
            st = fail(err, err_size, BITSPLIT_E_INVALID, "BITSPLIT_MAX_ISA='%s': expected generic, avx2, neon, "
                      "avx512 or amx", getenv("BITSPLIT_MAX_ISA"));
            goto fail;
        }
        const char * env = getenv("BITSPLIT_KERNEL");
        if (env != NULL && env[0] != '\0') {
            ctx->pinned = bs_family_named(env);
            ctx->pin_all = true;
            if (ctx->pinned == NULL) {
                st = fail(err, err_size, BITSPLIT_E_UNSUPPORTED, "BITSPLIT_KERNEL='%s': no such kernel family on "
                          "this CPU under BITSPLIT_MAX_ISA=%s (this CPU's best for one column: %s)", env,
                          bs_isa_name(cap), bs_policy(1, NULL)->name);
                goto fail;
            }
        }
    }
    atomic_store(&ctx->enabled, false);
    *out = ctx;
    return BITSPLIT_OK;

fail:
    if (g_res) gguf_free(g_res);
    if (g_base) gguf_free(g_base);
    if (meta_res) ggml_free(meta_res);
    if (meta_base) ggml_free(meta_base);
    bitsplit_ctx_free(ctx);
    return st;
}

/* ---------------------------------------------------------------------------------------------
 * thread pool (add mode and bitsplit_ctx_matmul; inside a graph, ggml's threads are used)
 * ------------------------------------------------------------------------------------------- */

typedef void (*bs_task_fn)(void * arg, int ith, int nth);

struct bs_pool {
    int n;
    pthread_t * threads;
    pthread_mutex_t lock;
    pthread_cond_t cv_work, cv_done;
    bs_task_fn fn;
    void * arg;
    uint64_t generation;
    int pending;
    bool stop;
};

typedef struct {
    bs_pool * pool;
    int ith;
} bs_worker_arg;

static void * pool_worker(void * p) {
    bs_worker_arg * wa = p;
    bs_pool * pool = wa->pool;
    const int ith = wa->ith;
    free(wa);
    uint64_t seen = 0;
    for (;;) {
        pthread_mutex_lock(&pool->lock);
        while (!pool->stop && pool->generation == seen) {
            pthread_cond_wait(&pool->cv_work, &pool->lock);
        }
        if (pool->stop) {
            pthread_mutex_unlock(&pool->lock);
            return NULL;
        }
        seen = pool->generation;
        bs_task_fn fn = pool->fn;
        void * arg = pool->arg;
        pthread_mutex_unlock(&pool->lock);
        fn(arg, ith, pool->n + 1);
        pthread_mutex_lock(&pool->lock);
        if (--pool->pending == 0) {
            pthread_cond_signal(&pool->cv_done);
        }
        pthread_mutex_unlock(&pool->lock);
    }
}

static void pool_free(bs_pool * pool) {
    if (pool == NULL) {
        return;
    }
    pthread_mutex_lock(&pool->lock);
    pool->stop = true;
    pthread_cond_broadcast(&pool->cv_work);
    pthread_mutex_unlock(&pool->lock);
    for (int i = 0; i < pool->n; i++) {
        pthread_join(pool->threads[i], NULL);
    }
    free(pool->threads);
    pthread_mutex_destroy(&pool->lock);
    pthread_cond_destroy(&pool->cv_work);
    pthread_cond_destroy(&pool->cv_done);
    free(pool);
}

/* a pool of n_threads - 1 workers (the caller is thread 0) */
static bs_pool * pool_new(int n_threads) {
    bs_pool * pool = calloc(1, sizeof(*pool));
    if (pool == NULL) {
        return NULL;
    }
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->cv_work, NULL);
    pthread_cond_init(&pool->cv_done, NULL);
    pool->threads = calloc((size_t)(n_threads > 1 ? n_threads - 1 : 1), sizeof(pthread_t));
    if (pool->threads == NULL) {
        pool_free(pool);
        return NULL;
    }
    for (int i = 0; i < n_threads - 1; i++) {
        bs_worker_arg * wa = malloc(sizeof(*wa));
        if (wa == NULL) {
            pool_free(pool);
            return NULL;
        }
        wa->pool = pool;
        wa->ith = i + 1;
        if (pthread_create(&pool->threads[i], NULL, pool_worker, wa) != 0) {
            free(wa);
            pool_free(pool);
            return NULL;
        }
        pool->n++;
    }
    return pool;
}

static void pool_run(bs_pool * pool, bs_task_fn fn, void * arg) {
    if (pool == NULL || pool->n == 0) {
        fn(arg, 0, 1);
        return;
    }
    pthread_mutex_lock(&pool->lock);
    pool->fn = fn;
    pool->arg = arg;
    pool->pending = pool->n;
    pool->generation++;
    pthread_cond_broadcast(&pool->cv_work);
    pthread_mutex_unlock(&pool->lock);
    fn(arg, 0, pool->n + 1);
    pthread_mutex_lock(&pool->lock);
    while (pool->pending > 0) {
        pthread_cond_wait(&pool->cv_done, &pool->lock);
    }
    pthread_mutex_unlock(&pool->lock);
}

/* ---------------------------------------------------------------------------------------------
 * running a product on nth threads
 * ------------------------------------------------------------------------------------------- */

static void barrier(bitsplit_ctx * ctx, int nth) {
    if (nth <= 1) {
        return;
    }
    const int gen = atomic_load_explicit(&ctx->bar_gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&ctx->bar_count, 1, memory_order_acq_rel) == nth - 1) {
        atomic_store_explicit(&ctx->bar_count, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&ctx->bar_gen, 1, memory_order_acq_rel);
    } else {
        while (atomic_load_explicit(&ctx->bar_gen, memory_order_acquire) == gen) {
#if defined(__x86_64__)
            __builtin_ia32_pause();
#elif defined(__aarch64__)
            __asm__ volatile("yield");
#endif
        }
    }
}

/* Which family computes a product: the fast drafter's (base alone) by the draft policy; a
 * decode pass by the family pinned for this generation; anything else by the kernel policy
 * (kernels.c), the one place that knows the thresholds. */
static const bs_kernel_family * family_for(const bitsplit_ctx * ctx, const bs_job * job) {
    if (job->r == NULL && job->w2 != NULL) { /* the fast drafter: ask_draft took it for this family */
        const bs_kernel_family * f = bs_draft_policy(job);
        return f != NULL ? f : bs_generic_family();
    }
    if (ctx->pinned != NULL && (ctx->pin_all || job->n_cols <= BS_DECODE_COLS) && ctx->pinned->supports(job)) {
        return ctx->pinned;
    }
    return bs_policy(job->n_cols, job);
}

static int resolve_precision(const bitsplit_ctx * ctx, enum ggml_type base, enum ggml_type res) {
    if (ctx->precision != BITSPLIT_PREC_AUTO) {
        return ctx->precision;
    }
    const bool flt = base == GGML_TYPE_F32 || base == GGML_TYPE_F16 || base == GGML_TYPE_BF16 ||
                     res == GGML_TYPE_F32 || res == GGML_TYPE_F16;
    return flt ? BITSPLIT_PREC_F32 : BITSPLIT_PREC_BF16;
}

/* bytes of shared buffer a job needs, and the per-thread scratch it will ask for */
static size_t job_acts_size(const bitsplit_ctx * ctx, const bs_job * job) {
    return family_for(ctx, job)->acts_size(job);
}

/* The work of thread ith of nth on one product. job->acts must hold job_acts_size bytes. */
static void run_job(bitsplit_ctx * ctx, const bs_job * job, int ith, int nth) {
    const bs_kernel_family * fam = family_for(ctx, job);
    if (nth > BS_MAX_THREADS) {
        nth = BS_MAX_THREADS; /* threads beyond the limit only take part in the barrier */
    }
    const bool active = ith < nth;
    if (fam->acts_size(job) > 0) {
        if (active) {
            const int64_t c0 = job->n_cols * ith / nth, c1 = job->n_cols * (ith + 1) / nth;
            fam->prepare_acts(job, c0, c1);
        }
        barrier(ctx, nth);
    }
    if (!active) {
        return;
    }
    const int64_t nb = (job->N + BS_ROW_BLOCK - 1) / BS_ROW_BLOCK;
    const int64_t b0 = nb * ith / nth, b1 = nb * (ith + 1) / nth;
    const int64_t r0 = b0 * BS_ROW_BLOCK;
    int64_t r1 = b1 * BS_ROW_BLOCK;
    if (r1 > job->N) {
        r1 = job->N;
    }
    if (r0 < r1) {
        fam->rows(job, r0, r1, &ctx->scratch[ith]);
    }
}

static void count_job(bitsplit_ctx * ctx, const bs_job * job, uint64_t t0, bool add) {
    atomic_fetch_add(add ? &ctx->c_add : &ctx->c_products, 1);
    atomic_fetch_add(&ctx->c_cols, (uint64_t)job->n_cols);
    atomic_fetch_add(&ctx->c_bres, (uint64_t)job->N * job->r_row_bytes);
    if (job->w2 != NULL) {
        atomic_fetch_add(&ctx->c_bbase, (uint64_t)job->N * job->w2_row_bytes);
    }
    atomic_fetch_add(&ctx->c_ns, bs_now_ns() - t0);
}

static void fill_job(bs_job * job, const bs_entry * e, const uint8_t * w2, int64_t row0, int64_t N) {
    memset(job, 0, sizeof(*job));
    job->w2 = w2;
    job->r = e->res_data + (size_t)row0 * e->res_row_bytes;
    job->w2_type = e->base_type;
    job->r_type = e->res_type;
    job->w2_row_bytes = e->base_row_bytes;
    job->r_row_bytes = e->res_row_bytes;
    job->K = e->ne[0];
    job->N = N;
}

/* ---------------------------------------------------------------------------------------------
 * custom ops (replace mode: ggml's CPU threads call these with ith/nth)
 * ------------------------------------------------------------------------------------------- */

static const uint8_t * base_rows(const bs_entry * e, const struct ggml_tensor * w) {
    /* llama.cpp's own copy when it is plain host memory in ggml's layout (mmap of the same file:
     * shared pages); otherwise (repacked or device weights) this library's map of base.gguf */
    if (w->data != NULL && w->buffer != NULL && ggml_backend_buffer_is_host(w->buffer) && w->extra == NULL) {
        return (const uint8_t *)w->data;
    }
    return e->base_data;
}

/* (W2 + R) . x, or W2 . x alone for the fast drafter (the residual is off) */
static void mul_mat(struct ggml_tensor * dst, int ith, int nth, const bs_entry * e, bool base_only) {
    bitsplit_ctx * ctx = e->ctx;
    const struct ggml_tensor * w = dst->src[0];
    const struct ggml_tensor * x = dst->src[1];
    const uint64_t t0 = ith == 0 ? bs_now_ns() : 0;
    bs_job job;
    fill_job(&job, e, base_rows(e, w), 0, e->ne[1]);
    if (base_only) {
        job.r = NULL;
    }
    job.x = (const float *)x->data;
    job.ldx = e->ne[0];
    job.n_cols = ggml_nrows(x);
    job.y = (float *)dst->data;
    job.ldy = e->ne[1];
    job.precision = resolve_precision(ctx, e->base_type, base_only ? e->base_type : e->res_type);
    job.acts = ctx->acts;
    run_job(ctx, &job, ith, nth);
    if (ith != 0) {
        return;
    }
    if (base_only) {
        atomic_fetch_add(&ctx->c_draft, 1);
        atomic_fetch_add(&ctx->c_ns_draft, bs_now_ns() - t0);
    } else {
        count_job(ctx, &job, t0, false);
    }
}

static void op_mul_mat(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    mul_mat(dst, ith, nth, userdata, false);
}

static void op_mul_mat_base(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    mul_mat(dst, ith, nth, userdata, true);
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
    if (nth > BS_MAX_THREADS) {
        nth = BS_MAX_THREADS;
        if (ith >= nth) {
            return;
        }
    }
    float * tmp = bs_scratch_get(&ctx->scratch[ith], (size_t)K * sizeof(float));
    if (tmp == NULL) {
        record_error(ctx, BITSPLIT_E_NOMEM, "out of memory in the embedding lookup of '%s'", e->name);
        return;
    }
    for (int64_t i = n * ith / nth; i < n * (ith + 1) / nth; i++) {
        float * out = (float *)((char *)dst->data + i * dst->nb[1]);
        const int64_t row = id[i];
        if (row < 0 || row >= e->n_rows) {
            record_error(ctx, BITSPLIT_E_INVALID, "token id %lld out of range for '%s' (%lld rows)", (long long)row,
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
        barrier(ctx, nth); /* list written */
        for (int64_t j = (int64_t)m * ith / nth; j < (int64_t)m * (ith + 1) / nth; j++) {
            const int64_t t = list[j] / n_used, i = list[j] % n_used;
            const float * src = (const float *)((const char *)x->data + (i % x->ne[1]) * x->nb[1] + t * x->nb[2]);
            memcpy(xg + (size_t)j * K, src, (size_t)K * sizeof(float));
        }
        barrier(ctx, nth); /* columns gathered */
        bs_job job;
        fill_job(&job, e, w2all + (size_t)(ex * N) * e->base_row_bytes, ex * N, N);
        job.x = xg;
        job.ldx = K;
        job.n_cols = m;
        job.y = yg;
        job.ldy = N;
        job.precision = resolve_precision(ctx, e->base_type, e->res_type);
        job.acts = ctx->acts;
        run_job(ctx, &job, ith, nth);
        barrier(ctx, nth); /* results complete */
        for (int64_t j = (int64_t)m * ith / nth; j < (int64_t)m * (ith + 1) / nth; j++) {
            const int64_t t = list[j] / n_used, i = list[j] % n_used;
            memcpy((char *)dst->data + i * dst->nb[1] + t * dst->nb[2], yg + (size_t)j * N, (size_t)N * sizeof(float));
        }
        barrier(ctx, nth); /* list and buffers free for the next expert */
    }
    if (ith == 0) {
        atomic_fetch_add(&ctx->c_products, 1);
        atomic_fetch_add(&ctx->c_cols, (uint64_t)n_pairs);
        atomic_fetch_add(&ctx->c_ns, bs_now_ns() - t0);
    }
}

/* ggml keeps struct ggml_custom_op_params private: check our copy against a real custom node */
static void dummy_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void)dst;
    (void)ith;
    (void)nth;
    (void)userdata;
}

static bool custom_layout_ok(void) {
    static int cached = -1;
    if (cached >= 0) {
        return cached == 1;
    }
    struct ggml_init_params ip = {.mem_size = 16 * 1024, .mem_buffer = NULL, .no_alloc = true};
    struct ggml_context * g = ggml_init(ip);
    bool ok = false;
    if (g != NULL) {
        struct ggml_tensor * a = ggml_new_tensor_1d(g, GGML_TYPE_F32, 4);
        struct ggml_tensor * args[1] = {a};
        void * marker = (void *)(uintptr_t)0x5eed5eedu;
        struct ggml_tensor * t = ggml_custom_4d(g, GGML_TYPE_F32, 4, 1, 1, 1, args, 1, dummy_op, 7, marker);
        struct bs_custom_params p;
        memcpy(&p, t->op_params, sizeof(p));
        ok = t->op == GGML_OP_CUSTOM && p.fun == dummy_op && p.n_tasks == 7 && p.userdata == marker &&
             t->src[0] == a;
        ggml_free(g);
    }
    cached = ok ? 1 : 0;
    return ok;
}

static bool is_ours(const struct ggml_tensor * t) {
    return t->op == GGML_OP_CUSTOM && t->op_params[BS_STASH_MAGIC] == BS_MAGIC;
}

static void mutate(struct ggml_tensor * t, ggml_custom_op_t fn, const bs_entry * e) {
    char * raw = (char *)t->op_params;
    memcpy(raw + BS_STASH_BYTES, raw, sizeof(struct bs_custom_params));
    t->op_params[BS_STASH_OP] = (int32_t)t->op;
    t->op_params[BS_STASH_MAGIC] = BS_MAGIC;
    struct bs_custom_params p = {fn, GGML_N_TASKS_MAX, (void *)e};
    memcpy(raw, &p, sizeof(p));
    t->op = GGML_OP_CUSTOM;
}

static void restore(struct ggml_tensor * t) {
    char * raw = (char *)t->op_params;
    const int32_t op = t->op_params[BS_STASH_OP];
    memcpy(raw, raw + BS_STASH_BYTES, sizeof(struct bs_custom_params));
    memset(raw + BS_STASH_MAGIC * 4, 0, GGML_MAX_OP_PARAMS - BS_STASH_MAGIC * 4);
    t->op = (enum ggml_op)op;
}

/* ---------------------------------------------------------------------------------------------
 * the callback
 * ------------------------------------------------------------------------------------------- */

static bool host(const struct ggml_tensor * t) {
    return t->buffer != NULL && ggml_backend_buffer_is_host(t->buffer) && t->data != NULL;
}

/* The residual entry for the weight of node t, after checking the graph's weight against it. */
static const bs_entry * entry_for(bitsplit_ctx * ctx, const struct ggml_tensor * t) {
    const struct ggml_tensor * w = t->src[0];
    if (w == NULL || w->name[0] == '\0') {
        return NULL;
    }
    const bs_entry * e = find_entry(ctx, w->name);
    if (e == NULL) {
        return NULL;
    }
    if (w->type != e->base_type || w->ne[0] != e->ne[0] || w->ne[1] != e->ne[1] || w->ne[2] != e->ne[2] ||
        w->ne[3] != e->ne[3]) {
        record_error(ctx, BITSPLIT_E_MISMATCH,
                     "weight '%s' in the graph is %s %lldx%lldx%lld but the residual was made for %s %lldx%lldx%lld",
                     w->name, ggml_type_name(w->type), (long long)w->ne[0], (long long)w->ne[1], (long long)w->ne[2],
                     ggml_type_name(e->base_type), (long long)e->ne[0], (long long)e->ne[1], (long long)e->ne[2]);
        return NULL;
    }
    return e;
}

static bool ensure(void ** buf, size_t * cap, size_t need) {
    if (*cap >= need) {
        return true;
    }
    void * p = NULL;
    size_t want = (need + 4095) & ~(size_t)4095;
    if (posix_memalign(&p, 64, want) != 0) {
        return false;
    }
    free(*buf);
    *buf = p;
    *cap = want;
    return true;
}

static bool plain_f32_matrix(const struct ggml_tensor * t) {
    return t->type == GGML_TYPE_F32 && ggml_is_contiguous(t);
}

/* ask == true for a hooked node: decide replace (mutate, return false) or add (return true) */
static bool ask_node(bitsplit_ctx * ctx, struct ggml_tensor * t) {
    const enum ggml_op op = t->op;
    const bs_entry * e = entry_for(ctx, t);
    if (e == NULL) {
        return false;
    }
    const struct ggml_tensor * x = t->src[1];
    const bool cpu = host(t) && x != NULL && host(x);
    if (op == GGML_OP_GET_ROWS) {
        if (!cpu || ctx->mode == BITSPLIT_MODE_ADD || x->type != GGML_TYPE_I32 || !ggml_is_contiguous(x) ||
            t->type != GGML_TYPE_F32 || t->ne[0] != e->ne[0] || e->ne[2] != 1 || e->ne[3] != 1 || !ctx->replace_ok) {
            return true; /* add mode: observe, correct after the node is computed */
        }
        mutate(t, op_get_rows, e);
        return false;
    }
    if (op == GGML_OP_MUL_MAT) {
        const bool shapes = e->ne[2] == 1 && e->ne[3] == 1 && plain_f32_matrix(x) && plain_f32_matrix(t) &&
                            x->ne[0] == e->ne[0] && t->ne[0] == e->ne[1];
        if (cpu && shapes && ctx->replace_ok && ctx->mode != BITSPLIT_MODE_ADD) {
            bs_job job;
            fill_job(&job, e, NULL, 0, e->ne[1]);
            job.w2 = e->base_data;
            job.n_cols = ggml_nrows(x);
            job.precision = resolve_precision(ctx, e->base_type, e->res_type);
            if (!ensure(&ctx->acts, &ctx->acts_size, job_acts_size(ctx, &job) + 64)) {
                record_error(ctx, BITSPLIT_E_NOMEM, "out of memory preparing the product of '%s'", e->name);
                return false;
            }
            mutate(t, op_mul_mat, e);
            return false;
        }
        return true; /* add mode: observe, correct after the node is computed */
    }
    if (op == GGML_OP_MUL_MAT_ID) {
        const struct ggml_tensor * ids = t->src[2];
        if (cpu && ids != NULL && host(ids) && ids->type == GGML_TYPE_I32 && x->type == GGML_TYPE_F32 &&
            t->type == GGML_TYPE_F32 && x->ne[0] == e->ne[0] && t->ne[0] == e->ne[1] && ctx->replace_ok &&
            x->nb[0] == sizeof(float) && t->nb[0] == sizeof(float) && e->ne[3] == 1) {
            const int64_t pairs = ids->ne[0] * ids->ne[1];
            bs_job job;
            fill_job(&job, e, e->base_data, 0, e->ne[1]);
            job.n_cols = pairs;
            job.precision = resolve_precision(ctx, e->base_type, e->res_type);
            const size_t g = (size_t)pairs * (sizeof(int64_t) + (size_t)(e->ne[0] + e->ne[1]) * sizeof(float));
            if (!ensure(&ctx->acts, &ctx->acts_size, job_acts_size(ctx, &job) + 64) ||
                !ensure(&ctx->gather, &ctx->gather_size, g + 64)) {
                record_error(ctx, BITSPLIT_E_NOMEM, "out of memory preparing the experts of '%s'", e->name);
                return false;
            }
            mutate(t, op_mul_mat_id, e);
            return false;
        }
        record_error(ctx, BITSPLIT_E_UNSUPPORTED, "expert weights '%s' outside host memory are not supported yet",
                     e->name);
        return false;
    }
    return false;
}

/* ask == true with the residual off and the fast drafter on: base products of CPU nodes here */
static bool ask_draft(bitsplit_ctx * ctx, struct ggml_tensor * t) {
    const bs_entry * e = entry_for(ctx, t);
    const struct ggml_tensor * x = t->src[1];
    if (e == NULL || x == NULL || !host(t) || !host(x) || !ctx->replace_ok || e->ne[2] != 1 || e->ne[3] != 1 ||
        !plain_f32_matrix(x) || !plain_f32_matrix(t) || x->ne[0] != e->ne[0] || t->ne[0] != e->ne[1]) {
        return false;
    }
    bs_job job;
    fill_job(&job, e, e->base_data, 0, e->ne[1]);
    job.r = NULL;
    job.n_cols = ggml_nrows(x);
    job.precision = resolve_precision(ctx, e->base_type, e->base_type);
    if (bs_draft_policy(&job) == NULL) {
        return false; /* ggml's own kernel is as fast or faster here */
    }
    if (!ensure(&ctx->acts, &ctx->acts_size, job_acts_size(ctx, &job) + 64)) {
        return false; /* out of memory: ggml's own kernel will do */
    }
    mutate(t, op_mul_mat_base, e);
    return false;
}

typedef struct {
    bitsplit_ctx * ctx;
    const bs_job * job;
} pool_job_arg;

static void pool_job_fn(void * p, int ith, int nth) {
    pool_job_arg * a = p;
    run_job(a->ctx, a->job, ith, nth);
}

static int run_on_pool(bitsplit_ctx * ctx, bs_job * job) {
    if (ctx->pool == NULL && ctx->n_threads > 1) {
        ctx->pool = pool_new(ctx->n_threads);
    }
    if (!ensure(&ctx->acts, &ctx->acts_size, job_acts_size(ctx, job) + 64)) {
        return BITSPLIT_E_NOMEM;
    }
    job->acts = ctx->acts;
    pool_job_arg a = {ctx, job};
    pool_run(ctx->pool, pool_job_fn, &a);
    return BITSPLIT_OK;
}

/* ask == false for an observed node: add R . x (the node holds W2 . x, possibly on a device) */
static bool add_residual(bitsplit_ctx * ctx, struct ggml_tensor * t) {
    const bs_entry * e = entry_for(ctx, t);
    if (e == NULL) {
        return true;
    }
    const uint64_t t0 = bs_now_ns();
    const struct ggml_tensor * x = t->src[1];
    if (t->op == GGML_OP_GET_ROWS) {
        if (x->type != GGML_TYPE_I32 || !ggml_is_contiguous(x) || t->type != GGML_TYPE_F32 || !ggml_is_contiguous(t)) {
            record_error(ctx, BITSPLIT_E_UNSUPPORTED, "embedding lookup of '%s' has an unsupported layout", e->name);
            return true;
        }
        const int64_t n = ggml_nelements(x), K = e->ne[0];
        int32_t * ids = bs_scratch_get(&ctx->host_x, (size_t)n * sizeof(int32_t));
        float * rows = bs_scratch_get(&ctx->host_y, (size_t)(n * K) * sizeof(float));
        float * tmp = bs_scratch_get(&ctx->host_d, (size_t)(n * K) * sizeof(float));
        if (ids == NULL || rows == NULL || tmp == NULL) {
            record_error(ctx, BITSPLIT_E_NOMEM, "out of memory correcting '%s'", e->name);
            return true;
        }
        ggml_backend_tensor_get(x, ids, 0, (size_t)n * sizeof(int32_t));
        ggml_backend_tensor_get(t, rows, 0, (size_t)(n * K) * sizeof(float));
        for (int64_t i = 0; i < n; i++) {
            if (ids[i] < 0 || ids[i] >= e->n_rows) {
                record_error(ctx, BITSPLIT_E_INVALID, "token id %d out of range for '%s'", ids[i], e->name);
                return true;
            }
            bs_dequant_row(e->res_type, e->res_data + (size_t)ids[i] * e->res_row_bytes, tmp + i * K, K);
            for (int64_t k = 0; k < K; k++) {
                rows[i * K + k] += tmp[i * K + k];
            }
        }
        ggml_backend_tensor_set(t, rows, 0, (size_t)(n * K) * sizeof(float));
        atomic_fetch_add(&ctx->c_rows, 1);
        return true;
    }
    if (t->op != GGML_OP_MUL_MAT || !plain_f32_matrix(x) || !plain_f32_matrix(t) || e->ne[2] != 1 ||
        x->ne[0] != e->ne[0] || t->ne[0] != e->ne[1]) {
        record_error(ctx, BITSPLIT_E_UNSUPPORTED, "product with '%s' has an unsupported layout for add mode", e->name);
        return true;
    }
    const int64_t n_cols = ggml_nrows(x), K = e->ne[0], N = e->ne[1];
    const float * xs = NULL;
    float * ys = NULL;
    float * delta = bs_scratch_get(&ctx->host_d, (size_t)(n_cols * N) * sizeof(float));
    if (host(x)) {
        xs = x->data;
    } else {
        float * buf = bs_scratch_get(&ctx->host_x, (size_t)(n_cols * K) * sizeof(float));
        if (buf != NULL) {
            ggml_backend_tensor_get(x, buf, 0, (size_t)(n_cols * K) * sizeof(float));
        }
        xs = buf;
    }
    if (host(t)) {
        ys = t->data;
    } else {
        ys = bs_scratch_get(&ctx->host_y, (size_t)(n_cols * N) * sizeof(float));
    }
    if (xs == NULL || ys == NULL || delta == NULL) {
        record_error(ctx, BITSPLIT_E_NOMEM, "out of memory correcting '%s'", e->name);
        return true;
    }
    bs_job job;
    fill_job(&job, e, NULL, 0, N);
    job.x = xs;
    job.ldx = K;
    job.n_cols = n_cols;
    job.y = delta;
    job.ldy = N;
    job.precision = resolve_precision(ctx, e->base_type, e->res_type);
    if (run_on_pool(ctx, &job) != BITSPLIT_OK) {
        record_error(ctx, BITSPLIT_E_NOMEM, "out of memory correcting '%s'", e->name);
        return true;
    }
    if (!host(t)) {
        ggml_backend_tensor_get(t, ys, 0, (size_t)(n_cols * N) * sizeof(float));
    }
    for (int64_t i = 0; i < n_cols * N; i++) {
        ys[i] += delta[i];
    }
    if (!host(t)) {
        ggml_backend_tensor_set(t, ys, 0, (size_t)(n_cols * N) * sizeof(float));
    }
    count_job(ctx, &job, t0, true);
    return true;
}

bool bitsplit_eval_callback(struct ggml_tensor * t, bool ask, void * user_data) {
    bitsplit_ctx * ctx = user_data;
    if (ctx == NULL || t == NULL) {
        return ask ? false : true;
    }
    if (ask) {
        if (is_ours(t)) {
            /* a graph reused from an earlier pass still carries our op: give the node back its own,
             * then decide afresh (the callback may have been switched off since) */
            restore(t);
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
        return false;
    }
    /* returning false would abort the graph: always continue */
    if (atomic_load_explicit(&ctx->enabled, memory_order_relaxed) && !is_ours(t)) {
        add_residual(ctx, t);
    }
    return true;
}

/* ---------------------------------------------------------------------------------------------
 * the rest of the API
 * ------------------------------------------------------------------------------------------- */

void bitsplit_ctx_free(bitsplit_ctx * ctx) {
    if (ctx == NULL) {
        return;
    }
    pool_free(ctx->pool);
    for (int i = 0; i < BS_MAX_THREADS; i++) {
        free(ctx->scratch[i].buf);
    }
    free(ctx->host_x.buf);
    free(ctx->host_y.buf);
    free(ctx->host_d.buf);
    free(ctx->acts);
    free(ctx->gather);
    free(ctx->entries);
    free(ctx->table);
    if (ctx->map_res != NULL && ctx->map_res != MAP_FAILED) munmap(ctx->map_res, ctx->map_res_size);
    if (ctx->map_base != NULL && ctx->map_base != MAP_FAILED) munmap(ctx->map_base, ctx->map_base_size);
    if (ctx->fd_res >= 0) close(ctx->fd_res);
    if (ctx->fd_base >= 0) close(ctx->fd_base);
    pthread_mutex_destroy(&ctx->err_lock);
    free(ctx);
}

int64_t bitsplit_ctx_n_tensors(const bitsplit_ctx * ctx) { return ctx ? ctx->n_entries : 0; }

int bitsplit_ctx_tensor_info(const bitsplit_ctx * ctx, int64_t i, const char ** name, int64_t ne[4], int * base_type,
                             int * res_type) {
    if (ctx == NULL || i < 0 || i >= ctx->n_entries) {
        return BITSPLIT_E_INVALID;
    }
    const bs_entry * e = &ctx->entries[i];
    if (name) *name = e->name;
    if (ne) memcpy(ne, e->ne, sizeof(e->ne));
    if (base_type) *base_type = e->base_type;
    if (res_type) *res_type = e->res_type;
    return BITSPLIT_OK;
}

void bitsplit_ctx_set_enabled(bitsplit_ctx * ctx, bool enabled) {
    if (ctx) atomic_store(&ctx->enabled, enabled);
}

void bitsplit_ctx_set_draft_kernel(bitsplit_ctx * ctx, bool on) {
    if (ctx) atomic_store(&ctx->draft_fast, on);
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

int bitsplit_ctx_set_mode(bitsplit_ctx * ctx, int mode) {
    if (ctx == NULL || (mode != BITSPLIT_MODE_AUTO && mode != BITSPLIT_MODE_ADD)) {
        return BITSPLIT_E_INVALID;
    }
    ctx->mode = mode;
    return BITSPLIT_OK;
}

int bitsplit_ctx_set_threads(bitsplit_ctx * ctx, int n_threads) {
    if (ctx == NULL || n_threads < 1 || n_threads > BS_MAX_THREADS) {
        return BITSPLIT_E_INVALID;
    }
    if (n_threads != ctx->n_threads) {
        pool_free(ctx->pool);
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
    out->ns_inside = atomic_load(&ctx->c_ns);
    out->n_errors = atomic_load(&ctx->c_err);
    out->n_draft_products = atomic_load(&ctx->c_draft);
    out->ns_draft = atomic_load(&ctx->c_ns_draft);
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
    atomic_store(&ctx->c_ns, 0);
    atomic_store(&ctx->c_err, 0);
    atomic_store(&ctx->c_draft, 0);
    atomic_store(&ctx->c_ns_draft, 0);
}

int bitsplit_ctx_take_error(bitsplit_ctx * ctx, char * buf, size_t buf_size) {
    if (ctx == NULL) {
        return BITSPLIT_E_INVALID;
    }
    pthread_mutex_lock(&ctx->err_lock);
    const int st = ctx->err_status;
    if (buf != NULL && buf_size > 0) {
        snprintf(buf, buf_size, "%s", st == BITSPLIT_OK ? "" : ctx->err_msg);
    }
    ctx->err_status = BITSPLIT_OK;
    ctx->err_msg[0] = '\0';
    pthread_mutex_unlock(&ctx->err_lock);
    return st;
}

int bitsplit_ctx_matmul(bitsplit_ctx * ctx, const char * name, const float * x, int64_t n_cols, float * y,
                        bool with_base) {
    if (ctx == NULL || name == NULL || x == NULL || y == NULL || n_cols < 0) {
        return BITSPLIT_E_INVALID;
    }
    const bs_entry * e = find_entry(ctx, name);
    if (e == NULL || e->ne[2] != 1 || e->ne[3] != 1) {
        return BITSPLIT_E_INVALID;
    }
    const uint64_t t0 = bs_now_ns();
    bs_job job;
    fill_job(&job, e, with_base ? e->base_data : NULL, 0, e->ne[1]);
    job.x = x;
    job.ldx = e->ne[0];
    job.n_cols = n_cols;
    job.y = y;
    job.ldy = e->ne[1];
    job.precision = resolve_precision(ctx, e->base_type, e->res_type);
    const int st = run_on_pool(ctx, &job);
    if (st == BITSPLIT_OK) {
        count_job(ctx, &job, t0, !with_base);
    }
    return st;
}

const char * bitsplit_kernel_name(void) {
    const char * env = getenv("BITSPLIT_KERNEL");
    const bs_kernel_family * f = env != NULL && env[0] != '\0' ? bs_family_named(env) : NULL;
    return f != NULL ? f->name : bs_policy(1, NULL)->name;
}

const char * bitsplit_kernel_for_batch(int64_t n_cols) {
    const char * env = getenv("BITSPLIT_KERNEL");
    const bs_kernel_family * f = env != NULL && env[0] != '\0' ? bs_family_named(env) : NULL;
    return f != NULL ? f->name : bs_policy(n_cols < 1 ? 1 : n_cols, NULL)->name;
}

const char * bitsplit_draft_kernel(void) {
    const bs_kernel_family * f = bs_draft_policy(NULL);
    return f != NULL ? f->name : "";
}

int bitsplit_draft_min_cols(void) {
    const bs_kernel_family * f = bs_draft_policy(NULL);
    return f != NULL ? f->draft_min_cols : 0;
}

const char * bitsplit_max_isa(void) {
    int cap;
    bs_isa_cap(&cap);
    return bs_isa_name(cap);
}

int bitsplit_kernel_families(const char ** names, int max) {
    const bs_kernel_family * list[BS_MAX_FAMILIES];
    const int n = bs_policy_list(1, NULL, list, BS_MAX_FAMILIES);
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

const char * bitsplit_ctx_choose_kernel(bitsplit_ctx * ctx, int64_t n_cols) {
    if (ctx == NULL) {
        return "";
    }
    if (!ctx->pin_all) {
        ctx->pinned = bs_policy(n_cols < 1 ? 1 : n_cols, NULL);
    }
    return ctx->pinned->name;
}

const char * bitsplit_ctx_kernel(const bitsplit_ctx * ctx) {
    if (ctx == NULL) {
        return "";
    }
    return ctx->pinned != NULL ? ctx->pinned->name : bs_policy(1, NULL)->name;
}
