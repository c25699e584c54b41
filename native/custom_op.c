/*
 * ggml's custom ops as this library uses them: a hooked node becomes a GGML_OP_CUSTOM whose function
 * is one of the library's (hook.c) and is given back its own op afterwards. ggml keeps the layout of
 * a custom op's parameters private (ggml-impl.h), so this file holds the one copy of it, the check
 * of that copy against a real custom node (at load: loader.c keeps the answer in ctx->replace_ok),
 * and the writing and undoing of a node's op. Calls no other file of the library.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <string.h>

#include "bs_internal.h"
#include "ggml.h"

/* ggml-impl.h's struct ggml_custom_op_params (private to ggml; checked at load, see
 * bs_custom_layout_ok) */
struct bs_custom_params {
    ggml_custom_op_t fun;
    int n_tasks;
    void * userdata;
};

#define BS_MAGIC 0x4c505342 /* "BSPL": marks a node this library turned into a custom op */
#define BS_STASH_MAGIC 8    /* op_params[8]: magic, [9]: original op, bytes 40..63: original params */
#define BS_STASH_OP 9

/* ggml keeps struct ggml_custom_op_params private: check our copy against a real custom node */
static void dummy_op(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void)dst;
    (void)ith;
    (void)nth;
    (void)userdata;
}

bool bs_custom_layout_ok(void) {
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

bool bs_custom_is_ours(const struct ggml_tensor * t) {
    return t->op == GGML_OP_CUSTOM && t->op_params[BS_STASH_MAGIC] == BS_MAGIC;
}

void bs_custom_mutate(struct ggml_tensor * t, ggml_custom_op_t fn, const void * userdata) {
    char * raw = (char *)t->op_params;
    memcpy(raw + BS_STASH_BYTES, raw, sizeof(struct bs_custom_params));
    t->op_params[BS_STASH_OP] = (int32_t)t->op;
    t->op_params[BS_STASH_MAGIC] = BS_MAGIC;
    struct bs_custom_params p = {fn, GGML_N_TASKS_MAX, (void *)userdata};
    memcpy(raw, &p, sizeof(p));
    t->op = GGML_OP_CUSTOM;
}

void bs_custom_restore(struct ggml_tensor * t) {
    char * raw = (char *)t->op_params;
    const int32_t op = t->op_params[BS_STASH_OP];
    memcpy(raw, raw + BS_STASH_BYTES, sizeof(struct bs_custom_params));
    memset(raw + BS_STASH_MAGIC * 4, 0, GGML_MAX_OP_PARAMS - BS_STASH_MAGIC * 4);
    t->op = (enum ggml_op)op;
}
