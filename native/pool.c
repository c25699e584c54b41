/*
 * Running a product on threads: the thread pool (add mode and bitsplit_ctx_matmul; inside a
 * graph, ggml's threads are used), the barrier of the threads of one product, the per-thread job
 * runner (which kernel family, which rows), the shared buffers and the counters of a product.
 */
#define _GNU_SOURCE
#include "bitsplit.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "bs_internal.h"
#include "ggml.h"

/* ---------------------------------------------------------------------------------------------
 * thread pool (add mode and bitsplit_ctx_matmul; inside a graph, ggml's threads are used)
 * ------------------------------------------------------------------------------------------- */

typedef void (*bs_task_fn)(void * arg, int ith, int nth);

struct bs_pool {
    int n;
    bs_thread * threads;
    bs_mutex lock;
    bs_cond cv_work, cv_done;
    bs_task_fn fn;
    void * arg;
    int nth;            /* threads taking part in the current generation (the caller included) */
    uint64_t generation;
    int pending;        /* workers of the current generation not done yet */
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
        bs_mutex_lock(&pool->lock);
        while (!pool->stop && pool->generation == seen) {
            bs_cond_wait(&pool->cv_work, &pool->lock);
        }
        if (pool->stop) {
            bs_mutex_unlock(&pool->lock);
            return NULL;
        }
        seen = pool->generation;
        bs_task_fn fn = pool->fn;
        void * arg = pool->arg;
        const int nth = pool->nth;
        bs_mutex_unlock(&pool->lock);
        if (ith >= nth) {
            continue; /* not needed this time: the caller does not wait for this thread */
        }
        fn(arg, ith, nth);
        bs_mutex_lock(&pool->lock);
        if (--pool->pending == 0) {
            bs_cond_signal(&pool->cv_done);
        }
        bs_mutex_unlock(&pool->lock);
    }
}

void bs_pool_free(bs_pool * pool) {
    if (pool == NULL) {
        return;
    }
    bs_mutex_lock(&pool->lock);
    pool->stop = true;
    bs_cond_broadcast(&pool->cv_work);
    bs_mutex_unlock(&pool->lock);
    for (int i = 0; i < pool->n; i++) {
        bs_thread_join(pool->threads[i]);
    }
    free(pool->threads);
    bs_mutex_destroy(&pool->lock);
    bs_cond_destroy(&pool->cv_work);
    bs_cond_destroy(&pool->cv_done);
    free(pool);
}

/* a pool of n_threads - 1 workers (the caller is thread 0) */
static bs_pool * pool_new(int n_threads) {
    bs_pool * pool = calloc(1, sizeof(*pool));
    if (pool == NULL) {
        return NULL;
    }
    bs_mutex_init(&pool->lock);
    bs_cond_init(&pool->cv_work);
    bs_cond_init(&pool->cv_done);
    pool->threads = calloc((size_t)(n_threads > 1 ? n_threads - 1 : 1), sizeof(bs_thread));
    if (pool->threads == NULL) {
        bs_pool_free(pool);
        return NULL;
    }
    for (int i = 0; i < n_threads - 1; i++) {
        bs_worker_arg * wa = malloc(sizeof(*wa));
        if (wa == NULL) {
            bs_pool_free(pool);
            return NULL;
        }
        wa->pool = pool;
        wa->ith = i + 1;
        if (bs_thread_create(&pool->threads[i], pool_worker, wa) != 0) {
            free(wa);
            bs_pool_free(pool);
            return NULL;
        }
        pool->n++;
    }
    return pool;
}

