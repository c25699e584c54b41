/*
 * The importance-matrix collector: an eval callback that sums, for every weight product of a
 * model's layers, the squares of the activations entering each input column, as llama.cpp's
 * imatrix tool defines them (MUL_MAT: one count per activation row; MUL_MAT_ID: per expert, one
 * count per row routed to it). Only weights named "blk.*" are collected (llama.cpp's default; the
 * output head is left out), and only batches of at least BS_IMAT_MIN_ROWS rows (generation-sized
 * passes would weigh a few positions as much as a whole chunk). Sums are kept in double.
 *
 * The callback runs on the thread that called llama_decode, one node at a time: no locking. Every
 * shape, type and expert id is checked before memory is read; a node that does not fit is recorded
 * as an error (the first one is kept) and the graph continues.
 */
#include "bitsplit.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml-backend.h"
#include "ggml.h"

#define BS_IMAT_MIN_ROWS 16

typedef struct {
    char name[GGML_MAX_NAME];
    int64_t n_per_row;
    int64_t n_mat;
    double * sums;   /* n_mat * n_per_row */
    int64_t * counts; /* n_mat */
} imat_entry;

struct bitsplit_imatrix {
    imat_entry * e;
    int64_t n, cap;
    void * tmp; /* copies of device tensors (activations, expert ids) */
    size_t tmp_size;
    void * tmp2;
    size_t tmp2_size;
    int status;
    char err[512];
    uint64_t n_nodes; /* products collected */
};

static void record(bitsplit_imatrix * im, int status, const char * fmt, ...) {
    if (im->status != BITSPLIT_OK) {
        return; /* keep the first */
    }
    im->status = status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(im->err, sizeof im->err, fmt, ap);
    va_end(ap);
}

int bitsplit_imatrix_new(bitsplit_imatrix ** out) {
    if (out == NULL) {
        return BITSPLIT_E_INVALID;
    }
    *out = calloc(1, sizeof(bitsplit_imatrix));
    return *out ? BITSPLIT_OK : BITSPLIT_E_NOMEM;
}

void bitsplit_imatrix_free(bitsplit_imatrix * im) {
    if (im == NULL) {
        return;
    }
    for (int64_t i = 0; i < im->n; i++) {
        free(im->e[i].sums);
        free(im->e[i].counts);
    }
    free(im->e);
    free(im->tmp);
    free(im->tmp2);
    free(im);
}

/* The weight's own name: llama.cpp names per-backend copies of a weight "BACKEND#name#N". */
static void weight_name(const char * name, char * out, size_t size) {
    const char * a = strchr(name, '#');
    const char * b = a ? strchr(a + 1, '#') : NULL;
    if (a != NULL && b != NULL) {
        size_t n = (size_t)(b - a - 1);
        if (n >= size) {
            n = size - 1;
        }
        memcpy(out, a + 1, n);
        out[n] = '\0';
    } else {
        snprintf(out, size, "%s", name);
    }
}

static bool wanted(const struct ggml_tensor * t) {
    if (t->op != GGML_OP_MUL_MAT && t->op != GGML_OP_MUL_MAT_ID) {
        return false;
    }
    const struct ggml_tensor * w = t->src[0];
    const struct ggml_tensor * x = t->src[1];
    if (w == NULL || x == NULL || x->type != GGML_TYPE_F32) {
        return false;
    }
    char name[GGML_MAX_NAME];
    weight_name(w->name, name, sizeof name);
    if (strncmp(name, "blk.", 4) != 0) {
        return false;
    }
    /* rows of activations in this pass: MUL_MAT x[K, rows, ...]; MUL_MAT_ID x[K, slots, tokens] */
    const int64_t rows = t->op == GGML_OP_MUL_MAT ? x->ne[1] * x->ne[2] * x->ne[3] : x->ne[2];
    return rows >= BS_IMAT_MIN_ROWS;
}

