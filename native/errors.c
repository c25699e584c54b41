/*
 * Errors: the status strings, and the first error of a context kept for bitsplit_ctx_take_error
 * (bs_record_error: every file that meets an error during a pass records it here, since an eval
 * callback or a custom op has no status to return). The bottom of the library: calls no other
 * file of it (native/README.md: the units bottom to top).
 */
#define _GNU_SOURCE
#include <stdarg.h>
#include <stdio.h>

#include "bitsplit.h"
#include "bs_internal.h"

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

void bs_record_error(bitsplit_ctx * ctx, int status, const char * fmt, ...) {
    atomic_fetch_add(&ctx->c_err, 1);
    bs_mutex_lock(&ctx->err_lock);
    if (ctx->err_status == BITSPLIT_OK) {
        ctx->err_status = status;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(ctx->err_msg, sizeof(ctx->err_msg), fmt, ap);
        va_end(ap);
    }
    bs_mutex_unlock(&ctx->err_lock);
}

int bitsplit_ctx_take_error(bitsplit_ctx * ctx, char * buf, size_t buf_size) {
    if (ctx == NULL) {
        return BITSPLIT_E_INVALID;
    }
    bs_mutex_lock(&ctx->err_lock);
    const int st = ctx->err_status;
    if (buf != NULL && buf_size > 0) {
        snprintf(buf, buf_size, "%s", st == BITSPLIT_OK ? "" : ctx->err_msg);
    }
    ctx->err_status = BITSPLIT_OK;
    ctx->err_msg[0] = '\0';
    bs_mutex_unlock(&ctx->err_lock);
    return st;
}