/* fn on nth threads (the caller and workers 1 .. nth-1; at most the pool's); the others stay idle */
static void pool_run(bs_pool * pool, bs_task_fn fn, void * arg, int nth) {
    if (pool == NULL || pool->n == 0 || nth <= 1) {
        fn(arg, 0, 1);
        return;
    }
    if (nth > pool->n + 1) {
        nth = pool->n + 1;
    }
    bs_mutex_lock(&pool->lock);
    pool->fn = fn;
    pool->arg = arg;
    pool->nth = nth;
    pool->pending = nth - 1;
    pool->generation++;
    bs_cond_broadcast(&pool->cv_work);
    bs_mutex_unlock(&pool->lock);
    fn(arg, 0, nth);
    bs_mutex_lock(&pool->lock);
    while (pool->pending > 0) {
        bs_cond_wait(&pool->cv_done, &pool->lock);
    }
    bs_mutex_unlock(&pool->lock);
}

/* ---------------------------------------------------------------------------------------------
 * running a product on nth threads
 * ------------------------------------------------------------------------------------------- */

/* pause instructions a barrier's waiter spins before it yields between polls: some tens of microseconds */
#define BS_BARRIER_SPINS 2000

void bs_barrier(bitsplit_ctx * ctx, int nth) {
    if (nth <= 1) {
        return;
    }
    const int gen = atomic_load_explicit(&ctx->bar_gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&ctx->bar_count, 1, memory_order_acq_rel) == nth - 1) {
        atomic_store_explicit(&ctx->bar_count, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&ctx->bar_gen, 1, memory_order_acq_rel);
    } else {
        /* spin a while (the wait is usually the other threads' last few rows of activations),
         * then give the core away between polls: with more runnable threads than cores (a busy
         * desktop, a test suite beside a benchmark) a waiter that only spins holds the core the
         * last thread needs for the rest of its time slice (measured: 57% of samples in here) */
        int spins = 0;
        while (atomic_load_explicit(&ctx->bar_gen, memory_order_acquire) == gen) {
            if (spins >= BS_BARRIER_SPINS) {
                bs_yield();
                continue;
            }
            spins++;
#if defined(__x86_64__)
            __builtin_ia32_pause();
#elif defined(__aarch64__)
            __asm__ volatile("yield");
#endif
        }
    }
}

/* Which family computes a product: the fast drafter's (base alone) by the draft policy; a
 * prompt's passes (unless BITSPLIT_KERNEL pins for all) by the kernel policy's for a full prompt
 * batch; a decode pass by the family pinned for this generation; anything else by the kernel
 * policy (kernels.c), the one place that knows the thresholds. */
const bs_kernel_family * bs_family_for(const bitsplit_ctx * ctx, const bs_job * job) {
    if (job->draft) { /* the fast drafter: ask_draft took it for this family */
        const bs_kernel_family * f = bs_draft_policy(job);
        return f != NULL ? f : bs_generic_family();
    }
    if (ctx->prompt && !ctx->pin_all) {
        /* a prompt: one family for all its passes whatever their size (a prompt is cut into
         * batches, and a cached prefix moves the cuts), so that a prompt token's value never depends
         * on the cut: the policy's for a full prompt batch */
        return bs_policy(BS_PROMPT_COLS, false, job);
    }
    if (ctx->pinned != NULL && (ctx->pin_all || ctx->invariant || job->n_cols <= BS_DECODE_COLS)) {
        if (ctx->pinned->supports(job)) {
            return ctx->pinned;
        }
        /* a product the pinned family does not compute (a weight without residual on the tile
         * families, a Q4_0 base on vnni-int24): a family as precise (exact weights), and with
         * batch invariance one choice for every batch size */
        return bs_precise_policy(ctx->invariant ? 1 : job->n_cols, job);
    }
    return bs_policy(job->n_cols, false, job);
}

int bs_resolve_precision(const bitsplit_ctx * ctx, enum ggml_type base, enum ggml_type res) {
    if (ctx->precision != BITSPLIT_PREC_AUTO) {
        return ctx->precision;
    }
    const bool flt = base == GGML_TYPE_F32 || base == GGML_TYPE_F16 || base == GGML_TYPE_BF16 ||
                     res == GGML_TYPE_F32 || res == GGML_TYPE_F16;
    return flt ? BITSPLIT_PREC_F32 : BITSPLIT_PREC_BF16;
}

