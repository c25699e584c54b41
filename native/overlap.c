/*
 * Add mode, side by side: R . x on the host while the device computes W2 . x.
 *
 * ggml's scheduler asks the eval callback about each node before computing it and calls it again
 * after computing the ones it asked for (it synchronises the device there). In add mode the graph
 * computes W2 . x on the device, and the callback adds R . x afterwards: one after the other. Here,
 * the first pass learns which graph nodes are the input x of residual products (by node name:
 * "attn_norm-3" feeds layer 3's Q, K and V). On later passes the callback asks for such a node
 * itself, so the scheduler stops right after computing it; x is copied to the host and a runner
 * thread computes R . x for each of its products, in graph order, on this library's pool, while the
 * device goes on with W2 . x. When the device's product node completes, the callback waits for that
 * product's R . x (if still running), adds it, and writes the sum back.
 *
 * With the overlap at products (BITSPLIT_OVERLAP_PRODUCTS) the graph does not stop at the inputs:
 * the batch starts at the stop of an input's first product, after the device's W2 . x for it, so
 * the later products of that input (k and v after q, up after gate) still run beside the device's.
 *
 * Every use is checked: the product's input must be the very node the batch was started from, with
 * the same number of columns; otherwise the product is computed after the fact as before. The
 * runner shares the pool, the activation buffer, the scratch and the barrier with every other use
 * of them, so those wait for it first (bs_overlap_drain).
 */
#define _GNU_SOURCE
#include "bitsplit.h"

#include <stdlib.h>
#include <string.h>

#include "bs_internal.h"
#include "ggml-backend.h"
#include "ggml.h"

#define FEED_SLOTS 2048 /* open addressing over node names; a graph has ~4 feeds per layer */
#define FEED_MAX BS_OVERLAP_MAX

typedef struct {
    char name[GGML_MAX_NAME];
    const bs_entry * e[FEED_MAX];
    const struct ggml_tensor * w[FEED_MAX]; /* the graph's weight of each (the model's, as last seen) */
    int n;
} feed;

struct bs_overlap {
    feed * feeds;
    int n_feeds;

    bs_thread thread;
    bool started;
    bs_mutex lock;
    bs_cond cv_work, cv_done;
    bool stop;
    uint64_t generation; /* bumped per batch */
    int n_jobs, n_done;  /* the current batch: jobs submitted, jobs finished */

    /* the current batch (written by the graph's thread while the runner is idle) */
    const struct ggml_tensor * x;
    int64_t n_cols;
    bs_job jobs[FEED_MAX];
    uint64_t ns[FEED_MAX]; /* time each job took on the runner */
    const bs_entry * e[FEED_MAX];
    bool taken[FEED_MAX];
    void * xbuf;
    size_t xcap;
    void * ybuf;
    size_t ycap;
    /* compensation (compensate.c): the device's W2 . e for each job, computed at the start */
    void * cbuf;
    size_t ccap;
    bool comp_ok;
    bool dev_sum; /* the batch's sums made on the device: no W2 . e here */
};

static feed * find_feed(bs_overlap * ov, const char * name, bool insert) {
    if (ov == NULL || ov->feeds == NULL || name[0] == '\0' || strlen(name) >= GGML_MAX_NAME) {
        return NULL;
    }
    for (uint64_t i = bs_hash_name(name) % FEED_SLOTS, k = 0; k < FEED_SLOTS; i = (i + 1) % FEED_SLOTS, k++) {
        feed * f = &ov->feeds[i];
        if (f->name[0] == '\0') {
            if (!insert || ov->n_feeds >= FEED_SLOTS / 2) {
                return NULL;
            }
            strcpy(f->name, name);
            ov->n_feeds++;
            return f;
        }
        if (strcmp(f->name, name) == 0) {
            return f;
        }
    }
    return NULL;
}

static void * runner(void * p) {
    bitsplit_ctx * ctx = p;
    bs_overlap * ov = ctx->ov;
    bs_mutex_lock(&ov->lock);
    for (;;) {
        while (!ov->stop && ov->n_done == ov->n_jobs) {
            bs_cond_wait(&ov->cv_work, &ov->lock);
        }
        if (ov->stop) {
            break;
        }
        const int i = ov->n_done;
        bs_mutex_unlock(&ov->lock);
        const uint64_t t0 = bs_now_ns();
        if (bs_run_on_pool(ctx, &ov->jobs[i]) != BITSPLIT_OK) {
            ov->jobs[i].y = NULL; /* out of memory: the product is computed after the fact */
        }
        ov->ns[i] = bs_now_ns() - t0;
        bs_mutex_lock(&ov->lock);
        ov->n_done++;
        bs_cond_broadcast(&ov->cv_done);
    }
    bs_mutex_unlock(&ov->lock);
    return NULL;
}

