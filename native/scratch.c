/* Per-thread scratch buffers, shared by every kernel family (and linked alone into the kernel
 * parity harness, native/tests/kernel_parity.c, which builds one family file without the rest). */
#define _GNU_SOURCE
#include <stdlib.h>

#include "bs_internal.h"

/* grow by whole pages, 64-byte aligned; on failure the old buffer is kept, the size asked noted in
 * s->failed and NULL returned */
void * bs_scratch_get(bs_scratch * s, size_t size) {
    if (s->size >= size) {
        return s->buf;
    }
    size_t want = (size + 4095) & ~(size_t)4095;
    void * p = bs_aligned_alloc(64, want);
    if (p == NULL) {
        s->failed = size;
        return NULL;
    }
    bs_aligned_free(s->buf);
    s->buf = p;
    s->size = want;
    return p;
}