static imat_entry * entry_for(bitsplit_imatrix * im, const char * name, int64_t n_per_row, int64_t n_mat) {
    for (int64_t i = 0; i < im->n; i++) {
        if (strcmp(im->e[i].name, name) == 0) {
            if (im->e[i].n_per_row != n_per_row || im->e[i].n_mat != n_mat) {
                record(im, BITSPLIT_E_MISMATCH, "weight '%s' seen as %lld x %lld, earlier as %lld x %lld", name,
                       (long long)n_mat, (long long)n_per_row, (long long)im->e[i].n_mat,
                       (long long)im->e[i].n_per_row);
                return NULL;
            }
            return &im->e[i];
        }
    }
    if (im->n == im->cap) {
        int64_t cap = im->cap ? im->cap * 2 : 64;
        imat_entry * e = realloc(im->e, (size_t)cap * sizeof *e);
        if (e == NULL) {
            record(im, BITSPLIT_E_NOMEM, "out of memory for the entry of '%s'", name);
            return NULL;
        }
        im->e = e;
        im->cap = cap;
    }
    imat_entry * e = &im->e[im->n];
    memset(e, 0, sizeof *e);
    snprintf(e->name, sizeof e->name, "%s", name);
    e->n_per_row = n_per_row;
    e->n_mat = n_mat;
    e->sums = calloc((size_t)(n_per_row * n_mat), sizeof(double));
    e->counts = calloc((size_t)n_mat, sizeof(int64_t));
    if (e->sums == NULL || e->counts == NULL) {
        free(e->sums);
        free(e->counts);
        record(im, BITSPLIT_E_NOMEM, "out of memory for the entry of '%s'", name);
        return NULL;
    }
    im->n++;
    return e;
}

/* The bytes of t (its data from offset 0 to ggml_nbytes), readable from the host. */
static const char * host_bytes(bitsplit_imatrix * im, const struct ggml_tensor * t, void ** buf, size_t * size) {
    if (t->data == NULL) {
        return NULL;
    }
    if (t->buffer == NULL || ggml_backend_buffer_is_host(t->buffer)) {
        return (const char *)t->data;
    }
    const size_t n = ggml_nbytes(t);
    if (*size < n) {
        void * p = realloc(*buf, n);
        if (p == NULL) {
            record(im, BITSPLIT_E_NOMEM, "out of memory copying '%s' from its device", t->name);
            return NULL;
        }
        *buf = p;
        *size = n;
    }
    ggml_backend_tensor_get((struct ggml_tensor *)t, *buf, 0, n);
    return (const char *)*buf;
}

static bool add_row(bitsplit_imatrix * im, const imat_entry * e, double * sums, const char * row, size_t nb0) {
    const int64_t K = e->n_per_row;
    for (int64_t j = 0; j < K; j++) {
        const float v = *(const float *)(row + (size_t)j * nb0);
        if (!isfinite(v)) {
            record(im, BITSPLIT_E_STATE, "activation %lld entering '%s' is %s", (long long)j, e->name,
                   isnan(v) ? "NaN" : "infinite");
            return false;
        }
        sums[j] += (double)v * (double)v;
    }
    return true;
}

static void collect_mul_mat(bitsplit_imatrix * im, const struct ggml_tensor * t, const char * name) {
    const struct ggml_tensor * w = t->src[0];
    const struct ggml_tensor * x = t->src[1];
    if (w->ne[2] != 1 || w->ne[3] != 1 || x->ne[0] != w->ne[0] || x->nb[0] != sizeof(float)) {
        return; /* a batched product of activations, not a weight's */
    }
    imat_entry * e = entry_for(im, name, w->ne[0], 1);
    const char * data = e ? host_bytes(im, x, &im->tmp, &im->tmp_size) : NULL;
    if (data == NULL) {
        return;
    }
    for (int64_t i3 = 0; i3 < x->ne[3]; i3++) {
        for (int64_t i2 = 0; i2 < x->ne[2]; i2++) {
            for (int64_t i1 = 0; i1 < x->ne[1]; i1++) {
                const char * row = data + i1 * x->nb[1] + i2 * x->nb[2] + i3 * x->nb[3];
                if (!add_row(im, e, e->sums, row, x->nb[0])) {
                    return;
                }
                e->counts[0]++;
            }
        }
    }
    im->n_nodes++;
}