bool bs_overlap_enable(bitsplit_ctx * ctx, bool on) {
    if (!on) {
        bs_overlap_drain(ctx);
        ctx->overlap = false;
        return true;
    }
    if (ctx->ov == NULL) {
        bs_overlap * ov = calloc(1, sizeof(*ov));
        if (ov == NULL || (ov->feeds = calloc(FEED_SLOTS, sizeof(feed))) == NULL) {
            free(ov);
            return false;
        }
        bs_mutex_init(&ov->lock);
        bs_cond_init(&ov->cv_work);
        bs_cond_init(&ov->cv_done);
        ctx->ov = ov;
    }
    ctx->overlap = true;
    return true;
}

void bs_overlap_free(bitsplit_ctx * ctx) {
    bs_overlap * ov = ctx->ov;
    if (ov == NULL) {
        return;
    }
    if (ov->started) {
        bs_mutex_lock(&ov->lock);
        ov->stop = true;
        bs_cond_broadcast(&ov->cv_work);
        bs_mutex_unlock(&ov->lock);
        bs_thread_join(ov->thread);
    }
    bs_mutex_destroy(&ov->lock);
    bs_cond_destroy(&ov->cv_work);
    bs_cond_destroy(&ov->cv_done);
    free(ov->feeds);
    bs_aligned_free(ov->xbuf);
    bs_aligned_free(ov->ybuf);
    bs_aligned_free(ov->cbuf);
    free(ov);
    ctx->ov = NULL;
}

void bs_overlap_drain(bitsplit_ctx * ctx) {
    bs_overlap * ov = ctx->ov;
    if (ov == NULL || !ov->started) {
        return;
    }
    bs_mutex_lock(&ov->lock);
    while (ov->n_done < ov->n_jobs) {
        bs_cond_wait(&ov->cv_done, &ov->lock);
    }
    ov->x = NULL; /* whatever was not used is dropped */
    bs_mutex_unlock(&ov->lock);
}

void bs_overlap_learn(bitsplit_ctx * ctx, const struct ggml_tensor * x, const bs_entry * e,
                      const struct ggml_tensor * w) {
    if (!ctx->overlap) {
        return;
    }
    feed * f = find_feed(ctx->ov, x->name, true);
    if (f == NULL) {
        return;
    }
    for (int i = 0; i < f->n; i++) {
        if (f->e[i] == e) {
            f->w[i] = w;
            return;
        }
    }
    if (f->n < FEED_MAX) {
        f->w[f->n] = w;
        f->e[f->n++] = e;
    }
}

bool bs_overlap_is_feed(const bitsplit_ctx * ctx, const struct ggml_tensor * t) {
    return ctx->overlap && !ctx->overlap_at_products && ctx->ov->n_feeds > 0 &&
           find_feed(ctx->ov, t->name, false) != NULL;
}