bool bs_resolve_act8(const bitsplit_ctx * ctx, enum ggml_type res) {
    if (ctx->act_bits != BITSPLIT_ACTS_AUTO) {
        return ctx->act_bits == BITSPLIT_ACTS_8;
    }
    /* measured where it pays: AVX2-only (a 2-core Zen 4 with llama.cpp built for AVX2), the
     * Qwen2.5-Coder-1.5B q6_k split 1.03-1.29x faster end to end (median 1.14) at 0.53x / 0.94x
     * stock Q8_0's KL on code / English (README); with a q8_0 residual its 0.5x gate is not kept
     * (0.48x in a trial); with AVX-512 the verifier is ~1.0x stock Q8_0 already at 0.05x its KL */
    return res == GGML_TYPE_Q6_K && bs_act8_auto_here();
}

/* bytes of shared buffer a job needs, and the per-thread scratch it will ask for */
size_t bs_job_acts_size(const bitsplit_ctx * ctx, const bs_job * job) {
    return bs_family_for(ctx, job)->acts_size(job);
}

/* The work of thread ith of nth on one product. job->acts must hold bs_job_acts_size bytes. */
void bs_run_job(bitsplit_ctx * ctx, const bs_job * job, int ith, int nth) {
    const bs_kernel_family * fam = bs_family_for(ctx, job);
    const int n_called = nth; /* every calling thread takes part in the barrier */
    if (nth > BS_MAX_THREADS) {
        nth = BS_MAX_THREADS; /* threads beyond the limit compute nothing */
    }
    const bool active = ith < nth;
    if (fam->acts_size(job) > 0) {
        if (active) {
            const int64_t c0 = job->n_cols * ith / nth, c1 = job->n_cols * (ith + 1) / nth;
            fam->prepare_acts(job, c0, c1);
        }
        bs_barrier(ctx, n_called);
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
        bs_scratch * s = &ctx->scratch[ith];
        s->failed = 0;
        fam->rows(job, r0, r1, s);
        if (s->failed != 0) {
            /* the family could not allocate its scratch and left these rows: NaN, never stale
             * values, and an error for the caller (bitsplit_ctx_take_error, bs_run_on_pool) */
            for (int64_t c = 0; c < job->n_cols; c++) {
                for (int64_t r = r0; r < r1; r++) job->y[c * job->ldy + r] = NAN;
            }
            bs_record_error(ctx, BITSPLIT_E_NOMEM,
                            "out of memory: kernel family %s could not allocate %llu bytes of scratch for a product "
                            "of %lld x %lld on %lld columns", fam->name, (unsigned long long)s->failed, (long long)job->N,
                            (long long)job->K, (long long)job->n_cols);
            atomic_store(&ctx->job_failed, true);
        }
    }
}

void bs_count_job(bitsplit_ctx * ctx, const bs_job * job, uint64_t t0, bool add) {
    atomic_fetch_add(add ? &ctx->c_add : &ctx->c_products, 1);
    atomic_fetch_add(&ctx->c_cols, (uint64_t)job->n_cols);
    atomic_fetch_add(&ctx->c_bres, (uint64_t)job->N * job->r_row_bytes);
    if (job->w2 != NULL) {
        atomic_fetch_add(&ctx->c_bbase, (uint64_t)job->N * job->w2_row_bytes);
    }
    atomic_fetch_add(&ctx->c_ns, bs_now_ns() - t0);
}

void bs_fill_job(bs_job * job, const bs_entry * e, const uint8_t * w2, int64_t row0, int64_t N) {
    memset(job, 0, sizeof(*job));
    job->w2 = w2;
    job->r = e->res_data != NULL ? e->res_data + (size_t)row0 * e->res_row_bytes : NULL;
    job->w2_type = e->base_type;
    job->r_type = e->res_type;
    job->w2_row_bytes = e->base_row_bytes;
    job->r_row_bytes = e->res_row_bytes;
    job->K = e->ne[0];
    job->N = N;
}

