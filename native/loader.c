/*
 * Loading: maps residual.gguf and base.gguf read-only (no copy) and checks every residual tensor
 * against the base's header before anything is read: names, shapes, types, and that each tensor's
 * bytes lie inside its file. Also the name table (tensor lookup), bitsplit_ctx_free and the
 * tensor-info queries.
 */
#define _GNU_SOURCE
#include "bitsplit.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bs_internal.h"
#include "ggml.h"
#include "gguf.h"

static int fail(char * err, size_t n, int status, const char * fmt, ...) {
    if (err != NULL && n > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, n, fmt, ap);
        va_end(ap);
    }
    return status;
}

/* ---------------------------------------------------------------------------------------------
 * name table
 * ------------------------------------------------------------------------------------------- */

const bs_entry * bs_find_entry(const bitsplit_ctx * ctx, const char * name) {
    if (ctx->table_size == 0) {
        return NULL;
    }
    uint64_t i = bs_hash_name(name) & (uint64_t)(ctx->table_size - 1);
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

static int map_file(const char * path, void ** map_out, size_t * size_out, char * err, size_t n) {
    char why[200];
    const int st = bs_map_file(path, map_out, size_out, why, sizeof(why));
    return st == 0 ? BITSPLIT_OK : fail(err, n, st == 2 ? BITSPLIT_E_FORMAT : BITSPLIT_E_IO, "%s: %s", path, why);
}

static bool residual_type_ok(enum ggml_type t) { return bs_residual_type(t); }

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
    bs_mutex_init(&ctx->err_lock);
    ctx->n_threads = 1;
    ctx->device_add = true; /* add mode's sum on the device (bitsplit_ctx_set_device_add) */

    struct ggml_context * meta_res = NULL;
    struct ggml_context * meta_base = NULL;
    struct gguf_context * g_res = NULL;
    struct gguf_context * g_base = NULL;
    int st = map_file(residual_path, &ctx->map_res, &ctx->map_res_size, err, err_size);
    if (st != BITSPLIT_OK) {
        goto fail;
    }
    st = map_file(base_path, &ctx->map_base, &ctx->map_base_size, err, err_size);
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
    const int64_t n_base = gguf_get_n_tensors(g_base);
    if (n_base < 0 || n_base > (1 << 20)) {
        st = fail(err, err_size, BITSPLIT_E_FORMAT, "%s: absurd tensor count %lld", base_path, (long long)n_base);
        goto fail;
    }
    ctx->n_entries = n;
    ctx->entries = calloc((size_t)(n + n_base > 0 ? n + n_base : 1), sizeof(bs_entry));
    ctx->table_size = 16;
    while (ctx->table_size < 2 * (n + n_base) + 2) {
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
            st = fail(err, err_size, BITSPLIT_E_UNSUPPORTED, "%s: tensor '%s' has type %s; residuals must be Q4_K, Q5_K, Q6_K, Q8_0, F16 or F32",
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
        uint64_t h = bs_hash_name(name) & (uint64_t)(ctx->table_size - 1);
        while (ctx->table[h] >= 0) {
            if (strcmp(ctx->entries[ctx->table[h]].name, name) == 0) {
                st = fail(err, err_size, BITSPLIT_E_FORMAT, "%s: duplicate tensor '%s'", residual_path, name);
                goto fail;
            }
            h = (h + 1) & (uint64_t)(ctx->table_size - 1);
        }
        ctx->table[h] = i;
    }
    /* the base's weights without residual (matrices of a readable type): computed here in
     * batch-invariant mode; a tensor that does not qualify is simply left to ggml */
    ctx->n_all = n;
    for (int64_t bi = 0; bi < n_base; bi++) {
        const char * name = gguf_get_tensor_name(g_base, bi);
        if (name == NULL || strlen(name) >= GGML_MAX_NAME || bs_find_entry(ctx, name) != NULL) {
            continue;
        }
        const struct ggml_tensor * tb = ggml_get_tensor(meta_base, name);
        if (tb == NULL || tb->ne[1] < 2 || tb->ne[2] != 1 || tb->ne[3] != 1 || !bs_type_readable(tb->type)) {
            continue;
        }
        const size_t bb = tensor_bytes(tb->type, tb->ne);
        const size_t bo = base_data0 + gguf_get_tensor_offset(g_base, bi);
        if (bb == 0 || bo < base_data0 || bo > ctx->map_base_size || bb > ctx->map_base_size - bo) {
            st = fail(err, err_size, BITSPLIT_E_FORMAT, "%s: truncated: tensor '%s' extends past the end of the file",
                      base_path, name);
            goto fail;
        }
        bs_entry * e = &ctx->entries[ctx->n_all];
        snprintf(e->name, sizeof(e->name), "%s", name);
        e->ctx = ctx;
        memcpy(e->ne, tb->ne, sizeof(e->ne));
        e->base_type = tb->type;
        e->res_type = tb->type; /* unused: res_data is NULL */
        e->exact = true;
        e->n_rows = e->ne[1];
        e->base_row_bytes = ggml_row_size(e->base_type, e->ne[0]);
        e->base_data = (const uint8_t *)ctx->map_base + bo;
        uint64_t h = bs_hash_name(name) & (uint64_t)(ctx->table_size - 1);
        while (ctx->table[h] >= 0) {
            h = (h + 1) & (uint64_t)(ctx->table_size - 1);
        }
        ctx->table[h] = ctx->n_all++;
    }
    ctx->invariant = true;
    gguf_free(g_res);
    gguf_free(g_base);
    ggml_free(meta_res);
    ggml_free(meta_base);
    g_res = g_base = NULL;
    meta_res = meta_base = NULL;
    ctx->replace_ok = bs_custom_layout_ok();
    bs_overlap_enable(ctx, true); /* add mode's default; without memory for it, products run in turn */
    {
        int cap;
        if (!bs_isa_cap(&cap)) {
            st = fail(err, err_size, BITSPLIT_E_INVALID, "BITSPLIT_MAX_ISA='%s': expected generic, avx2, neon, "
                      "avxvnni, avx512 or amx", getenv("BITSPLIT_MAX_ISA"));
            goto fail;
        }
        if (!bs_half_rate_env_ok()) {
            st = fail(err, err_size, BITSPLIT_E_INVALID, "BITSPLIT_HALF_RATE_512='%s': expected 1 (this CPU runs "
                      "512-bit operations at half rate), 0 (it does not) or unset (its CPUID decides)",
                      getenv("BITSPLIT_HALF_RATE_512"));
            goto fail;
        }
        if (!bs_thread_min_bytes(&ctx->thread_min_bytes)) {
            st = fail(err, err_size, BITSPLIT_E_INVALID, "BITSPLIT_THREAD_MIN_KB='%s': expected a whole number of "
                      "KB, 0 or more", getenv("BITSPLIT_THREAD_MIN_KB"));
            goto fail;
        }
        const char * env = getenv("BITSPLIT_KERNEL");
        if (env != NULL && env[0] != '\0') {
            ctx->pinned = bs_family_named(env);
            ctx->pin_all = true;
            if (ctx->pinned == NULL) {
                st = fail(err, err_size, BITSPLIT_E_UNSUPPORTED, "BITSPLIT_KERNEL='%s': no such kernel family on "
                          "this CPU under BITSPLIT_MAX_ISA=%s (this CPU's best for one column: %s)", env,
                          bs_isa_name(cap), bs_policy(1, false, NULL)->name);
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

void bitsplit_ctx_free(bitsplit_ctx * ctx) {
    if (ctx == NULL) {
        return;
    }
    bs_overlap_free(ctx);
    bs_comp_free(ctx, false);
    bs_pool_free(ctx->pool);
    for (int i = 0; i < BS_MAX_THREADS; i++) {
        bs_aligned_free(ctx->scratch[i].buf);
    }
    bs_aligned_free(ctx->host_x.buf);
    bs_aligned_free(ctx->host_y.buf);
    bs_aligned_free(ctx->host_d.buf);
    bs_aligned_free(ctx->host_c.buf);
    bs_aligned_free(ctx->acts);
    bs_aligned_free(ctx->gather);
    bs_aligned_free(ctx->xdev);
    bs_aligned_free(ctx->xcomp);
    free(ctx->entries);
    free(ctx->table);
    bs_unmap_file(ctx->map_res, ctx->map_res_size);
    bs_unmap_file(ctx->map_base, ctx->map_base_size);
    bs_mutex_destroy(&ctx->err_lock);
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
