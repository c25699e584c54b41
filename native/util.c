/*
 * The helpers at the bottom of the library, beside errors.c: ggml's weight types as this library
 * reads them (readable at all, a row to f32 through ggml's own
 * dequantizer). Calls no other file of the library (native/README.md: the units bottom to top).
 */
#define _GNU_SOURCE
#include <string.h>

#include "bs_internal.h"

bool bs_type_readable(enum ggml_type type) {
    if (type == GGML_TYPE_F32) {
        return true;
    }
    if ((int)type < 0 || type >= GGML_TYPE_COUNT) {
        return false;
    }
    const struct ggml_type_traits * tr = ggml_get_type_traits(type);
    return tr != NULL && tr->to_float != NULL && tr->blck_size > 0 && tr->type_size > 0;
}

void bs_dequant_row(enum ggml_type type, const void * row, float * out, int64_t k) {
    if (type == GGML_TYPE_F32) {
        memcpy(out, row, (size_t)k * sizeof(float));
        return;
    }
    ggml_get_type_traits(type)->to_float(row, out, k);
}