void bs_overlap_start(bitsplit_ctx * ctx, const struct ggml_tensor * x) {
    bs_overlap * ov = ctx->ov;
    bs_overlap_drain(ctx); /* the last batch is done with, used or not */
    const feed * f = ctx->overlap ? find_feed(ov, x->name, false) : NULL;
    if (f == NULL || f->n == 0 || x->type != GGML_TYPE_F32 || !ggml_is_contiguous(x) || x->data == NULL) {
        return;
    }
    const int64_t K = x->ne[0], n_cols = ggml_nrows(x);
    size_t ysize = 0;
    for (int i = 0; i < f->n; i++) {
        if (f->e[i]->ne[0] != K || f->e[i]->ne[2] != 1 || f->e[i]->ne[3] != 1) {
            return; /* not what this node's products take */
        }
        ysize += (size_t)(n_cols * f->e[i]->ne[1]) * sizeof(float);
    }
    if (!ov->started) {
        if (bs_thread_create(&ov->thread, runner, ctx) != 0) {
            return;
        }
        ov->started = true;
    }
    const size_t xsize = (size_t)(n_cols * K) * sizeof(float);
    if (!bs_ensure(&ov->xbuf, &ov->xcap, xsize) || !bs_ensure(&ov->ybuf, &ov->ycap, ysize)) {
        return;
    }
    const uint64_t t0 = bs_now_ns();
    ggml_backend_tensor_get(x, ov->xbuf, 0, xsize);
    if (!bs_host_tensor(x)) {
        atomic_fetch_add(&ctx->c_bdev_in, xsize);
    }
    atomic_fetch_add(&ctx->c_ns_xfer, bs_now_ns() - t0);
    float * y = ov->ybuf;
    for (int i = 0; i < f->n; i++) {
        const bs_entry * e = f->e[i];
        bs_job * job = &ov->jobs[i];
        bs_fill_job(job, e, NULL, 0, e->ne[1]);
        bs_job_columns(job, ctx, ov->xbuf, n_cols, y);
        ov->e[i] = e;
        ov->taken[i] = false;
        y += n_cols * e->ne[1];
    }
    bs_mutex_lock(&ov->lock);
    ov->x = x;
    ov->n_cols = n_cols;
    ov->n_done = 0;
    ov->n_jobs = f->n;
    ov->generation++;
    ov->comp_ok = false;
    bs_cond_broadcast(&ov->cv_work);
    bs_mutex_unlock(&ov->lock);
    /* the sum made on the device (bitsplit_ctx_set_device_add) for a device's products: each one's W2 . e with it */
    ov->dev_sum = ctx->device_add && !bs_host_tensor(x);
    if (ctx->compensate != BITSPLIT_NUMERICS_HOST && !ov->dev_sum) {
        /* the device's second products, W2 . e for every product of x at once, while R . x runs (with
         * the device's add, each product's is made with its sum on the device) */
        float * outs[FEED_MAX];
        if (!bs_ensure(&ov->cbuf, &ov->ccap, ysize)) {
            return; /* taken after the fact (bs_overlap_take refuses the batch) */
        }
        float * c = ov->cbuf;
        for (int i = 0; i < f->n; i++) {
            outs[i] = c;
            c += n_cols * f->e[i]->ne[1];
        }
        ov->comp_ok = bs_compensate(ctx, f->w, f->n, ov->xbuf, n_cols, outs);
    }
}

void bs_overlap_start_at(bitsplit_ctx * ctx, const struct ggml_tensor * x, const bs_entry * e) {
    /* only at the first product (a batch started there is always fresh: nothing of an earlier pass
     * is taken), and only where later products of the same input run beside the device's */
    const feed * f = ctx->overlap && ctx->overlap_at_products ? find_feed(ctx->ov, x->name, false) : NULL;
    if (f != NULL && f->n > 1 && f->e[0] == e) {
        bs_overlap_start(ctx, x);
    }
}

const float * bs_overlap_take(bitsplit_ctx * ctx, const struct ggml_tensor * t, const bs_entry * e) {
    bs_overlap * ov = ctx->ov;
    if (!ctx->overlap || ov == NULL || !ov->started) {
        return NULL;
    }
    const struct ggml_tensor * x = t->src[1];
    bs_mutex_lock(&ov->lock);
    int i = -1;
    if (ov->x != NULL && ov->x == x && ov->n_cols == ggml_nrows(x) &&
        (ctx->compensate == BITSPLIT_NUMERICS_HOST || ov->dev_sum || ov->comp_ok)) {
        for (int k = 0; k < ov->n_jobs; k++) {
            if (ov->e[k] == e && !ov->taken[k]) {
                i = k;
                break;
            }
        }
    }
    if (i < 0) {
        bs_mutex_unlock(&ov->lock);
        return NULL;
    }
    const uint64_t t0 = bs_now_ns();
    while (ov->n_done <= i) {
        bs_cond_wait(&ov->cv_done, &ov->lock);
    }
    ov->taken[i] = true;
    const bs_job * job = &ov->jobs[i];
    bs_mutex_unlock(&ov->lock);
    atomic_fetch_add(&ctx->c_ns_wait, bs_now_ns() - t0);
    if (job->y == NULL) {
        return NULL;
    }
    if (ctx->compensate != BITSPLIT_NUMERICS_HOST && !ov->dev_sum) { /* the device's W2 . e, laid out as y */
        const float * c = (const float *)ov->cbuf + (job->y - (float *)ov->ybuf);
        for (int64_t k = 0; k < job->n_cols * job->N; k++) {
            job->y[k] += c[k];
        }
    }
    bs_count_job(ctx, job, bs_now_ns() - ov->ns[i], true);
    atomic_fetch_add(&ctx->c_overlap, 1);
    return job->y;
}

const float * bs_overlap_x(const bitsplit_ctx * ctx, const struct ggml_tensor * t) {
    const bs_overlap * ov = ctx->ov;
    return ctx->overlap && ov != NULL && ov->x != NULL && ov->x == t->src[1] && ov->n_cols == ggml_nrows(t->src[1])
               ? (const float *)ov->xbuf
               : NULL;
}