static void collect_mul_mat_id(bitsplit_imatrix * im, const struct ggml_tensor * t, const char * name) {
    const struct ggml_tensor * w = t->src[0];
    const struct ggml_tensor * x = t->src[1];
    const struct ggml_tensor * ids = t->src[2];
    if (ids == NULL || ids->type != GGML_TYPE_I32 || w->ne[3] != 1 || x->ne[0] != w->ne[0] ||
        x->nb[0] != sizeof(float) || x->ne[3] != 1 || ids->ne[1] != x->ne[2] || x->ne[1] < 1 ||
        ids->nb[0] != sizeof(int32_t)) {
        record(im, BITSPLIT_E_UNSUPPORTED, "expert product of '%s' has a layout this collector does not read", name);
        return;
    }
    const int64_t n_exp = w->ne[2];
    imat_entry * e = entry_for(im, name, w->ne[0], n_exp);
    const char * data = e ? host_bytes(im, x, &im->tmp, &im->tmp_size) : NULL;
    const char * idd = data ? host_bytes(im, ids, &im->tmp2, &im->tmp2_size) : NULL;
    if (idd == NULL) {
        return;
    }
    for (int64_t tok = 0; tok < ids->ne[1]; tok++) {
        for (int64_t s = 0; s < ids->ne[0]; s++) {
            const int32_t ex = *(const int32_t *)(idd + s * ids->nb[0] + tok * ids->nb[1]);
            if (ex < 0 || ex >= n_exp) {
                record(im, BITSPLIT_E_INVALID, "expert id %d out of range for '%s' (%lld experts)", ex, name,
                       (long long)n_exp);
                return;
            }
            const char * row = data + (s % x->ne[1]) * x->nb[1] + tok * x->nb[2];
            if (!add_row(im, e, e->sums + (size_t)ex * (size_t)e->n_per_row, row, x->nb[0])) {
                return;
            }
            e->counts[ex]++;
        }
    }
    im->n_nodes++;
}

bool bitsplit_imatrix_callback(struct ggml_tensor * t, bool ask, void * user_data) {
    bitsplit_imatrix * im = user_data;
    if (im == NULL || t == NULL) {
        return ask ? false : true;
    }
    if (ask) {
        return wanted(t);
    }
    if (im->status == BITSPLIT_OK && wanted(t)) {
        char name[GGML_MAX_NAME];
        weight_name(t->src[0]->name, name, sizeof name);
        if (t->op == GGML_OP_MUL_MAT) {
            collect_mul_mat(im, t, name);
        } else {
            collect_mul_mat_id(im, t, name);
        }
    }
    return true; /* false would abort the graph */
}

int64_t bitsplit_imatrix_n_entries(const bitsplit_imatrix * im) {
    return im ? im->n : 0;
}

uint64_t bitsplit_imatrix_n_products(const bitsplit_imatrix * im) {
    return im ? im->n_nodes : 0;
}

int bitsplit_imatrix_entry(const bitsplit_imatrix * im, int64_t i, const char ** name, int64_t * n_per_row,
                           int64_t * n_mat, double * sums, int64_t * counts) {
    if (im == NULL || i < 0 || i >= im->n) {
        return BITSPLIT_E_INVALID;
    }
    const imat_entry * e = &im->e[i];
    if (name) {
        *name = e->name;
    }
    if (n_per_row) {
        *n_per_row = e->n_per_row;
    }
    if (n_mat) {
        *n_mat = e->n_mat;
    }
    if (sums) {
        memcpy(sums, e->sums, (size_t)(e->n_per_row * e->n_mat) * sizeof(double));
    }
    if (counts) {
        memcpy(counts, e->counts, (size_t)e->n_mat * sizeof(int64_t));
    }
    return BITSPLIT_OK;
}

int bitsplit_imatrix_take_error(bitsplit_imatrix * im, char * buf, size_t buf_size) {
    if (im == NULL) {
        return BITSPLIT_E_INVALID;
    }
    const int status = im->status;
    if (buf != NULL && buf_size > 0) {
        snprintf(buf, buf_size, "%s", status == BITSPLIT_OK ? "" : im->err);
    }
    im->status = BITSPLIT_OK;
    im->err[0] = '\0';
    return status;
}