void bs_job_columns(bs_job * job, const bitsplit_ctx * ctx, const float * x, int64_t n_cols, float * y) {
    job->x = x;
    job->ldx = job->K;
    job->n_cols = n_cols;
    job->y = y;
    job->ldy = job->N;
    job->precision = bs_resolve_precision(ctx, job->w2_type, job->r != NULL ? job->r_type : job->w2_type);
    job->act8 = job->r != NULL && bs_resolve_act8(ctx, job->r_type);
}

bool bs_ensure(void ** buf, size_t * cap, size_t need) {
    if (*cap >= need) {
        return true;
    }
    size_t want = (need + 4095) & ~(size_t)4095;
    void * p = bs_aligned_alloc(64, want);
    if (p == NULL) {
        return false;
    }
    bs_aligned_free(*buf);
    *buf = p;
    *cap = want;
    return true;
}

typedef struct {
    bitsplit_ctx * ctx;
    const bs_job * job;
} pool_job_arg;

static void pool_job_fn(void * p, int ith, int nth) {
    pool_job_arg * a = p;
    bs_run_job(a->ctx, a->job, ith, nth);
}

/* How many of the pool's threads a product is worth. A product runs as fast as its slowest
 * thread: one that must first be woken, or that the OS has put behind another process, costs tens
 * of microseconds to milliseconds, so each thread gets at least BS_THREAD_MIN_BYTES of work
 * (weight bytes, counted up to 4x as the columns grow). Rows are independent, so the result does
 * not depend on the count. BITSPLIT_THREAD_MIN_KB overrides the default (0: every thread; read
 * when a residual is loaded, a bad value refused there). */
bool bs_thread_min_bytes(int64_t * out) {
    const char * env = getenv("BITSPLIT_THREAD_MIN_KB");
    *out = BS_THREAD_MIN_BYTES;
    if (env == NULL || env[0] == '\0') {
        return true;
    }
    char * end = NULL;
    const long long kb = strtoll(env, &end, 10);
    if (end == env || *end != '\0' || kb < 0 || kb >= (1LL << 40)) {
        return false;
    }
    *out = (int64_t)kb * 1024;
    return true;
}

int bs_threads_for(const bitsplit_ctx * ctx, const bs_job * job) {
    return bs_threads_for_min(ctx, job, ctx->thread_min_bytes);
}

int bs_threads_for_min(const bitsplit_ctx * ctx, const bs_job * job, int64_t min_bytes) {
    if (min_bytes <= 0 || ctx->n_threads <= 1) {
        return ctx->n_threads;
    }
    int64_t bytes = job->N * (int64_t)(job->r != NULL ? job->r_row_bytes : 0) +
                    job->N * (int64_t)(job->w2 != NULL ? job->w2_row_bytes : 0);
    const int64_t cols = job->n_cols < 1 ? 1 : job->n_cols;
    bytes += bytes * (cols < 13 ? cols - 1 : 12) / 4; /* x1 at one column .. x4 from 13 */
    const int64_t n = bytes / min_bytes;
    return n < 1 ? 1 : n > ctx->n_threads ? ctx->n_threads : (int)n;
}

int bs_run_on_pool(bitsplit_ctx * ctx, bs_job * job) {
    const int nth = bs_threads_for(ctx, job);
    if (ctx->pool == NULL && nth > 1) {
        ctx->pool = pool_new(ctx->n_threads);
    }
    if (!bs_ensure(&ctx->acts, &ctx->acts_size, bs_job_acts_size(ctx, job) + 64)) {
        return BITSPLIT_E_NOMEM;
    }
    job->acts = ctx->acts;
    pool_job_arg a = {ctx, job};
    atomic_store(&ctx->job_failed, false);
    pool_run(ctx->pool, pool_job_fn, &a, nth);
    return atomic_load(&ctx->job_failed) ? BITSPLIT_E_NOMEM : BITSPLIT_OK;
}
