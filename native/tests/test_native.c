/*
 * Standalone test of the native residual library (C11): loading, every kernel family against an
 * independent reference, counters, the eval callback's replace/add/drafter paths on real ggml CPU
 * tensors, well-formed files with unusual alignment (tensor data at odd addresses), and refusal of
 * corrupted residual (and base) files, generated here from the valid split.
 *
 *   test_native MODEL_DIR [options]      MODEL_DIR holds base.gguf and residual.gguf
 *     --bad FILE     a residual that must be refused (repeatable)
 *     --any FILE     a residual that may load or be refused, but must not crash (repeatable)
 *     --flips N      random header mutations to try (default 1500)
 *     --seed N       seed of the random mutations (default 1)
 *     --work DIR     where corrupted copies are written (default: a fresh dir under $TMPDIR or /tmp)
 *     --quick        fewer kernel configurations (threads 1 only)
 *     --selftest-oob read one byte past a file map and exit 0 (a sanitizer build must stop it)
 *     -v             verbose: ggml's log, per-case lines and measured error ratios
 *
 * Built by native/tests/run_sanitizers.sh with ASan/UBSan and -DBS_TEST_HOOKS, linked with
 * -Wl,--wrap=mmap,--wrap=munmap,--wrap=ggml_get_type_traits,--wrap=posix_memalign: the library's
 * allocations can be made to fail, and its read-only file maps become
 * heap copies whose bytes past the end of the file are poisoned, and ggml's dequantizers (not
 * instrumented) check their input first, so ASan sees any read past the end of a residual or base
 * file (it cannot see into mmap'd pages).
 * Prints one summary line; exits 1 on any failure.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "bitsplit.h"
#include "bs_internal.h" /* bs_threads_for: the pool's sizing of a product */
#include "cpu_feats.h"
#if defined(__aarch64__)
#include <sys/auxv.h>
#endif
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml.h"
#include "gguf.h"

/* optional API (newer libraries): tested when linked in */
void bitsplit_ctx_set_draft_kernel(bitsplit_ctx * ctx, bool on);
#pragma weak bitsplit_ctx_set_draft_kernel
int bitsplit_ctx_draft_matmul(bitsplit_ctx * ctx, const char * name, const float * x, int64_t n_cols, float * y);
#pragma weak bitsplit_ctx_draft_matmul

/* ---------------------------------------------------------------------------------------------
 * bookkeeping
 * ------------------------------------------------------------------------------------------- */

static long g_checks, g_failures;
static bool g_verbose;
static int g_fail_lines;

#define CHECK(cond, ...)                                    \
    do {                                                    \
        g_checks++;                                         \
        if (!(cond)) {                                      \
            fail_at(__FILE__, __LINE__, #cond, __VA_ARGS__); \
        }                                                   \
    } while (0)

static void fail_at(const char * file, int line, const char * cond, const char * fmt, ...) {
    g_failures++;
    if (++g_fail_lines > 60) {
        if (g_fail_lines == 61) fprintf(stderr, "FAIL: (further failures not printed)\n");
        return;
    }
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    fprintf(stderr, "FAIL %s:%d: %s [%s]\n", file, line, msg, cond);
}

static void vlog(const char * fmt, ...) {
    if (!g_verbose) return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
}

static void quiet_log(enum ggml_log_level level, const char * text, void * ud) {
    (void)level;
    (void)ud;
    if (g_verbose) fputs(text, stderr);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint64_t g_rng = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) { /* xorshift64* */
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    return g_rng * 2685821657736338717ull;
}

static int count_fds(void) {
    DIR * d = opendir("/proc/self/fd");
    if (d == NULL) return -1;
    int n = 0;
    while (readdir(d) != NULL) n++;
    closedir(d);
    return n;
}

/* ---------------------------------------------------------------------------------------------
 * test build only: the library's read-only maps as exact-size heap copies (see the header)
 * ------------------------------------------------------------------------------------------- */

#ifdef BS_TEST_HOOKS
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#else
#define ASAN_POISON_MEMORY_REGION(a, n) ((void)(a), (void)(n))
#define ASAN_UNPOISON_MEMORY_REGION(a, n) ((void)(a), (void)(n))
#endif
void * __real_mmap(void * addr, size_t len, int prot, int flags, int fd, off_t off);
int __real_munmap(void * addr, size_t len);

/* Heap buffers reused from map to map (no page faults per load): the file's bytes at the start of
 * the buffer, the rest of it poisoned, so a read past the end of the file is an ASan report, and
 * all of it poisoned once unmapped (use after free of a map). */
#define MAX_HEAP_MAPS 16
static struct {
    unsigned char * p;
    size_t cap, len;
    bool used;
} g_maps[MAX_HEAP_MAPS];
static pthread_mutex_t g_maps_lock = PTHREAD_MUTEX_INITIALIZER;
static long g_maps_live;

void * __wrap_mmap(void * addr, size_t len, int prot, int flags, int fd, off_t off) {
    if (addr != NULL || prot != PROT_READ || fd < 0 || off != 0 || len == 0) {
        return __real_mmap(addr, len, prot, flags, fd, off);
    }
    pthread_mutex_lock(&g_maps_lock);
    int slot = -1;
    for (int i = 0; i < MAX_HEAP_MAPS; i++) { /* a free buffer big enough, else any free one */
        if (!g_maps[i].used && (slot < 0 || (g_maps[i].cap >= len && g_maps[slot].cap < len))) slot = i;
    }
    if (slot < 0) {
        pthread_mutex_unlock(&g_maps_lock);
        errno = ENOMEM;
        return MAP_FAILED;
    }
    if (g_maps[slot].cap < len) {
        if (g_maps[slot].p != NULL) ASAN_UNPOISON_MEMORY_REGION(g_maps[slot].p, g_maps[slot].cap);
        free(g_maps[slot].p);
        g_maps[slot].cap = len + len / 4 + 4096;
        g_maps[slot].p = malloc(g_maps[slot].cap);
        if (g_maps[slot].p == NULL) {
            g_maps[slot].cap = 0;
            pthread_mutex_unlock(&g_maps_lock);
            errno = ENOMEM;
            return MAP_FAILED;
        }
    }
    unsigned char * p = g_maps[slot].p;
    ASAN_UNPOISON_MEMORY_REGION(p, len);
    size_t got = 0;
    while (got < len) {
        ssize_t r = pread(fd, p + got, len - got, (off_t)got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) { /* a real map past the end of the file would fault on access: refuse instead */
            ASAN_POISON_MEMORY_REGION(p, g_maps[slot].cap);
            pthread_mutex_unlock(&g_maps_lock);
            errno = EIO;
            return MAP_FAILED;
        }
        got += (size_t)r;
    }
    ASAN_POISON_MEMORY_REGION(p + len, g_maps[slot].cap - len);
    g_maps[slot].len = len;
    g_maps[slot].used = true;
    g_maps_live++;
    pthread_mutex_unlock(&g_maps_lock);
    return p;
}

int __wrap_munmap(void * addr, size_t len) {
    pthread_mutex_lock(&g_maps_lock);
    for (int i = 0; i < MAX_HEAP_MAPS; i++) {
        if (g_maps[i].used && g_maps[i].p == addr) {
            const size_t n = g_maps[i].len;
            g_maps[i].used = false;
            g_maps_live--;
            ASAN_POISON_MEMORY_REGION(g_maps[i].p, g_maps[i].cap);
            pthread_mutex_unlock(&g_maps_lock);
            CHECK(n == len, "munmap of a heap map with length %zu, mapped with %zu", len, n);
            return 0;
        }
    }
    pthread_mutex_unlock(&g_maps_lock);
    return __real_munmap(addr, len);
}

static long live_maps(void) { return g_maps_live; }

/* The generic family dequantizes through ggml's type traits (libggml-base is not instrumented):
 * every to_float gets a shim that has ASan check the bytes it is about to read. */
#if defined(__SANITIZE_ADDRESS__)
void __asan_loadN(uintptr_t addr, size_t size);
#define CHECK_READ(p, n) __asan_loadN((uintptr_t)(p), (n))
#else
#define CHECK_READ(p, n) ((void)(p), (void)(n))
#endif
const struct ggml_type_traits * __real_ggml_get_type_traits(enum ggml_type type);
#define MAX_TRAITS 64
static struct ggml_type_traits g_traits[MAX_TRAITS];
static ggml_to_float_t g_real_to_float[MAX_TRAITS];
#define SHIM(T)                                                                 \
    static void shim_##T(const void * x, float * y, int64_t k) {                \
        CHECK_READ(x, ggml_row_size((enum ggml_type)(T), k));                   \
        g_real_to_float[T](x, y, k);                                            \
    }
#define SHIM8(a) SHIM(a##0) SHIM(a##1) SHIM(a##2) SHIM(a##3) SHIM(a##4) SHIM(a##5) SHIM(a##6) SHIM(a##7)
SHIM(0) SHIM(1) SHIM(2) SHIM(3) SHIM(4) SHIM(5) SHIM(6) SHIM(7) SHIM(8) SHIM(9)
SHIM8(1) SHIM(18) SHIM(19) SHIM8(2) SHIM(28) SHIM(29) SHIM8(3) SHIM(38) SHIM(39) SHIM8(4) SHIM(48) SHIM(49)
SHIM8(5) SHIM(58) SHIM(59) SHIM(60) SHIM(61) SHIM(62) SHIM(63)
#define REF8(a) shim_##a##0, shim_##a##1, shim_##a##2, shim_##a##3, shim_##a##4, shim_##a##5, shim_##a##6, shim_##a##7
static const ggml_to_float_t g_shims[MAX_TRAITS] = {
    shim_0, shim_1, shim_2, shim_3, shim_4, shim_5, shim_6, shim_7, shim_8, shim_9,
    REF8(1), shim_18, shim_19, REF8(2), shim_28, shim_29, REF8(3), shim_38, shim_39, REF8(4), shim_48, shim_49,
    REF8(5), shim_58, shim_59, shim_60, shim_61, shim_62, shim_63,
};

static void install_traits_shims(void) { /* before any thread runs: the table is read-only after */
    for (int t = 0; t < GGML_TYPE_COUNT && t < MAX_TRAITS; t++) {
        const struct ggml_type_traits * real = __real_ggml_get_type_traits((enum ggml_type)t);
        g_traits[t] = *real;
        g_real_to_float[t] = real->to_float;
        if (real->to_float != NULL && real->blck_size > 0) g_traits[t].to_float = g_shims[t];
    }
}

const struct ggml_type_traits * __wrap_ggml_get_type_traits(enum ggml_type type) {
    if ((int)type >= 0 && (int)type < GGML_TYPE_COUNT && (int)type < MAX_TRAITS) return &g_traits[type];
    return __real_ggml_get_type_traits(type);
}

static void release_maps(void) {
    for (int i = 0; i < MAX_HEAP_MAPS; i++) {
        if (g_maps[i].p != NULL && !g_maps[i].used) {
            ASAN_UNPOISON_MEMORY_REGION(g_maps[i].p, g_maps[i].cap);
            free(g_maps[i].p);
            g_maps[i].p = NULL;
            g_maps[i].cap = 0;
        }
    }
}

/* posix_memalign (every 64-byte-aligned buffer of the library: activations, per-thread scratch)
 * fails with ENOMEM on the n-th call after g_memalign_fail_in is set to n (0: never) */
int __real_posix_memalign(void ** p, size_t align, size_t size);
static atomic_int g_memalign_fail_in;

int __wrap_posix_memalign(void ** p, size_t align, size_t size) {
    if (atomic_load(&g_memalign_fail_in) > 0 && atomic_fetch_sub(&g_memalign_fail_in, 1) == 1) {
        return ENOMEM;
    }
    return __real_posix_memalign(p, align, size);
}
#define HAVE_ALLOC_FAULTS 1
#else
static long live_maps(void) { return 0; }
static void release_maps(void) {}
static void install_traits_shims(void) {}
#define HAVE_ALLOC_FAULTS 0
#endif

/* ---------------------------------------------------------------------------------------------
 * files and an independent GGUF header walker (valid files only: locates fields to corrupt and
 * tensor data for the reference)
 * ------------------------------------------------------------------------------------------- */

typedef struct {
    size_t len_pos, key_pos;
    uint64_t key_len;
    size_t type_pos;
    uint32_t type;
    size_t val_pos; /* strings: position of the length */
    char key[128];
} kv_at;

typedef struct {
    size_t len_pos, name_pos;
    uint64_t name_len;
    char name[GGML_MAX_NAME];
    size_t ndims_pos, dims_pos, type_pos, off_pos;
    uint32_t n_dims, type;
    int64_t ne[4];
    uint64_t off;
    size_t abs, nbytes;
} ti_at;

typedef struct {
    char path[PATH_MAX];
    uint8_t * b;
    size_t n;
    uint32_t version;
    uint64_t n_tensors, n_kv;
    kv_at * kv;
    ti_at * ti;
    size_t header_end, data_offset, alignment;
} gfile;

static uint8_t * read_all(const char * path, size_t * n) {
    FILE * f = fopen(path, "rb");
    if (f == NULL) return NULL;
    uint8_t * b = NULL;
    if (fseek(f, 0, SEEK_END) == 0) {
        long sz = ftell(f);
        if (sz > 0 && fseek(f, 0, SEEK_SET) == 0) {
            b = malloc((size_t)sz);
            if (b != NULL && fread(b, 1, (size_t)sz, f) != (size_t)sz) {
                free(b);
                b = NULL;
            }
            *n = (size_t)sz;
        }
    }
    fclose(f);
    return b;
}

static bool write_all(const char * path, const uint8_t * b, size_t n) {
    FILE * f = fopen(path, "wb");
    if (f == NULL) return false;
    bool ok = fwrite(b, 1, n, f) == n;
    return (fclose(f) == 0) && ok;
}

typedef struct {
    const uint8_t * b;
    size_t n, pos;
    bool ok;
} rd;

static uint64_t rd_n(rd * r, int bytes) {
    if (!r->ok || r->pos + (size_t)bytes > r->n) {
        r->ok = false;
        return 0;
    }
    uint64_t v = 0;
    memcpy(&v, r->b + r->pos, (size_t)bytes); /* little-endian host */
    r->pos += (size_t)bytes;
    return v;
}

static void rd_skip(rd * r, uint64_t n) {
    if (!r->ok || n > r->n - r->pos) {
        r->ok = false;
        return;
    }
    r->pos += (size_t)n;
}

static int scalar_size(uint32_t t) {
    static const int sz[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    return t < 13 ? sz[t] : -1;
}

static void skip_value(rd * r, uint32_t t, int depth) {
    if (t == GGUF_TYPE_STRING) {
        rd_skip(r, rd_n(r, 8));
    } else if (t == GGUF_TYPE_ARRAY) {
        const uint32_t sub = (uint32_t)rd_n(r, 4);
        const uint64_t cnt = rd_n(r, 8);
        if (depth > 2) {
            r->ok = false;
            return;
        }
        for (uint64_t i = 0; i < cnt && r->ok; i++) skip_value(r, sub, depth + 1);
    } else if (scalar_size(t) > 0) {
        rd_skip(r, (uint64_t)scalar_size(t));
    } else {
        r->ok = false;
    }
}

static bool gfile_open(gfile * f, const char * path) {
    memset(f, 0, sizeof(*f));
    snprintf(f->path, sizeof(f->path), "%s", path);
    f->b = read_all(path, &f->n);
    if (f->b == NULL) {
        fprintf(stderr, "test_native: cannot read %s\n", path);
        return false;
    }
    rd r = {f->b, f->n, 0, true};
    if (rd_n(&r, 4) != 0x46554747u) return false;
    f->version = (uint32_t)rd_n(&r, 4);
    f->n_tensors = rd_n(&r, 8);
    f->n_kv = rd_n(&r, 8);
    if (!r.ok || f->n_tensors > 100000 || f->n_kv > 100000) return false;
    f->kv = calloc(f->n_kv + 1, sizeof(kv_at));
    f->ti = calloc(f->n_tensors + 1, sizeof(ti_at));
    if (f->kv == NULL || f->ti == NULL) return false;
    f->alignment = 32;
    for (uint64_t i = 0; i < f->n_kv && r.ok; i++) {
        kv_at * k = &f->kv[i];
        k->len_pos = r.pos;
        k->key_len = rd_n(&r, 8);
        k->key_pos = r.pos;
        rd_skip(&r, k->key_len);
        if (!r.ok) break;
        snprintf(k->key, sizeof(k->key), "%.*s", (int)(k->key_len < 127 ? k->key_len : 127), (const char *)f->b + k->key_pos);
        k->type_pos = r.pos;
        k->type = (uint32_t)rd_n(&r, 4);
        k->val_pos = r.pos;
        if (strcmp(k->key, "general.alignment") == 0 && k->type == GGUF_TYPE_UINT32) {
            uint32_t a;
            memcpy(&a, f->b + r.pos, 4);
            f->alignment = a;
        }
        skip_value(&r, k->type, 0);
    }
    for (uint64_t i = 0; i < f->n_tensors && r.ok; i++) {
        ti_at * t = &f->ti[i];
        t->len_pos = r.pos;
        t->name_len = rd_n(&r, 8);
        t->name_pos = r.pos;
        if (t->name_len >= GGML_MAX_NAME) return false;
        rd_skip(&r, t->name_len);
        if (!r.ok) break;
        memcpy(t->name, f->b + t->name_pos, t->name_len);
        t->name[t->name_len] = '\0';
        t->ndims_pos = r.pos;
        t->n_dims = (uint32_t)rd_n(&r, 4);
        if (t->n_dims < 1 || t->n_dims > 4) return false;
        t->dims_pos = r.pos;
        for (int d = 0; d < 4; d++) t->ne[d] = d < (int)t->n_dims ? (int64_t)rd_n(&r, 8) : 1;
        t->type_pos = r.pos;
        t->type = (uint32_t)rd_n(&r, 4);
        t->off_pos = r.pos;
        t->off = rd_n(&r, 8);
    }
    if (!r.ok || f->alignment == 0) return false;
    f->header_end = r.pos;
    f->data_offset = (r.pos + f->alignment - 1) / f->alignment * f->alignment;
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        ti_at * t = &f->ti[i];
        if (t->type >= GGML_TYPE_COUNT || ggml_blck_size((enum ggml_type)t->type) <= 0) return false;
        t->abs = f->data_offset + t->off;
        t->nbytes = ggml_row_size((enum ggml_type)t->type, t->ne[0]) * (size_t)(t->ne[1] * t->ne[2] * t->ne[3]);
        if (t->abs > f->n || t->nbytes > f->n - t->abs) return false;
    }
    return true;
}

static void gfile_close(gfile * f) {
    free(f->b);
    free(f->kv);
    free(f->ti);
    memset(f, 0, sizeof(*f));
}

static const ti_at * find_ti(const gfile * f, const char * name) {
    for (uint64_t i = 0; i < f->n_tensors; i++) {
        if (strcmp(f->ti[i].name, name) == 0) return &f->ti[i];
    }
    return NULL;
}

static const kv_at * find_kv(const gfile * f, const char * key) {
    for (uint64_t i = 0; i < f->n_kv; i++) {
        if (strcmp(f->kv[i].key, key) == 0) return &f->kv[i];
    }
    return NULL;
}

static void deq_row(enum ggml_type t, const void * src, float * dst, int64_t k) {
    if (t == GGML_TYPE_F32) {
        memcpy(dst, src, (size_t)k * sizeof(float));
    } else {
        ggml_get_type_traits(t)->to_float(src, dst, k);
    }
}

/* ---------------------------------------------------------------------------------------------
 * the model: residual tensors with their dequantized weights (reference)
 * ------------------------------------------------------------------------------------------- */

typedef struct {
    const ti_at * r;
    const ti_at * b;
    int64_t K, N, E; /* row width, rows per matrix, matrices (experts) */
    float * w;       /* f32(W2) + f32(R), E*N rows of K */
    float * ronly;   /* f32(R) */
    float * bonly;   /* f32(W2) */
} mtensor;

typedef struct {
    char dir[PATH_MAX], base_path[PATH_MAX], res_path[PATH_MAX];
    gfile base, res;
    mtensor * t;
    int nt;
} model;

static bool model_open(model * m, const char * dir) {
    memset(m, 0, sizeof(*m));
    snprintf(m->dir, sizeof(m->dir), "%s", dir);
    snprintf(m->base_path, sizeof(m->base_path), "%s/base.gguf", dir);
    snprintf(m->res_path, sizeof(m->res_path), "%s/residual.gguf", dir);
    if (!gfile_open(&m->base, m->base_path) || !gfile_open(&m->res, m->res_path)) {
        fprintf(stderr, "test_native: %s: not a readable split (base.gguf + residual.gguf)\n", dir);
        return false;
    }
    m->nt = (int)m->res.n_tensors;
    m->t = calloc((size_t)m->nt + 1, sizeof(mtensor));
    if (m->t == NULL) return false;
    for (int i = 0; i < m->nt; i++) {
        mtensor * t = &m->t[i];
        t->r = &m->res.ti[i];
        t->b = find_ti(&m->base, t->r->name);
        if (t->b == NULL) {
            fprintf(stderr, "test_native: residual tensor %s not in the base\n", t->r->name);
            return false;
        }
        t->K = t->r->ne[0];
        t->N = t->r->ne[1];
        t->E = t->r->ne[2] * t->r->ne[3];
        const int64_t rows = t->N * t->E;
        t->w = malloc((size_t)(rows * t->K) * sizeof(float));
        t->ronly = malloc((size_t)(rows * t->K) * sizeof(float));
        t->bonly = malloc((size_t)(rows * t->K) * sizeof(float));
        if (t->w == NULL || t->ronly == NULL || t->bonly == NULL) return false;
        const size_t rrb = ggml_row_size((enum ggml_type)t->r->type, t->K);
        const size_t brb = ggml_row_size((enum ggml_type)t->b->type, t->K);
        for (int64_t row = 0; row < rows; row++) {
            float * w = t->w + row * t->K;
            float * ro = t->ronly + row * t->K;
            deq_row((enum ggml_type)t->b->type, m->base.b + t->b->abs + (size_t)row * brb, w, t->K);
            deq_row((enum ggml_type)t->r->type, m->res.b + t->r->abs + (size_t)row * rrb, ro, t->K);
            memcpy(t->bonly + row * t->K, w, (size_t)t->K * sizeof(float));
            for (int64_t k = 0; k < t->K; k++) w[k] += ro[k];
        }
    }
    return true;
}

static void model_close(model * m) {
    for (int i = 0; i < m->nt; i++) {
        free(m->t[i].w);
        free(m->t[i].ronly);
        free(m->t[i].bonly);
    }
    free(m->t);
    gfile_close(&m->base);
    gfile_close(&m->res);
}

/* reference: y[c][r] = sum_k W[r][k] x[c][k] in double; A[c][r] = sum_k |W[r][k] x[c][k]| */
static void reference(const float * W, int64_t K, int64_t N, const float * x, int64_t n_cols, double * y, double * A) {
    for (int64_t c = 0; c < n_cols; c++) {
        for (int64_t r = 0; r < N; r++) {
            double s = 0, a = 0;
            const float * w = W + r * K;
            const float * xc = x + c * K;
            for (int64_t k = 0; k < K; k++) {
                const double p = (double)w[k] * (double)xc[k];
                s += p;
                a += fabs(p);
            }
            y[c * N + r] = s;
            A[c * N + r] = a;
        }
    }
}

static void make_x(float * x, int64_t n, uint64_t seed) {
    uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
    for (int64_t i = 0; i < n; i++) {
        s ^= s >> 12;
        s ^= s << 25;
        s ^= s >> 27;
        const uint64_t v = s * 2685821657736338717ull;
        float f = (float)((double)(v >> 11) / 9007199254740992.0 * 2.0 - 1.0);
        if (i % 97 == 5) f *= 16.0f;   /* outlier channels */
        if (i % 89 == 7) f = 0.0f;
        x[i] = f;
    }
}

/* largest |y - ref| - (rel*A + abs); > 0 is a failure. *ratio: largest |y - ref| / A. */
static double excess(const float * y, const double * ref, const double * A, int64_t n, double rel, double abs_tol,
                     double * ratio, int64_t * where) {
    double worst = -INFINITY;
    double rmax = 0;
    *where = -1;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(y[i])) {
            *where = i;
            *ratio = INFINITY;
            return INFINITY;
        }
        const double d = fabs((double)y[i] - ref[i]);
        const double e = d - (rel * A[i] + abs_tol);
        if (e > worst) {
            worst = e;
            *where = i;
        }
        if (A[i] > 0 && d / A[i] > rmax) rmax = d / A[i];
    }
    *ratio = rmax;
    return worst;
}

/* ---------------------------------------------------------------------------------------------
 * API edge cases
 * ------------------------------------------------------------------------------------------- */

static void test_api_edges(const model * m, const char * work) {
    char err[512];
    bitsplit_ctx * ctx = (bitsplit_ctx *)0x1;
    CHECK(bitsplit_ctx_load(NULL, m->base_path, &ctx, err, sizeof(err)) == BITSPLIT_E_INVALID, "NULL residual path");
    CHECK(bitsplit_ctx_load(m->res_path, NULL, &ctx, err, sizeof(err)) == BITSPLIT_E_INVALID, "NULL base path");
    CHECK(bitsplit_ctx_load(m->res_path, m->base_path, NULL, err, sizeof(err)) == BITSPLIT_E_INVALID, "NULL out");
    err[0] = '\0';
    int st = bitsplit_ctx_load("/nonexistent/residual.gguf", m->base_path, &ctx, err, sizeof(err));
    CHECK(st == BITSPLIT_E_IO && ctx == NULL && err[0] != '\0', "missing residual: status %d", st);
    st = bitsplit_ctx_load(m->res_path, "/nonexistent/base.gguf", &ctx, err, sizeof(err));
    CHECK(st == BITSPLIT_E_IO && ctx == NULL, "missing base: status %d", st);
    st = bitsplit_ctx_load(work, m->base_path, &ctx, err, sizeof(err));
    CHECK(st == BITSPLIT_E_IO && ctx == NULL, "directory as residual: status %d", st);
    st = bitsplit_ctx_load(m->res_path, m->base_path, &ctx, NULL, 0); /* no error buffer is fine */
    CHECK(st == BITSPLIT_OK && ctx != NULL, "load without an error buffer: status %d", st);
    bitsplit_ctx_free(ctx);
    st = bitsplit_ctx_load("/nonexistent", m->base_path, &ctx, err, 1); /* 1-byte buffer */
    CHECK(st == BITSPLIT_E_IO && err[0] == '\0', "1-byte error buffer");
    /* the base given as residual: a GGUF, but not a bitsplit residual */
    st = bitsplit_ctx_load(m->base_path, m->base_path, &ctx, err, sizeof(err));
    CHECK(st == BITSPLIT_E_FORMAT && ctx == NULL, "base as residual: status %d", st);
    /* residual as base: names are there, shapes too, types too (Q6_K/Q8_0/F16 readable) - refused
     * or not, it must not crash; with a mismatching layout it must be refused */
    st = bitsplit_ctx_load(m->res_path, m->res_path, &ctx, err, sizeof(err));
    if (st == BITSPLIT_OK) bitsplit_ctx_free(ctx);
    char empty[PATH_MAX];
    snprintf(empty, sizeof(empty), "%s/empty.gguf", work);
    CHECK(write_all(empty, (const uint8_t *)"", 0), "write %s", empty);
    st = bitsplit_ctx_load(empty, m->base_path, &ctx, err, sizeof(err));
    CHECK(st == BITSPLIT_E_FORMAT && ctx == NULL, "empty residual: status %d", st);
    st = bitsplit_ctx_load(m->res_path, empty, &ctx, err, sizeof(err));
    CHECK(st == BITSPLIT_E_FORMAT && ctx == NULL, "empty base: status %d", st);
    unlink(empty);

    bitsplit_ctx_free(NULL);
    CHECK(bitsplit_ctx_n_tensors(NULL) == 0, "n_tensors(NULL)");
    CHECK(bitsplit_ctx_tensor_info(NULL, 0, NULL, NULL, NULL, NULL) == BITSPLIT_E_INVALID, "tensor_info(NULL)");
    CHECK(bitsplit_ctx_set_precision(NULL, 0) == BITSPLIT_E_INVALID, "set_precision(NULL)");
    CHECK(bitsplit_ctx_set_mode(NULL, 0) == BITSPLIT_E_INVALID, "set_mode(NULL)");
    CHECK(bitsplit_ctx_set_act_bits(NULL, 0) == BITSPLIT_E_INVALID && bitsplit_ctx_act_bits(NULL, 14) == -1,
          "act_bits(NULL)");
    CHECK(bitsplit_ctx_set_draft_vocab(NULL, 0, 0) == BITSPLIT_E_INVALID, "set_draft_vocab(NULL)");
    CHECK(bitsplit_ctx_set_threads(NULL, 1) == BITSPLIT_E_INVALID, "set_threads(NULL)");
    CHECK(bitsplit_ctx_set_kernel(NULL, "generic") == BITSPLIT_E_INVALID, "set_kernel(NULL)");
    CHECK(bitsplit_ctx_set_prompt(NULL, true) == BITSPLIT_E_INVALID && !bitsplit_ctx_get_prompt(NULL), "set_prompt(NULL)");
    CHECK(bitsplit_ctx_take_error(NULL, err, sizeof(err)) == BITSPLIT_E_INVALID, "take_error(NULL)");
    CHECK(strcmp(bitsplit_ctx_kernel(NULL), "") == 0, "kernel(NULL)");
    CHECK(!bitsplit_ctx_get_enabled(NULL), "get_enabled(NULL)");
    bitsplit_ctx_set_enabled(NULL, true);
    bitsplit_ctx_get_counters(NULL, NULL);
    bitsplit_ctx_reset_counters(NULL);
    float x = 0, y = 0;
    CHECK(bitsplit_ctx_matmul(NULL, "x", &x, 1, &y, true) == BITSPLIT_E_INVALID, "matmul(NULL)");
    CHECK(bitsplit_eval_callback(NULL, true, NULL) == false, "callback(NULL, ask)");
    /* emulated numerics: bad values refused, the rounding's own edges */
    CHECK(bitsplit_ctx_set_numerics(NULL, BITSPLIT_NUMERICS_CPU, 0) == BITSPLIT_E_INVALID, "set_numerics(NULL)");
    CHECK(bitsplit_ctx_set_compensation(NULL, BITSPLIT_NUMERICS_CPU, NULL) == BITSPLIT_E_INVALID,
          "set_compensation(NULL)");
    bitsplit_ctx_release_devices(NULL, false);
    {
        float xr[512], xo[512];
        for (int i = 0; i < 512; i++) xr[i] = (float)((i * 37) % 101 - 50) * (i == 3 ? 90.0f : 1.0f);
        CHECK(bitsplit_round_activations(BITSPLIT_NUMERICS_FLOAT + 1, GGML_TYPE_Q2_K, 512, 1, 0, xr, xo) ==
                  BITSPLIT_E_INVALID, "round: bad numerics");
        CHECK(bitsplit_round_activations(BITSPLIT_NUMERICS_CPU, GGML_TYPE_Q2_K, 512, 1, BITSPLIT_MAX_OUTLIERS + 1, xr,
                                         xo) == BITSPLIT_E_INVALID, "round: too many outliers");
        CHECK(bitsplit_round_activations(BITSPLIT_NUMERICS_CPU, GGML_TYPE_Q2_K, 512, 1, 0, NULL, xo) == BITSPLIT_E_INVALID,
              "round: NULL x");
        CHECK(bitsplit_round_activations(BITSPLIT_NUMERICS_CPU, GGML_TYPE_Q2_K, 96, 1, 0, xr, xo) ==
                  BITSPLIT_E_UNSUPPORTED, "round: a width Q8_K's block does not divide");
        CHECK(bitsplit_round_activations(BITSPLIT_NUMERICS_CPU, GGML_TYPE_COUNT, 512, 1, 0, xr, xo) == BITSPLIT_E_INVALID,
              "round: a type past ggml's");
        /* outliers: as many as the row is wide, all exact; in place */
        CHECK(bitsplit_round_activations(BITSPLIT_NUMERICS_CUDA, GGML_TYPE_Q8_0, 32, 1, 64, xr, xo) == BITSPLIT_OK &&
                  memcmp(xr, xo, 32 * sizeof(float)) == 0, "round: every channel exact");
        memcpy(xo, xr, sizeof(xr));
        CHECK(bitsplit_round_activations(BITSPLIT_NUMERICS_CPU, GGML_TYPE_Q2_K, 512, 1, 4, xo, xo) == BITSPLIT_OK &&
                  xo[3] == xr[3], "round: in place, the outlier exact");
    }
    CHECK(bitsplit_eval_callback(NULL, false, NULL) == true, "callback(NULL, !ask)");
    for (int s = 0; s <= 8; s++) CHECK(bitsplit_status_str(s) != NULL && bitsplit_status_str(s)[0], "status_str(%d)", s);
    CHECK(bitsplit_status_str(-5) != NULL, "status_str(-5)");
    CHECK(bitsplit_kernel_name() != NULL && bitsplit_kernel_name()[0], "kernel_name");
}

/* ---------------------------------------------------------------------------------------------
 * loading a valid split, products of every family against the reference, counters
 * ------------------------------------------------------------------------------------------- */

static const char * const FAMILIES[] = {"generic", "avx512-bf16", "amx-bf16", "vnni-int24", "avxvnni-int16", "avx2-int16",
                                        "avx2-f32", "neon-f32", "neon-int16", "avx512vnni-int16"};
#define N_FAMILIES 10
static bool g_family_ok[N_FAMILIES];
static const int COLS[] = {1, 3, 5, 17, 40}; /* 5: avx512vnni-int16's 4 columns per decoding, then 1 */
#define N_COLS 5
#define MAX_COLS 40
static double g_worst_ratio[N_FAMILIES][3]; /* measured |y-ref|/A per family and effective precision */

/* the base types the native drafter's integer kernel reads */
static bool int_kernel_type(int t) {
    return t == GGML_TYPE_Q2_K || t == GGML_TYPE_Q3_K || t == GGML_TYPE_Q4_K || t == GGML_TYPE_Q5_K ||
           t == GGML_TYPE_Q6_K || t == GGML_TYPE_Q8_0;
}

/* whether the native drafter takes a base product of this type and width (the library's policy) */
static bool drafts(int t, int64_t K, int64_t n_cols) {
    const char * f = bitsplit_draft_kernel();
    if (f[0] == '\0' || n_cols < bitsplit_draft_min_cols()) {
        return false;
    }
    if (strcmp(f, "avx2-int16") == 0 || strcmp(f, "avxvnni-int16") == 0) { /* the types a split holds, rows a multiple of their block */
        const bool k256 = t == GGML_TYPE_Q2_K || t == GGML_TYPE_Q3_K || t == GGML_TYPE_Q4_K || t == GGML_TYPE_Q5_K ||
                          t == GGML_TYPE_Q6_K;
        const bool k32 = t == GGML_TYPE_Q8_0 || t == GGML_TYPE_Q4_0 || t == GGML_TYPE_Q4_1;
        return (k256 && K % 256 == 0) || (k32 && K % 32 == 0);
    }
    return K % 256 == 0 && int_kernel_type(t);
}

static bool is_float_type(int t) {
    return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16;
}

static int effective_precision(int prec, const mtensor * t) {
    if (prec != BITSPLIT_PREC_AUTO) return prec;
    return is_float_type((int)t->b->type) || is_float_type((int)t->r->type) ? BITSPLIT_PREC_F32 : BITSPLIT_PREC_BF16;
}

/* tolerances: F32 is the exact verifier (f32 sums); BF16 rounds weights and activations to 8-bit
 * mantissas (products within 2^-7 relative), summed in f32 */
static double rel_tol(int eff) { return eff == BITSPLIT_PREC_F32 ? 1e-5 : 1.0 / 64; }

static void check_counters(bitsplit_ctx * ctx, const mtensor * t, int64_t n_cols, bool with_base, const char * what) {
    bitsplit_counters c;
    memset(&c, 0xff, sizeof(c));
    bitsplit_ctx_get_counters(ctx, &c);
    const uint64_t rb = (uint64_t)ggml_row_size((enum ggml_type)t->r->type, t->K) * (uint64_t)t->N;
    const uint64_t bb = (uint64_t)ggml_row_size((enum ggml_type)t->b->type, t->K) * (uint64_t)t->N;
    CHECK(c.n_products == (with_base ? 1u : 0u) && c.n_add_products == (with_base ? 0u : 1u),
          "%s: counters products %" PRIu64 " add %" PRIu64, what, c.n_products, c.n_add_products);
    CHECK(c.n_columns == (uint64_t)n_cols, "%s: counters columns %" PRIu64 " != %" PRId64, what, c.n_columns, n_cols);
    CHECK(c.bytes_residual == rb, "%s: bytes_residual %" PRIu64 " != %" PRIu64, what, c.bytes_residual, rb);
    CHECK(c.bytes_base == (with_base ? bb : 0), "%s: bytes_base %" PRIu64 " != %" PRIu64, what, c.bytes_base,
          with_base ? bb : 0);
    CHECK(c.n_get_rows == 0 && c.n_errors == 0, "%s: get_rows %" PRIu64 " errors %" PRIu64, what, c.n_get_rows,
          c.n_errors);
    CHECK(c.ns_inside < 600ull * 1000000000ull, "%s: ns_inside %" PRIu64, what, c.ns_inside);
}

static void test_products(bitsplit_ctx * ctx, const model * m, bool quick) {
    float * x = malloc((size_t)MAX_COLS * 2048 * sizeof(float));
    const size_t ycap = (size_t)MAX_COLS * 4096;
    float * y = malloc(ycap * sizeof(float));
    float * y17[N_FAMILIES];
    float * ygen17 = malloc(ycap * sizeof(float)); /* generic's result at 17 columns, same precision */
    double * ref = malloc(ycap * sizeof(double));
    double * A = malloc(ycap * sizeof(double));
    for (int f = 0; f < N_FAMILIES; f++) y17[f] = malloc(ycap * sizeof(float));
    const int precs[3] = {BITSPLIT_PREC_AUTO, BITSPLIT_PREC_F32, BITSPLIT_PREC_BF16};
    const int n_thr = quick ? 1 : 2;
    long n_products = 0;

    for (int ti = 0; ti < m->nt; ti++) {
        const mtensor * t = &m->t[ti];
        if (t->E != 1) continue; /* 2-D weights only (experts: see test_callback) */
        if (t->K > 2048 || (size_t)t->N * MAX_COLS > ycap) {
            vlog("  skipping %s (larger than this test's buffers)\n", t->r->name);
            continue;
        }
        make_x(x, MAX_COLS * t->K, (uint64_t)ti + 1);
        for (int wb = 1; wb >= 0; wb--) {
            const bool with_base = wb == 1;
            reference(with_base ? t->w : t->ronly, t->K, t->N, x, MAX_COLS, ref, A);
            for (int pi = 0; pi < 3; pi++) {
                const int eff = effective_precision(precs[pi], t);
                CHECK(bitsplit_ctx_set_precision(ctx, precs[pi]) == BITSPLIT_OK, "set_precision");
                for (int f = 0; f < N_FAMILIES; f++) {
                    if (!g_family_ok[f]) continue;
                    CHECK(bitsplit_ctx_set_kernel(ctx, FAMILIES[f]) == BITSPLIT_OK, "set_kernel %s", FAMILIES[f]);
                    CHECK(strcmp(bitsplit_ctx_kernel(ctx), FAMILIES[f]) == 0, "kernel is %s, set %s",
                          bitsplit_ctx_kernel(ctx), FAMILIES[f]);
                    for (int thr = 1; thr <= n_thr; thr++) {
                        CHECK(bitsplit_ctx_set_threads(ctx, thr) == BITSPLIT_OK, "set_threads %d", thr);
                        /* 17 columns first: the baseline for batch and thread invariance */
                        static const int order[N_COLS] = {3, 0, 1, 2, 4};
                        for (int oi = 0; oi < N_COLS; oi++) {
                            const int nc = COLS[order[oi]];
                            char what[512];
                            snprintf(what, sizeof(what), "%.200s %s with_base=%d prec=%d family=%s threads=%d cols=%d",
                                     m->dir, t->r->name, wb, precs[pi], FAMILIES[f], thr, nc);
                            bitsplit_ctx_reset_counters(ctx);
                            for (size_t i = 0; i < (size_t)nc * t->N; i++) y[i] = NAN;
                            const int st = bitsplit_ctx_matmul(ctx, t->r->name, x, nc, y, with_base);
                            n_products++;
                            CHECK(st == BITSPLIT_OK, "%s: status %d", what, st);
                            if (st != BITSPLIT_OK) continue;
                            check_counters(ctx, t, nc, with_base, what);
                            double ratio;
                            int64_t where;
                            const double ex = excess(y, ref, A, nc * t->N, rel_tol(eff), 1e-5, &ratio, &where);
                            CHECK(ex <= 0, "%s: |y - ref| beyond tolerance at col %" PRId64 " row %" PRId64
                                  ": y=%.9g ref=%.9g A=%.6g", what, where / t->N, where % t->N,
                                  where >= 0 ? y[where] : 0.0, where >= 0 ? ref[where] : 0.0,
                                  where >= 0 ? A[where] : 0.0);
                            const int e = eff == BITSPLIT_PREC_F32 ? 1 : 2;
                            if (nc <= 32 && ratio > g_worst_ratio[f][e]) g_worst_ratio[f][e] = ratio;
                            if (nc == 17 && thr == 1) {
                                memcpy(y17[f], y, (size_t)nc * t->N * sizeof(float));
                                if (f == 0) memcpy(ygen17, y, (size_t)nc * t->N * sizeof(float));
                            } else if (nc <= 32) {
                                /* same family, fewer or more columns, other threads: bitwise equal */
                                const int64_t cmp = (nc < 17 ? nc : 17) * t->N;
                                CHECK(memcmp(y, y17[f], (size_t)cmp * sizeof(float)) == 0,
                                      "%s: not batch/thread invariant (differs from 17 columns, 1 thread)", what);
                            }
                            if (nc == 17 && thr == 1 && f != 0 && g_family_ok[0]) {
                                /* families against each other: same contract, rounding apart */
                                double worst = 0;
                                for (int64_t i = 0; i < 17 * t->N; i++) {
                                    const double d = fabs((double)y[i] - (double)ygen17[i]) -
                                                     (2 * rel_tol(eff) * A[i] + 2e-5);
                                    if (d > worst) worst = d;
                                }
                                CHECK(worst <= 0, "%s: differs from the generic family beyond tolerance", what);
                                if (eff == BITSPLIT_PREC_F32) { /* every family falls back to generic */
                                    CHECK(memcmp(y, ygen17, (size_t)17 * t->N * sizeof(float)) == 0,
                                          "%s: F32 precision not computed by the generic family", what);
                                }
                            }
                        }
                    }
                }
            }
            /* zero columns: nothing written, counted as a product of no columns */
            CHECK(bitsplit_ctx_set_precision(ctx, BITSPLIT_PREC_AUTO) == BITSPLIT_OK, "set_precision");
            y[0] = 12345.0f;
            CHECK(bitsplit_ctx_matmul(ctx, t->r->name, x, 0, y, with_base) == BITSPLIT_OK && y[0] == 12345.0f,
                  "%s: matmul with 0 columns", t->r->name);
        }
    }
    /* names that are not 2-D residual tensors */
    CHECK(bitsplit_ctx_matmul(ctx, "no.such.tensor", x, 1, y, true) == BITSPLIT_E_INVALID, "unknown tensor name");
    CHECK(bitsplit_ctx_matmul(ctx, "", x, 1, y, true) == BITSPLIT_E_INVALID, "empty tensor name");
    CHECK(bitsplit_ctx_matmul(ctx, m->t[0].r->name, x, -1, y, true) == BITSPLIT_E_INVALID, "negative columns");
    CHECK(bitsplit_ctx_matmul(ctx, m->t[0].r->name, NULL, 1, y, true) == BITSPLIT_E_INVALID, "NULL x");
    CHECK(bitsplit_ctx_matmul(ctx, m->t[0].r->name, x, 1, NULL, true) == BITSPLIT_E_INVALID, "NULL y");
    for (int ti = 0; ti < m->nt; ti++) {
        if (m->t[ti].E != 1) {
            CHECK(bitsplit_ctx_matmul(ctx, m->t[ti].r->name, x, 1, y, true) == BITSPLIT_E_INVALID,
                  "matmul on 3-D %s must be refused", m->t[ti].r->name);
        }
    }
    /* prompt mode: the policy's family for a 64-column product, whatever the pass's size, not the
     * pinned one (unless BITSPLIT_KERNEL pins for all); off again, the pin serves every batch */
    for (int ti = 0; ti < m->nt && getenv("BITSPLIT_KERNEL") == NULL; ti++) {
        if (m->t[ti].E != 1) {
            continue;
        }
        const char * name = m->t[ti].r->name;
        char want[64];
        CHECK(bitsplit_ctx_set_batch_invariant(ctx, false) == BITSPLIT_OK && bitsplit_ctx_set_kernel(ctx, NULL) == BITSPLIT_OK,
              "unpin");
        snprintf(want, sizeof(want), "%s", bitsplit_ctx_family_of(ctx, name, 64, true));
        CHECK(bitsplit_ctx_set_batch_invariant(ctx, true) == BITSPLIT_OK && bitsplit_ctx_set_kernel(ctx, "generic") == BITSPLIT_OK,
              "pin generic");
        CHECK(bitsplit_ctx_set_prompt(ctx, true) == BITSPLIT_OK && bitsplit_ctx_get_prompt(ctx), "prompt mode on");
        for (int64_t n = 1; n <= 64; n *= 4) {
            const char * got = bitsplit_ctx_family_of(ctx, name, n, true);
            CHECK(strcmp(got, want) == 0, "prompt mode, %s on %ld columns: %s, expected the policy's %s", name, (long)n, got, want);
        }
        CHECK(bitsplit_ctx_set_prompt(ctx, false) == BITSPLIT_OK && !bitsplit_ctx_get_prompt(ctx), "prompt mode off");
        CHECK(strcmp(bitsplit_ctx_family_of(ctx, name, 64, true), "generic") == 0, "the pin serves 64 columns again");
        break;
    }
    CHECK(bitsplit_ctx_set_kernel(ctx, NULL) == BITSPLIT_OK && bitsplit_ctx_set_kernel(ctx, "") == BITSPLIT_OK,
          "set_kernel(NULL/\"\") restores the default");
    CHECK(bitsplit_ctx_set_threads(ctx, 1) == BITSPLIT_OK, "set_threads 1");
    vlog("  %ld products on %s\n", n_products, m->dir);
    for (int f = 0; f < N_FAMILIES; f++) free(y17[f]);
    free(x);
    free(y);
    free(ygen17);
    free(ref);
    free(A);
}

/* The base's matrices without residual (kept exact by the split): W2 . x through bitsplit_ctx_matmul
 * (with_base only: R . x does not exist) in every family, against the float64 reference at the
 * family's precision; a column never depends on the rest of the batch. */
static void test_exact_products(bitsplit_ctx * ctx, const model * m) {
    int n_exact = 0;
    for (uint64_t i = 0; i < m->base.n_tensors; i++) {
        const ti_at * b = &m->base.ti[i];
        if (find_ti(&m->res, b->name) != NULL || b->ne[1] < 2 || b->ne[2] != 1 || b->ne[3] != 1 || b->ne[0] > 4096 ||
            b->ne[1] > 4096 || ggml_get_type_traits((enum ggml_type)b->type)->to_float == NULL) {
            continue;
        }
        n_exact++;
        const int64_t K = b->ne[0], N = b->ne[1], nc = 17;
        float * W = malloc((size_t)(K * N) * sizeof(float));
        float * x = malloc((size_t)(K * nc) * sizeof(float));
        float * y = malloc((size_t)(N * nc) * sizeof(float));
        float * y1 = malloc((size_t)N * sizeof(float));
        double * ref = malloc((size_t)(N * nc) * sizeof(double));
        double * A = malloc((size_t)(N * nc) * sizeof(double));
        if (!W || !x || !y || !y1 || !ref || !A) {
            CHECK(false, "out of memory");
        } else {
            const size_t brb = ggml_row_size((enum ggml_type)b->type, K);
            for (int64_t r = 0; r < N; r++) deq_row((enum ggml_type)b->type, m->base.b + b->abs + (size_t)r * brb, W + r * K, K);
            make_x(x, K * nc, i + 77);
            reference(W, K, N, x, nc, ref, A);
            CHECK(bitsplit_ctx_matmul(ctx, b->name, x, nc, y, false) == BITSPLIT_E_INVALID, "%s: R . x of an exact weight",
                  b->name);
            for (int f = 0; f < N_FAMILIES; f++) {
                if (!g_family_ok[f]) continue;
                CHECK(bitsplit_ctx_set_kernel(ctx, FAMILIES[f]) == BITSPLIT_OK, "set_kernel %s", FAMILIES[f]);
                CHECK(bitsplit_ctx_matmul(ctx, b->name, x, nc, y, true) == BITSPLIT_OK, "%s: exact product (%s)", b->name,
                      FAMILIES[f]);
                double ratio;
                int64_t where;
                const double e = excess(y, ref, A, N * nc, rel_tol(BITSPLIT_PREC_BF16), 1e-6, &ratio, &where);
                CHECK(e <= 0, "%s: exact product (%s) off the reference at %lld (|y-ref|/A %.3g)", b->name, FAMILIES[f],
                      (long long)where, ratio);
                CHECK(bitsplit_ctx_matmul(ctx, b->name, x + 5 * K, 1, y1, true) == BITSPLIT_OK &&
                          memcmp(y1, y + 5 * N, (size_t)N * sizeof(float)) == 0,
                      "%s: exact product (%s): column 5 alone differs from within 17", b->name, FAMILIES[f]);
            }
            bitsplit_ctx_set_kernel(ctx, NULL);
        }
        free(W);
        free(x);
        free(y);
        free(y1);
        free(ref);
        free(A);
    }
    vlog("  %d exact base matrices checked\n", n_exact);
}

/* A product whose kernel family cannot allocate its per-thread scratch (every family, one thread, the
 * n-th allocation of the product failing for n = 1..4): an out-of-memory status, the kernel's own
 * message, its rows NaN (never the stale values the output buffer held), and the same context
 * computing the product exactly as before once memory is back. */
static void test_scratch_out_of_memory(const model * m) {
#if HAVE_ALLOC_FAULTS
    const mtensor * t = NULL;
    for (int i = 0; i < m->nt && t == NULL; i++) {
        if (m->t[i].E == 1 && m->t[i].K <= 2048) t = &m->t[i];
    }
    if (t == NULL) return;
    enum { NC = 5 };
    float * x = malloc((size_t)NC * t->K * sizeof(float));
    float * y = malloc((size_t)NC * t->N * sizeof(float));
    float * good = malloc((size_t)NC * t->N * sizeof(float));
    make_x(x, NC * t->K, 77);
    const size_t ny = (size_t)NC * t->N;
    for (int f = 0; f < N_FAMILIES; f++) {
        if (!g_family_ok[f]) continue;
        bool scratch_failed = false;
        for (int n = 0; n <= 4; n++) { /* n = 0: the good result, computed first */
            char err[512] = "";
            bitsplit_ctx * ctx = NULL;
            if (bitsplit_ctx_load(m->res_path, m->base_path, &ctx, err, sizeof(err)) != BITSPLIT_OK) {
                CHECK(false, "%s: load: %s", m->dir, err);
                break;
            }
            CHECK(bitsplit_ctx_set_threads(ctx, 1) == BITSPLIT_OK && bitsplit_ctx_set_kernel(ctx, FAMILIES[f]) == BITSPLIT_OK,
                  "set_threads / set_kernel %s", FAMILIES[f]);
            for (size_t i = 0; i < ny; i++) y[i] = 12345.0f; /* stale values */
            atomic_store(&g_memalign_fail_in, n);
            const int st = bitsplit_ctx_matmul(ctx, t->r->name, x, NC, y, true);
            atomic_store(&g_memalign_fail_in, 0);
            const int est = bitsplit_ctx_take_error(ctx, err, sizeof(err));
            if (n == 0) {
                CHECK(st == BITSPLIT_OK && est == BITSPLIT_OK, "%s %s: product without faults: %d / %d %s", t->r->name,
                      FAMILIES[f], st, est, err);
                memcpy(good, y, ny * sizeof(float));
            } else if (st == BITSPLIT_OK) { /* the product asked for fewer than n buffers */
                CHECK(est == BITSPLIT_OK && memcmp(y, good, ny * sizeof(float)) == 0,
                      "%s %s: allocation %d never failed, yet the result differs (error %d %s)", t->r->name,
                      FAMILIES[f], n, est, err);
            } else {
                CHECK(st == BITSPLIT_E_NOMEM, "%s %s: allocation %d failed: status %d, not out of memory", t->r->name,
                      FAMILIES[f], n, st);
                if (est == BITSPLIT_E_NOMEM && strstr(err, "scratch") != NULL) {
                    scratch_failed = true;
                    /* the family that computes the product: the pinned one, or the one that takes a
                     * product it cannot compute (an F16 weight on avx2-int16: generic) */
                    const char * fam = bitsplit_ctx_family_of(ctx, t->r->name, NC, true);
                    char named[64];
                    snprintf(named, sizeof(named), "family %s ", fam ? fam : "?");
                    CHECK(fam != NULL && fam[0] != '\0' && strstr(err, named) != NULL,
                          "%s: the message does not name the family (%s): %s", FAMILIES[f], fam ? fam : "?", err);
                    size_t stale = 0, nans = 0;
                    for (size_t i = 0; i < ny; i++) {
                        stale += y[i] == 12345.0f;
                        nans += isnan(y[i]);
                    }
                    CHECK(stale == 0 && nans == ny, "%s %s: out of scratch memory left %zu stale values, %zu NaN of %zu",
                          t->r->name, FAMILIES[f], stale, nans, ny);
                } else {
                    CHECK(est == BITSPLIT_OK, "%s %s: allocation %d: unexpected error %d %s", t->r->name, FAMILIES[f],
                          n, est, err); /* the shared activations' buffer: bs_run_on_pool's status alone */
                }
                /* memory back: the same context computes the product as before */
                CHECK(bitsplit_ctx_matmul(ctx, t->r->name, x, NC, y, true) == BITSPLIT_OK &&
                      memcmp(y, good, ny * sizeof(float)) == 0,
                      "%s %s: after a failed allocation the context does not compute as before", t->r->name, FAMILIES[f]);
                CHECK(bitsplit_ctx_take_error(ctx, err, sizeof(err)) == BITSPLIT_OK, "%s: error left pending: %s",
                      FAMILIES[f], err);
            }
            bitsplit_ctx_free(ctx);
        }
        CHECK(scratch_failed, "%s %s: no allocation 1-4 of the product was the kernel's scratch", t->r->name,
              FAMILIES[f]);
    }
    free(x);
    free(y);
    free(good);
#else
    (void)m;
#endif
}

static void test_valid_load(const model * m, bool quick) {
    char err[512] = "";
    bitsplit_ctx * ctx = NULL;
    int st = bitsplit_ctx_load(m->res_path, m->base_path, &ctx, err, sizeof(err));
    CHECK(st == BITSPLIT_OK && ctx != NULL, "%s: valid split refused: %s (%d)", m->dir, err, st);
    if (ctx == NULL) return;
    CHECK(bitsplit_ctx_n_tensors(ctx) == m->nt, "n_tensors %" PRId64 " != %d", bitsplit_ctx_n_tensors(ctx), m->nt);
    for (int i = 0; i < m->nt; i++) {
        const char * name = NULL;
        int64_t ne[4];
        int bt = -1, rt = -1;
        CHECK(bitsplit_ctx_tensor_info(ctx, i, &name, ne, &bt, &rt) == BITSPLIT_OK, "tensor_info %d", i);
        CHECK(name != NULL && strcmp(name, m->t[i].r->name) == 0, "tensor %d name", i);
        CHECK(memcmp(ne, m->t[i].r->ne, sizeof(ne)) == 0, "tensor %d shape", i);
        CHECK(bt == (int)m->t[i].b->type && rt == (int)m->t[i].r->type, "tensor %d types %d/%d", i, bt, rt);
    }
    CHECK(bitsplit_ctx_tensor_info(ctx, -1, NULL, NULL, NULL, NULL) == BITSPLIT_E_INVALID, "tensor_info(-1)");
    CHECK(bitsplit_ctx_tensor_info(ctx, m->nt, NULL, NULL, NULL, NULL) == BITSPLIT_E_INVALID, "tensor_info(n)");
    CHECK(bitsplit_ctx_tensor_info(ctx, 0, NULL, NULL, NULL, NULL) == BITSPLIT_OK, "tensor_info with NULL outputs");
    CHECK(!bitsplit_ctx_get_enabled(ctx), "a fresh context is disabled");
    CHECK(bitsplit_ctx_set_threads(ctx, 0) == BITSPLIT_E_INVALID && bitsplit_ctx_set_threads(ctx, 65) == BITSPLIT_E_INVALID,
          "set_threads out of range");
    CHECK(bitsplit_ctx_set_precision(ctx, -1) == BITSPLIT_E_INVALID && bitsplit_ctx_set_precision(ctx, 3) == BITSPLIT_E_INVALID,
          "set_precision out of range");
    CHECK(bitsplit_ctx_set_mode(ctx, 2) == BITSPLIT_E_INVALID && bitsplit_ctx_set_mode(ctx, -1) == BITSPLIT_E_INVALID,
          "set_mode out of range");
    CHECK(bitsplit_ctx_set_act_bits(ctx, -1) == BITSPLIT_E_INVALID && bitsplit_ctx_set_act_bits(ctx, 3) == BITSPLIT_E_INVALID,
          "set_act_bits out of range");
    CHECK(bitsplit_ctx_set_act_bits(ctx, BITSPLIT_ACTS_8) == BITSPLIT_OK && bitsplit_ctx_act_bits(ctx, 8) == 8 &&
          bitsplit_ctx_set_act_bits(ctx, BITSPLIT_ACTS_16) == BITSPLIT_OK && bitsplit_ctx_act_bits(ctx, 14) == 16 &&
          bitsplit_ctx_set_act_bits(ctx, BITSPLIT_ACTS_AUTO) == BITSPLIT_OK && bitsplit_ctx_act_bits(ctx, 8) == 16,
          "set_act_bits / act_bits (auto: 16 with a Q8_0 residual)");
    CHECK(bitsplit_ctx_set_draft_vocab(ctx, -1, 10) == BITSPLIT_E_INVALID &&
          bitsplit_ctx_set_draft_vocab(ctx, 10, 9) == BITSPLIT_E_INVALID &&
          bitsplit_ctx_set_draft_vocab(ctx, 10, 10) == BITSPLIT_OK && bitsplit_ctx_set_draft_vocab(ctx, 0, 0) == BITSPLIT_OK,
          "set_draft_vocab: 0 <= rows <= tail");
    const char * before = bitsplit_ctx_kernel(ctx);
    CHECK(bitsplit_ctx_set_kernel(ctx, "no-such-family") == BITSPLIT_E_UNSUPPORTED, "unknown kernel family");
    CHECK(strcmp(bitsplit_ctx_kernel(ctx), before) == 0, "a refused family leaves the kernel as it was");
    CHECK(bitsplit_ctx_take_error(ctx, err, sizeof(err)) == BITSPLIT_OK && err[0] == '\0', "no pending error");
    for (int f = 0; f < N_FAMILIES; f++) {
        st = bitsplit_ctx_set_kernel(ctx, FAMILIES[f]);
        CHECK(st == BITSPLIT_OK || (st == BITSPLIT_E_UNSUPPORTED && f != 0), "set_kernel %s: %d", FAMILIES[f], st);
        g_family_ok[f] = st == BITSPLIT_OK;
    }
    bitsplit_ctx_set_kernel(ctx, NULL);
    test_products(ctx, m, quick);
    test_exact_products(ctx, m);
    bitsplit_ctx_free(ctx);
}

/* ---------------------------------------------------------------------------------------------
 * the eval callback on real ggml CPU tensors (no graph compute: the custom op's function is called
 * here the way ggml's CPU threads call it)
 * ------------------------------------------------------------------------------------------- */

struct custom_params { /* ggml-impl.h's struct ggml_custom_op_params */
    ggml_custom_op_t fun;
    int n_tasks;
    void * userdata;
};

typedef struct {
    struct ggml_tensor * t;
    struct custom_params p;
    int ith, nth;
} op_thread;

static void * op_thread_fn(void * arg) {
    op_thread * a = arg;
    a->p.fun(a->t, a->ith, a->nth, a->p.userdata);
    return NULL;
}

/* run a mutated node's function on nth threads at once (its barriers need them concurrent) */
#define MAX_TEST_THREADS 72 /* past the library's BS_MAX_THREADS (64): machines with more cores */

static bool run_custom(struct ggml_tensor * t, int nth) {
    if (t->op != GGML_OP_CUSTOM || nth > MAX_TEST_THREADS) return false;
    op_thread a[MAX_TEST_THREADS];
    pthread_t th[MAX_TEST_THREADS];
    for (int i = 0; i < nth; i++) {
        a[i].t = t;
        memcpy(&a[i].p, t->op_params, sizeof(a[i].p));
        a[i].ith = i;
        a[i].nth = nth;
    }
    for (int i = 1; i < nth; i++) pthread_create(&th[i], NULL, op_thread_fn, &a[i]);
    op_thread_fn(&a[0]);
    for (int i = 1; i < nth; i++) pthread_join(th[i], NULL);
    return true;
}

static const mtensor * pick(const model * m, bool experts, const char * prefer) {
    if (prefer != NULL) {
        for (int i = 0; i < m->nt; i++) {
            if (strcmp(m->t[i].r->name, prefer) == 0 && (m->t[i].E > 1) == experts) return &m->t[i];
        }
    }
    for (int i = 0; i < m->nt; i++) {
        if ((m->t[i].E > 1) == experts && strncmp(m->t[i].r->name, "blk.", 4) == 0) return &m->t[i];
    }
    return NULL;
}

static void test_callback_mul_mat(bitsplit_ctx * ctx, const model * m, const mtensor * mt, int n_cols) {
    const int64_t K = mt->K, N = mt->N;
    struct ggml_init_params ip = {.mem_size = 32 * ggml_tensor_overhead(), .mem_buffer = NULL, .no_alloc = true};
    struct ggml_context * g = ggml_init(ip);
    struct ggml_tensor * W = ggml_new_tensor_2d(g, (enum ggml_type)mt->b->type, K, N);
    ggml_set_name(W, mt->r->name);
    struct ggml_tensor * X = ggml_new_tensor_2d(g, GGML_TYPE_F32, K, n_cols);
    struct ggml_tensor * Y = ggml_mul_mat(g, W, X);
    struct ggml_tensor * Wf = ggml_new_tensor_2d(g, GGML_TYPE_F32, K, N); /* same name, other type */
    ggml_set_name(Wf, mt->r->name);
    struct ggml_tensor * Yf = ggml_mul_mat(g, Wf, X);
    struct ggml_tensor * Wn = ggml_new_tensor_2d(g, (enum ggml_type)mt->b->type, K, N);
    ggml_set_name(Wn, "not.a.residual.weight");
    struct ggml_tensor * Yn = ggml_mul_mat(g, Wn, X);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(g, ggml_backend_cpu_buffer_type());
    CHECK(buf != NULL, "allocating CPU tensors");
    if (buf == NULL) {
        ggml_free(g);
        return;
    }
    ggml_backend_tensor_set(W, m->base.b + mt->b->abs, 0, ggml_nbytes(W));
    float * x = malloc((size_t)(K * n_cols) * sizeof(float));
    double * ref = malloc((size_t)(N * n_cols) * sizeof(double));
    double * A = malloc((size_t)(N * n_cols) * sizeof(double));
    float * y1 = malloc((size_t)(N * n_cols) * sizeof(float));
    make_x(x, K * n_cols, 77);
    ggml_backend_tensor_set(X, x, 0, ggml_nbytes(X));
    char err[512];
    char what[256];
    snprintf(what, sizeof(what), "callback MUL_MAT %s cols=%d", mt->r->name, n_cols);

    /* disabled: untouched */
    bitsplit_ctx_set_enabled(ctx, false);
    uint8_t params0[GGML_MAX_OP_PARAMS];
    memcpy(params0, Y->op_params, sizeof(params0));
    CHECK(bitsplit_eval_callback(Y, true, ctx) == false && Y->op == GGML_OP_MUL_MAT, "%s: disabled", what);

    /* replace: the node becomes our custom op computing (W2 + R) . x */
    bitsplit_ctx_set_enabled(ctx, true);
    bitsplit_ctx_reset_counters(ctx);
    const bool asked = bitsplit_eval_callback(Y, true, ctx);
    CHECK(!asked && Y->op == GGML_OP_CUSTOM, "%s: not replaced (ask=%d, op=%s)", what, asked, ggml_op_name(Y->op));
    reference(mt->w, K, N, x, n_cols, ref, A);
    const int eff = effective_precision(BITSPLIT_PREC_AUTO, mt);
    if (run_custom(Y, 1)) {
        memcpy(y1, Y->data, (size_t)(N * n_cols) * sizeof(float));
        double ratio;
        int64_t where;
        CHECK(excess(y1, ref, A, N * n_cols, rel_tol(eff), 1e-5, &ratio, &where) <= 0, "%s: replace result", what);
        bitsplit_counters c;
        bitsplit_ctx_get_counters(ctx, &c);
        CHECK(c.n_products == 1 && c.n_columns == (uint64_t)n_cols && c.n_errors == 0, "%s: counters", what);
        /* 66: ggml gives every core a thread; past the library's 64 the extra ones only wait at
         * its barrier (they must all be counted there, or the product deadlocks) */
        static const int threads[] = {2, 3, 66};
        for (size_t ti = 0; ti < sizeof(threads) / sizeof(threads[0]); ti++) {
            const int nth = threads[ti];
            memset(Y->data, 0, ggml_nbytes(Y));
            run_custom(Y, nth);
            CHECK(memcmp(Y->data, y1, (size_t)(N * n_cols) * sizeof(float)) == 0, "%s: %d threads differ from 1", what,
                  nth);
        }
        /* a reused graph: seen again while enabled, the node is restored and replaced afresh */
        CHECK(bitsplit_eval_callback(Y, true, ctx) == false && Y->op == GGML_OP_CUSTOM, "%s: re-ask", what);
        /* emulated device numerics (numerics.c), with and without exact outlier channels: W2 . x-rounded,
         * then R . x added, on 1 and 3 threads alike; the base bytes of the outliers' blocks counted */
        static const int nums[][2] = {{BITSPLIT_NUMERICS_CPU, 0}, {BITSPLIT_NUMERICS_CUDA, 4}, {BITSPLIT_NUMERICS_FLOAT, 64}};
        for (size_t ni = 0; ni < sizeof(nums) / sizeof(nums[0]); ni++) {
            CHECK(bitsplit_ctx_set_numerics(ctx, nums[ni][0], nums[ni][1]) == BITSPLIT_OK, "set_numerics");
            bitsplit_ctx_reset_counters(ctx);
            const bool ok = bitsplit_eval_callback(Y, true, ctx) == false && Y->op == GGML_OP_CUSTOM;
            bitsplit_counters c;
            bitsplit_ctx_get_counters(ctx, &c);
            if (c.n_errors != 0) { /* a width the rule's block does not divide: refused, with an error */
                CHECK(bitsplit_ctx_take_error(ctx, err, sizeof(err)) == BITSPLIT_E_UNSUPPORTED &&
                      strstr(err, "device numerics") != NULL, "%s: numerics %d refusal: %s", what, nums[ni][0], err);
                continue;
            }
            CHECK(ok, "%s: numerics %d not replaced", what, nums[ni][0]);
            if (!ok || !run_custom(Y, 1)) {
                continue;
            }
            float * yn = malloc((size_t)(N * n_cols) * sizeof(float));
            memcpy(yn, Y->data, (size_t)(N * n_cols) * sizeof(float));
            memset(Y->data, 0, ggml_nbytes(Y));
            run_custom(Y, 3);
            CHECK(memcmp(Y->data, yn, (size_t)(N * n_cols) * sizeof(float)) == 0, "%s: numerics %d: 3 threads differ",
                  what, nums[ni][0]);
            bool finite = true;
            for (int64_t i = 0; i < N * n_cols; i++) finite = finite && isfinite(yn[i]);
            bitsplit_ctx_get_counters(ctx, &c);
            CHECK(finite && c.n_errors == 0 && c.n_products == 2 && (c.bytes_outlier_base > 0) == (nums[ni][1] > 0),
                  "%s: numerics %d: finite %d, errors %llu, products %llu, outlier bytes %llu", what, nums[ni][0], finite,
                  (unsigned long long)c.n_errors, (unsigned long long)c.n_products,
                  (unsigned long long)c.bytes_outlier_base);
            free(yn);
        }
        /* compensation emulated (a second product of the rounding's error): refused beside outlier
         * channels either way round; on 1 and 3 threads alike, and not the uncompensated product */
        CHECK(bitsplit_ctx_set_numerics(ctx, BITSPLIT_NUMERICS_CPU, 4) == BITSPLIT_OK &&
                  bitsplit_ctx_set_compensation(ctx, BITSPLIT_NUMERICS_CPU, NULL) == BITSPLIT_E_INVALID,
              "compensation beside outliers");
        CHECK(bitsplit_ctx_set_numerics(ctx, BITSPLIT_NUMERICS_CPU, 0) == BITSPLIT_OK &&
                  bitsplit_ctx_set_compensation(ctx, BITSPLIT_NUMERICS_FLOAT + 1, NULL) == BITSPLIT_E_INVALID &&
                  bitsplit_ctx_set_compensation(ctx, BITSPLIT_NUMERICS_CPU, NULL) == BITSPLIT_OK &&
                  bitsplit_ctx_set_numerics(ctx, BITSPLIT_NUMERICS_CPU, 4) == BITSPLIT_E_INVALID,
              "set_compensation");
        bitsplit_ctx_reset_counters(ctx);
        if (bitsplit_eval_callback(Y, true, ctx) == false && Y->op == GGML_OP_CUSTOM && run_custom(Y, 1)) {
            float * yc = malloc((size_t)(N * n_cols) * sizeof(float));
            memcpy(yc, Y->data, (size_t)(N * n_cols) * sizeof(float));
            memset(Y->data, 0, ggml_nbytes(Y));
            run_custom(Y, 3);
            bitsplit_counters c;
            bitsplit_ctx_get_counters(ctx, &c);
            CHECK(c.n_errors == 0 && memcmp(Y->data, yc, (size_t)(N * n_cols) * sizeof(float)) == 0,
                  "%s: compensated: errors %llu, or 3 threads differ", what, (unsigned long long)c.n_errors);
            free(yc);
        } else {
            CHECK(bitsplit_ctx_take_error(ctx, err, sizeof(err)) == BITSPLIT_E_UNSUPPORTED,
                  "%s: compensated product neither run nor refused: %s", what, err);
        }
        CHECK(bitsplit_ctx_set_compensation(ctx, BITSPLIT_NUMERICS_HOST, NULL) == BITSPLIT_OK, "compensation off");
        CHECK(bitsplit_ctx_set_numerics(ctx, BITSPLIT_NUMERICS_HOST, 0) == BITSPLIT_OK, "numerics back to host");
        CHECK(bitsplit_eval_callback(Y, true, ctx) == false && Y->op == GGML_OP_CUSTOM, "%s: re-ask (host)", what);
    }
    /* disabled again: the node gets its own op and params back */
    bitsplit_ctx_set_enabled(ctx, false);
    CHECK(bitsplit_eval_callback(Y, true, ctx) == false && Y->op == GGML_OP_MUL_MAT, "%s: not restored", what);
    CHECK(memcmp(params0, Y->op_params, sizeof(params0)) == 0, "%s: op_params not restored", what);

    /* add mode: observed, then R . x added to what the node holds; the same under the name of the
     * scheduler's copy of the weight for another backend ("CUDA0#name#12": llama.cpp's op offload
     * computes a large batch of a CPU weight on the GPU from such a copy) */
    bitsplit_ctx_set_enabled(ctx, true);
    CHECK(bitsplit_ctx_set_mode(ctx, BITSPLIT_MODE_ADD) == BITSPLIT_OK, "set_mode add");
    reference(mt->ronly, K, N, x, n_cols, ref, A);
    char copy[2 * GGML_MAX_NAME];
    snprintf(copy, sizeof(copy), "CUDA0#%s#12", mt->r->name);
    const bool copy_fits = strlen(copy) < GGML_MAX_NAME;
    const char * const weight_names[] = {mt->r->name, copy};
    for (int k = 0; k < (copy_fits ? 2 : 1); k++) {
        const char * wn = weight_names[k];
        ggml_set_name(W, wn);
        bitsplit_ctx_reset_counters(ctx);
        memset(Y->data, 0, ggml_nbytes(Y));
        CHECK(bitsplit_eval_callback(Y, true, ctx) == true && Y->op == GGML_OP_MUL_MAT,
              "%s: add mode must observe (weight '%s')", what, wn);
        CHECK(bitsplit_eval_callback(Y, false, ctx) == true, "%s: add mode continues the graph (weight '%s')", what, wn);
        double ratio;
        int64_t where;
        CHECK(excess((const float *)Y->data, ref, A, N * n_cols, rel_tol(eff), 1e-5, &ratio, &where) <= 0,
              "%s: add-mode result (weight '%s')", what, wn);
        bitsplit_counters c;
        bitsplit_ctx_get_counters(ctx, &c);
        CHECK(c.n_add_products == 1 && c.n_products == 0 && c.n_errors == 0, "%s: add-mode counters (weight '%s')",
              what, wn);
    }
    /* a name that only looks like a copy's is not one */
    if (copy_fits) {
        static const char * const not_copies[] = {"CUDA0#%s#", "CUDA0#%s#1a", "%s#0", "#%s"};
        for (size_t i = 0; i < sizeof(not_copies) / sizeof(not_copies[0]); i++) {
            snprintf(copy, sizeof(copy), not_copies[i], mt->r->name);
            ggml_set_name(W, copy);
            CHECK(bitsplit_eval_callback(Y, true, ctx) == false, "%s: '%s' taken for a copy's name", what, copy);
        }
    }
    ggml_set_name(W, mt->r->name);
    /* overlap: once the callback has seen that the node named "x.feed" is Y's input, it asks for
     * that node, starts R . x when it is computed and adds it when Y is */
    static int feed_id = 0;
    ggml_format_name(X, "x.feed.%d", feed_id++); /* a new name each time: what was learned stays */
    CHECK(bitsplit_eval_callback(X, true, ctx) == false, "%s: not yet known as an input", what);
    CHECK(bitsplit_eval_callback(Y, true, ctx) == true && bitsplit_eval_callback(Y, false, ctx) == true,
          "%s: add mode (learning)", what);
    for (int round = 0; round < 2; round++) {
        bitsplit_ctx_reset_counters(ctx);
        memset(Y->data, 0, ggml_nbytes(Y));
        CHECK(bitsplit_eval_callback(X, true, ctx) == true, "%s: the input is asked for (overlap)", what);
        CHECK(bitsplit_eval_callback(X, false, ctx) == true, "%s: the input's R . x starts", what);
        CHECK(bitsplit_eval_callback(Y, true, ctx) == true && bitsplit_eval_callback(Y, false, ctx) == true,
              "%s: add mode (overlapped)", what);
        double ratio;
        int64_t where;
        CHECK(excess((const float *)Y->data, ref, A, N * n_cols, rel_tol(eff), 1e-5, &ratio, &where) <= 0,
              "%s: overlapped add-mode result", what);
        bitsplit_counters c;
        bitsplit_ctx_get_counters(ctx, &c);
        CHECK(c.n_add_products == 1 && c.n_overlapped == 1 && c.n_errors == 0 && c.n_stops == 2,
              "%s: overlap counters (%llu overlapped, %llu stops)", what, (unsigned long long)c.n_overlapped,
              (unsigned long long)c.n_stops);
    }
    /* a batch started and never used (the graph went elsewhere) is dropped before anything else
     * uses the pool: here a plain product, then the replace path */
    CHECK(bitsplit_eval_callback(X, false, ctx) == true, "%s: an unused start", what);
    CHECK(bitsplit_ctx_matmul(ctx, mt->r->name, x, n_cols, y1, false) == BITSPLIT_OK, "%s: matmul after", what);
    CHECK(bitsplit_eval_callback(X, false, ctx) == true, "%s: another unused start", what);
    CHECK(bitsplit_ctx_set_overlap(ctx, BITSPLIT_OVERLAP_OFF) == BITSPLIT_OK, "%s: overlap off", what);
    CHECK(bitsplit_eval_callback(X, true, ctx) == false, "%s: overlap off: the input is not asked for", what);
    CHECK(bitsplit_ctx_set_overlap(ctx, BITSPLIT_OVERLAP_PRODUCTS) == BITSPLIT_OK, "%s: overlap at products", what);
    CHECK(bitsplit_eval_callback(X, true, ctx) == false, "%s: overlap at products: the input is not asked for", what);
    CHECK(bitsplit_ctx_set_overlap(ctx, 3) == BITSPLIT_E_INVALID && bitsplit_ctx_set_overlap(ctx, -1) ==
          BITSPLIT_E_INVALID, "%s: overlap: an unknown place refused", what);
    CHECK(bitsplit_ctx_set_overlap(ctx, BITSPLIT_OVERLAP_INPUTS) == BITSPLIT_OK &&
          bitsplit_ctx_set_overlap(NULL, BITSPLIT_OVERLAP_INPUTS) == BITSPLIT_E_INVALID, "%s: overlap on", what);
    CHECK(bitsplit_eval_callback(X, true, ctx) == true, "%s: overlap at inputs: the input is asked for", what);
    ggml_set_name(X, "");
    CHECK(bitsplit_ctx_set_mode(ctx, BITSPLIT_MODE_AUTO) == BITSPLIT_OK, "set_mode auto");

    /* the fast drafter (where the library has it): residual off, W2 . x computed here by the integer
     * kernel with 8-bit activations, for batches of 2 or more columns of integer-kernel types;
     * everything else is left to ggml */
    if (bitsplit_ctx_set_draft_kernel != NULL) {
        bitsplit_ctx_set_enabled(ctx, false);
        bitsplit_ctx_set_draft_kernel(ctx, true);
        memset(Y->data, 0, ggml_nbytes(Y));
        const bool expect = drafts((int)mt->b->type, K, n_cols);
        CHECK(bitsplit_eval_callback(Y, true, ctx) == false && (Y->op == GGML_OP_CUSTOM) == expect,
              "%s: drafter %s (op %s)", what, expect ? "not taken" : "taken", ggml_op_name(Y->op));
        if (expect && run_custom(Y, 1)) {
            reference(mt->bonly, K, N, x, n_cols, ref, A);
            /* a strict bound: each activation moves by at most half a step, max|block| / 254 */
            int64_t bad = -1;
            for (int64_t c = 0; c < n_cols && bad < 0; c++) {
                for (int64_t r = 0; r < N; r++) {
                    double bound = 0;
                    for (int64_t k0 = 0; k0 < K; k0 += 256) {
                        double amax = 0, wsum = 0;
                        for (int64_t k = k0; k < k0 + 256; k++) {
                            amax = fmax(amax, fabs((double)x[c * K + k]));
                            wsum += fabs((double)mt->bonly[r * K + k]);
                        }
                        bound += wsum * amax / 254.0;
                    }
                    const double y = ((const float *)Y->data)[c * N + r];
                    if (!(fabs(y - ref[c * N + r]) <= bound * 1.001 + 1e-4 * A[c * N + r] + 1e-5)) {
                        bad = c * N + r;
                        break;
                    }
                }
            }
            CHECK(bad < 0, "%s: drafter result outside the 8-bit rounding bound at %lld", what, (long long)bad);
            memcpy(y1, Y->data, (size_t)(N * n_cols) * sizeof(float));
            run_custom(Y, 2);
            CHECK(memcmp(Y->data, y1, (size_t)(N * n_cols) * sizeof(float)) == 0, "%s: drafter, 2 threads", what);
        }
        if (bitsplit_ctx_draft_matmul != NULL) {
            /* the same product asked directly (benchmarks): the callback's kernel, bit for bit, or
             * refused where ggml's kernel drafts it */
            float * y2 = malloc((size_t)(N * n_cols) * sizeof(float));
            const int st2 = bitsplit_ctx_draft_matmul(ctx, mt->r->name, x, n_cols, y2);
            if (expect) {
                CHECK(st2 == BITSPLIT_OK && memcmp(y2, y1, (size_t)(N * n_cols) * sizeof(float)) == 0,
                      "%s: draft_matmul (status %d) differs from the callback's drafter", what, st2);
            } else {
                CHECK(st2 == BITSPLIT_E_UNSUPPORTED, "%s: draft_matmul status %d where ggml drafts", what, st2);
            }
            CHECK(bitsplit_ctx_draft_matmul(ctx, mt->r->name, x, 0, y2) == BITSPLIT_E_INVALID &&
                  bitsplit_ctx_draft_matmul(ctx, mt->r->name, NULL, n_cols, y2) == BITSPLIT_E_INVALID &&
                  bitsplit_ctx_draft_matmul(ctx, "no.such.tensor", x, n_cols, y2) == BITSPLIT_E_INVALID &&
                  bitsplit_ctx_draft_matmul(NULL, mt->r->name, x, n_cols, y2) == BITSPLIT_E_INVALID,
                  "%s: draft_matmul refuses bad arguments", what);
            free(y2);
        }
        bitsplit_ctx_set_draft_kernel(ctx, false);
        CHECK(bitsplit_eval_callback(Y, true, ctx) == false && Y->op == GGML_OP_MUL_MAT, "%s: drafter restored", what);
        CHECK(memcmp(params0, Y->op_params, sizeof(params0)) == 0, "%s: drafter op_params restored", what);
        bitsplit_ctx_set_enabled(ctx, true);
    }

    /* a graph weight that does not match the residual: refused with a recorded error */
    CHECK(bitsplit_ctx_take_error(ctx, err, sizeof(err)) == BITSPLIT_OK, "%s: no error before mismatch", what);
    CHECK(bitsplit_eval_callback(Yf, true, ctx) == false && Yf->op == GGML_OP_MUL_MAT, "%s: mismatch replaced", what);
    const int st = bitsplit_ctx_take_error(ctx, err, sizeof(err));
    CHECK(st == BITSPLIT_E_MISMATCH && strstr(err, mt->r->name) != NULL, "%s: mismatch error %d '%s'", what, st, err);
    CHECK(bitsplit_ctx_take_error(ctx, err, sizeof(err)) == BITSPLIT_OK, "%s: error cleared by take_error", what);
    /* a weight without residual: left alone */
    CHECK(bitsplit_eval_callback(Yn, true, ctx) == false && Yn->op == GGML_OP_MUL_MAT, "%s: unknown weight", what);
    CHECK(bitsplit_eval_callback(Yn, false, ctx) == true, "%s: unknown weight, !ask", what);
    CHECK(bitsplit_ctx_take_error(ctx, err, sizeof(err)) == BITSPLIT_OK, "%s: unknown weight error", what);
    bitsplit_ctx_set_enabled(ctx, false);

    free(x);
    free(ref);
    free(A);
    free(y1);
    ggml_backend_buffer_free(buf);
    ggml_free(g);
}

/* A GET_ROWS of ``nids`` ids from the base tensor of ``mt`` (named as its residual, so that the hook
 * knows it), its tensors on the CPU with the weight holding the base's bytes. Returns the node, its
 * ids in *ids, the context and buffer to free in *g and *buf; NULL (nothing to free) where the buffer
 * cannot be allocated. */
static struct ggml_tensor * get_rows_node(const model * m, const mtensor * mt, int nids, struct ggml_context ** g,
                                          ggml_backend_buffer_t * buf, struct ggml_tensor ** ids) {
    struct ggml_init_params ip = {.mem_size = 16 * ggml_tensor_overhead(), .mem_buffer = NULL, .no_alloc = true};
    *g = ggml_init(ip);
    struct ggml_tensor * W = ggml_new_tensor_2d(*g, (enum ggml_type)mt->b->type, mt->K, mt->N);
    ggml_set_name(W, mt->r->name);
    *ids = ggml_new_tensor_1d(*g, GGML_TYPE_I32, nids);
    struct ggml_tensor * R = ggml_get_rows(*g, W, *ids);
    *buf = ggml_backend_alloc_ctx_tensors_from_buft(*g, ggml_backend_cpu_buffer_type());
    CHECK(*buf != NULL, "allocating CPU tensors");
    if (*buf == NULL) {
        ggml_free(*g);
        return NULL;
    }
    ggml_backend_tensor_set(W, m->base.b + mt->b->abs, 0, ggml_nbytes(W));
    return R;
}

static void test_callback_get_rows(bitsplit_ctx * ctx, const model * m, const mtensor * mt) {
    const int64_t K = mt->K, N = mt->N;
    enum { NIDS = 6 };
    struct ggml_context * g;
    ggml_backend_buffer_t buf;
    struct ggml_tensor * ids;
    struct ggml_tensor * R = get_rows_node(m, mt, NIDS, &g, &buf, &ids);
    if (R == NULL) return;
    char err[512], what[256];
    snprintf(what, sizeof(what), "callback GET_ROWS %s", mt->r->name);
    for (int mode = 0; mode < 2; mode++) {
        for (int bad = 0; bad < 2; bad++) {
            int32_t idv[NIDS] = {0, 1, (int32_t)(N - 1), 7 % (int32_t)N, 3 % (int32_t)N, (int32_t)(N / 2)};
            if (bad) {
                idv[2] = (int32_t)N; /* one past the end */
                idv[4] = -1;
            }
            ggml_backend_tensor_set(ids, idv, 0, sizeof(idv));
            memset(R->data, 0, ggml_nbytes(R));
            bitsplit_ctx_set_mode(ctx, mode ? BITSPLIT_MODE_ADD : BITSPLIT_MODE_AUTO);
            bitsplit_ctx_set_enabled(ctx, true);
            bitsplit_ctx_reset_counters(ctx);
            if (mode == 0) {
                CHECK(bitsplit_eval_callback(R, true, ctx) == false && R->op == GGML_OP_CUSTOM, "%s: not replaced", what);
                run_custom(R, bad ? 1 : 2);
            } else {
                CHECK(bitsplit_eval_callback(R, true, ctx) == true && R->op == GGML_OP_GET_ROWS, "%s: add observes", what);
                CHECK(bitsplit_eval_callback(R, false, ctx) == true, "%s: add continues", what);
            }
            const int st = bitsplit_ctx_take_error(ctx, err, sizeof(err));
            CHECK(st == (bad ? BITSPLIT_E_INVALID : BITSPLIT_OK), "%s mode=%d bad=%d: status %d '%s'", what, mode, bad,
                  st, err);
            bitsplit_counters c;
            bitsplit_ctx_get_counters(ctx, &c);
            CHECK((c.n_errors > 0) == (bad == 1), "%s: n_errors %" PRIu64, what, c.n_errors);
            if (!bad) {
                CHECK(c.n_get_rows == 1, "%s: n_get_rows %" PRIu64, what, c.n_get_rows);
                const float * rows = R->data;
                for (int i = 0; i < NIDS; i++) {
                    const float * want = (mode ? mt->ronly : mt->w) + (size_t)idv[i] * K;
                    int64_t diff = 0; /* exact values (0 + -0 is +0: not memcmp) */
                    for (int64_t k = 0; k < K; k++) diff += rows[(size_t)i * K + k] != want[k];
                    CHECK(diff == 0, "%s mode=%d: row %d (id %d) differs in %" PRId64 " elements", what, mode, i,
                          idv[i], diff);
                }
            }
            bitsplit_ctx_set_enabled(ctx, false);
            bitsplit_eval_callback(R, true, ctx); /* restore */
            CHECK(R->op == GGML_OP_GET_ROWS, "%s: restored", what);
        }
    }
    bitsplit_ctx_set_mode(ctx, BITSPLIT_MODE_AUTO);
    ggml_backend_buffer_free(buf);
    ggml_free(g);
}

/* experts: dst[:, i, t] = (W2_e + R_e) . x[:, i % ne11, t], e = ids[i, t] */
static void test_callback_mul_mat_id(bitsplit_ctx * ctx, const model * m, const mtensor * mt) {
    const int64_t K = mt->K, N = mt->N, E = mt->E;
    enum { NUSED = 2, NTOK = 5 };
    struct ggml_init_params ip = {.mem_size = 16 * ggml_tensor_overhead(), .mem_buffer = NULL, .no_alloc = true};
    struct ggml_context * g = ggml_init(ip);
    struct ggml_tensor * W = ggml_new_tensor_3d(g, (enum ggml_type)mt->b->type, K, N, E);
    ggml_set_name(W, mt->r->name);
    struct ggml_tensor * X = ggml_new_tensor_3d(g, GGML_TYPE_F32, K, 1, NTOK);
    struct ggml_tensor * ids = ggml_new_tensor_2d(g, GGML_TYPE_I32, NUSED, NTOK);
    struct ggml_tensor * Y = ggml_mul_mat_id(g, W, X, ids);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(g, ggml_backend_cpu_buffer_type());
    CHECK(buf != NULL, "allocating CPU tensors");
    if (buf == NULL) {
        ggml_free(g);
        return;
    }
    ggml_backend_tensor_set(W, m->base.b + mt->b->abs, 0, ggml_nbytes(W));
    float * x = malloc((size_t)(K * NTOK) * sizeof(float));
    make_x(x, K * NTOK, 99);
    ggml_backend_tensor_set(X, x, 0, ggml_nbytes(X));
    int32_t idv[NUSED * NTOK];
    for (int i = 0; i < NUSED * NTOK; i++) idv[i] = (int32_t)((i * 7 + i / NUSED) % E);
    ggml_backend_tensor_set(ids, idv, 0, sizeof(idv));
    char what[256];
    snprintf(what, sizeof(what), "callback MUL_MAT_ID %s", mt->r->name);
    bitsplit_ctx_set_enabled(ctx, true);
    bitsplit_ctx_reset_counters(ctx);
    CHECK(bitsplit_eval_callback(Y, true, ctx) == false && Y->op == GGML_OP_CUSTOM, "%s: not replaced", what);
    double * ref = malloc((size_t)N * sizeof(double));
    double * A = malloc((size_t)N * sizeof(double));
    float * y1 = malloc(ggml_nbytes(Y));
    const int eff = effective_precision(BITSPLIT_PREC_AUTO, mt);
    for (int nth = 1; nth <= 3; nth++) {
        memset(Y->data, 0, ggml_nbytes(Y));
        if (!run_custom(Y, nth)) break;
        if (nth == 1) {
            memcpy(y1, Y->data, ggml_nbytes(Y));
            for (int t = 0; t < NTOK; t++) {
                for (int i = 0; i < NUSED; i++) {
                    const int e = idv[t * NUSED + i];
                    reference(mt->w + (size_t)e * N * K, K, N, x + (size_t)t * K, 1, ref, A);
                    const float * y = (const float *)((const char *)Y->data + i * Y->nb[1] + t * Y->nb[2]);
                    double ratio;
                    int64_t where;
                    CHECK(excess(y, ref, A, N, rel_tol(eff), 1e-5, &ratio, &where) <= 0,
                          "%s: token %d slot %d (expert %d) result", what, t, i, e);
                }
            }
        } else {
            CHECK(memcmp(Y->data, y1, ggml_nbytes(Y)) == 0, "%s: %d threads differ from 1", what, nth);
        }
    }
    char err[512];
    CHECK(bitsplit_ctx_take_error(ctx, err, sizeof(err)) == BITSPLIT_OK, "%s: error '%s'", what, err);
    bitsplit_ctx_set_enabled(ctx, false);
    bitsplit_eval_callback(Y, true, ctx);
    CHECK(Y->op == GGML_OP_MUL_MAT_ID, "%s: restored", what);
    free(x);
    free(ref);
    free(A);
    free(y1);
    ggml_backend_buffer_free(buf);
    ggml_free(g);
}

/* ---------------------------------------------------------------------------------------------
 * attention (batch-invariant verification): KQ, softmax, KQV through the callback
 * ------------------------------------------------------------------------------------------- */

#define AT_HD 40    /* head dimension: not a multiple of 32 (blocks of 8) */
#define AT_NH 4     /* query heads */
#define AT_NKV 2    /* KV heads (two query heads each) */
#define AT_NV 29    /* cells row 0 sees */

static float at_val(uint64_t a, uint64_t b, uint64_t c) { /* a deterministic value in [-1, 1) */
    uint64_t s = (a * 0x9e3779b97f4a7c15ull) ^ (b * 0xc2b2ae3d27d4eb4full) ^ (c * 0x165667b19e3779f9ull) ^ 0x5bd1e995;
    s ^= s >> 31;
    s *= 0xbf58476d1ce4e5b9ull;
    s ^= s >> 29;
    return (float)((double)(s >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

/* the node of attention whose scratch allocation attn_case makes fail (0 KQ, 1 softmax, 2 KQV; -1:
 * none): test_custom_ops_out_of_memory */
static int g_attn_fail = -1;
static void attn_out_of_memory(bitsplit_ctx * ctx, struct ggml_tensor ** nodes, int which);

/* One attention over a cache of n_kv cells where row 0's visible cells j < AT_NV sit at cell_of[j]
 * (in increasing order) and every other cell is junk that row 0 does not see; n rows (the others
 * see random cells). Row 0's output, [AT_HD x AT_NH], goes to out. Returns false if not run. */
static bool attn_case(bitsplit_ctx * ctx, int n_kv, int n, const int * cell_of, int nth, float * out, double * err) {
    struct ggml_init_params ip = {.mem_size = 16 * ggml_tensor_overhead(), .mem_buffer = NULL, .no_alloc = true};
    struct ggml_context * g = ggml_init(ip);
    /* the caches are views, as llama.cpp's are (a weight never is) */
    struct ggml_tensor * Kall = ggml_new_tensor_3d(g, GGML_TYPE_F16, AT_HD, n_kv, AT_NKV);
    struct ggml_tensor * Kc = ggml_view_3d(g, Kall, AT_HD, n_kv, AT_NKV, Kall->nb[1], Kall->nb[2], 0);
    struct ggml_tensor * q0 = ggml_new_tensor_3d(g, GGML_TYPE_F32, AT_HD, AT_NH, n);
    struct ggml_tensor * q = ggml_permute(g, q0, 0, 2, 1, 3); /* [hd, n, heads], as llama.cpp's */
    struct ggml_tensor * kq = ggml_mul_mat(g, Kc, q);
    struct ggml_tensor * mask = ggml_new_tensor_2d(g, GGML_TYPE_F32, n_kv, n);
    const float scale = 0.125f;
    struct ggml_tensor * sm = ggml_soft_max_ext(g, kq, mask, scale, 0.0f);
    struct ggml_tensor * Vall = ggml_new_tensor_3d(g, GGML_TYPE_F16, n_kv, AT_HD, AT_NKV);
    struct ggml_tensor * Vt = ggml_view_3d(g, Vall, n_kv, AT_HD, AT_NKV, Vall->nb[1], Vall->nb[2], 0);
    struct ggml_tensor * kqv = ggml_mul_mat(g, Vt, sm);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(g, ggml_backend_cpu_buffer_type());
    CHECK(buf != NULL, "attention: allocating CPU tensors");
    if (buf == NULL) {
        ggml_free(g);
        return false;
    }
    int * logical = malloc((size_t)n_kv * sizeof(int)); /* cell -> visible index, or -1 */
    for (int c = 0; c < n_kv; c++) logical[c] = -1;
    for (int j = 0; j < AT_NV; j++) logical[cell_of[j]] = j;
    ggml_fp16_t * kd = malloc(ggml_nbytes(Kc));
    ggml_fp16_t * vd = malloc(ggml_nbytes(Vt));
    for (int h = 0; h < AT_NKV; h++) {
        for (int c = 0; c < n_kv; c++) {
            const uint64_t id = logical[c] >= 0 ? (uint64_t)logical[c] : 1000 + (uint64_t)c; /* junk: other values */
            for (int d = 0; d < AT_HD; d++) {
                kd[((size_t)h * n_kv + c) * AT_HD + d] = ggml_fp32_to_fp16(2.0f * at_val(1, id * 64 + h, d));
                vd[((size_t)h * AT_HD + d) * n_kv + c] = ggml_fp32_to_fp16(at_val(2, id * 64 + h, d));
            }
        }
    }
    float * qd = malloc(ggml_nbytes(q0));
    for (int r = 0; r < n; r++)
        for (int h = 0; h < AT_NH; h++)
            for (int d = 0; d < AT_HD; d++) qd[((size_t)r * AT_NH + h) * AT_HD + d] = 3.0f * at_val(3, (uint64_t)(r == 0 ? 0 : 100 + r * 7 + n), (uint64_t)h * 1000 + d);
    float * md = malloc(ggml_nbytes(mask));
    for (int r = 0; r < n; r++)
        for (int c = 0; c < n_kv; c++) md[(size_t)r * n_kv + c] = (r == 0 ? logical[c] >= 0 : at_val(4, (uint64_t)r, (uint64_t)c) > -0.3f) ? 0.0f : -INFINITY;
    ggml_backend_tensor_set(Kall, kd, 0, ggml_nbytes(Kall));
    ggml_backend_tensor_set(Vall, vd, 0, ggml_nbytes(Vall));
    ggml_backend_tensor_set(q0, qd, 0, ggml_nbytes(q0));
    ggml_backend_tensor_set(mask, md, 0, ggml_nbytes(mask));
    bool ok = true;
    struct ggml_tensor * nodes[3] = {kq, sm, kqv};
    if (g_attn_fail >= 0) {
        attn_out_of_memory(ctx, nodes, g_attn_fail);
        ok = false; /* no reference to compare with */
    }
    for (int i = 0; i < 3 && ok; i++) {
        const bool asked = bitsplit_eval_callback(nodes[i], true, ctx);
        ok = !asked && nodes[i]->op == GGML_OP_CUSTOM;
        CHECK(ok, "attention: node %d (%s) not replaced", i, ggml_op_name(nodes[i]->op));
        if (ok) run_custom(nodes[i], nth);
    }
    if (ok) {
        /* row 0 against a float64 reference */
        double worst = 0.0, mag = 0.0;
        for (int h = 0; h < AT_NH; h++) {
            const int hk = h / (AT_NH / AT_NKV);
            double sc[AT_NV], mx = -1e300, sum = 0.0;
            for (int j = 0; j < AT_NV; j++) {
                double dot = 0.0;
                for (int d = 0; d < AT_HD; d++)
                    dot += (double)ggml_fp16_to_fp32(kd[((size_t)hk * n_kv + cell_of[j]) * AT_HD + d]) * qd[(size_t)h * AT_HD + d];
                sc[j] = dot * scale;
                mx = sc[j] > mx ? sc[j] : mx;
            }
            for (int j = 0; j < AT_NV; j++) sum += exp(sc[j] - mx);
            for (int d = 0; d < AT_HD; d++) {
                double y = 0.0;
                for (int j = 0; j < AT_NV; j++)
                    y += exp(sc[j] - mx) / sum * ggml_fp16_to_fp32(vd[((size_t)hk * AT_HD + d) * n_kv + cell_of[j]]);
                const float got = ((const float *)kqv->data)[(size_t)h * n * AT_HD + d]; /* [hd, n, heads], row 0 */
                out[h * AT_HD + d] = got;
                worst = fabs(got - y) > worst ? fabs(got - y) : worst;
                mag = fabs(y) > mag ? fabs(y) : mag;
            }
        }
        *err = worst / (mag > 0 ? mag : 1.0);
        bitsplit_counters c;
        bitsplit_ctx_get_counters(ctx, &c);
        CHECK(c.n_errors == 0, "attention: %llu errors recorded", (unsigned long long)c.n_errors);
    }
    free(logical);
    free(kd);
    free(vd);
    free(qd);
    free(md);
    ggml_backend_buffer_free(buf);
    ggml_free(g);
    return ok;
}

static void test_callback_attention(bitsplit_ctx * ctx) {
    CHECK(bitsplit_ctx_set_mode(ctx, BITSPLIT_MODE_AUTO) == BITSPLIT_OK, "attention: set_mode auto");
    bitsplit_ctx_set_enabled(ctx, true);
    bitsplit_ctx_set_batch_invariant(ctx, true);
    bitsplit_ctx_reset_counters(ctx);
    /* layouts of row 0's cells: contiguous from 0; after 3 junk cells; interleaved with junk */
    int contiguous[AT_NV], shifted[AT_NV], holes[AT_NV];
    for (int j = 0; j < AT_NV; j++) {
        contiguous[j] = j;
        shifted[j] = j + 3;
        holes[j] = j + j / 2 + j / 5 + 1;
    }
    const int n_kv_holes = holes[AT_NV - 1] + 4;
    float ref[AT_HD * AT_NH], got[AT_HD * AT_NH];
    double e;
    if (attn_case(ctx, AT_NV, 1, contiguous, 1, ref, &e)) {
        CHECK(e < 1e-5, "attention: row 0 off the float64 reference by %.3g of its largest value", e);
        static const struct { int n_kv, n, nth; int which; } cases[] = {
            {AT_NV, 2, 1, 0}, {AT_NV, 7, 3, 0}, {AT_NV + 40, 33, 2, 0}, {AT_NV + 3, 1, 1, 1}, {AT_NV + 3, 5, 2, 1},
            {0, 1, 1, 2}, {0, 9, 3, 2}, {0, 64, 2, 2},
        };
        for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
            const int * layout = cases[i].which == 0 ? contiguous : cases[i].which == 1 ? shifted : holes;
            const int n_kv = cases[i].which == 2 ? n_kv_holes : cases[i].n_kv;
            if (attn_case(ctx, n_kv, cases[i].n, layout, cases[i].nth, got, &e)) {
                CHECK(memcmp(got, ref, sizeof(ref)) == 0,
                      "attention: row 0 differs with %d rows, %d cells (layout %d), %d threads", cases[i].n, n_kv,
                      cases[i].which, cases[i].nth);
            }
        }
        bitsplit_counters c;
        bitsplit_ctx_get_counters(ctx, &c);
        CHECK(c.n_attn_products > 0 && c.n_softmax > 0, "attention: counters %llu products, %llu softmaxes",
              (unsigned long long)c.n_attn_products, (unsigned long long)c.n_softmax);
    }
    /* the SIMD kernels against the portable ones, bit for bit (zeros among the weights) */
#if defined(__x86_64__)
    if (bs_family_named("avx2-f32") != NULL) { /* the CPU runs AVX2 + FMA + F16C (and the cap allows it) */
        enum { K = 45, M = 37, T = 40, N = 5 };
        float * t = calloc((size_t)K * T, sizeof(float));
        float b[N * K], y1[N * M], y2[N * M];
        for (int k = 0; k < K; k++)
            for (int i = 0; i < M; i++) t[k * T + i] = at_val(5, (uint64_t)k, (uint64_t)i);
        for (int i = 0; i < N * K; i++) b[i] = i % 7 == 3 ? 0.0f : at_val(6, (uint64_t)i, 0);
        for (int k = 0; k < K; k++) b[k] = b[K + k] = k % 3 ? 0.0f : b[k]; /* columns 0, 1: zero at the same k */
        const bs_attn_args a = {.t = t, .t_row = T, .b = (const char *)b, .b_col = K * sizeof(float),
                                .y = (char *)y1, .y_col = M * sizeof(float), .K = K, .M = M};
        bs_attn_args a2 = a;
        a2.y = (char *)y2;
        bs_attn_product_avx2(&a, 0, N);
        bs_attn_product_generic(&a2, 0, N);
        CHECK(memcmp(y1, y2, sizeof(y1)) == 0, "attention: avx2 product differs from the portable one");
        bs_attn_product_avx2(&a2, 1, 2); /* one column alone: the same as within a pair */
        CHECK(memcmp(y1, y2, sizeof(y1)) == 0, "attention: avx2 product of one column differs");
        float x[77], e1[77], e2[77];
        for (int i = 0; i < 77; i++) x[i] = i == 3 ? -INFINITY : 60.0f * at_val(7, (uint64_t)i, 0) - 30.0f;
        bs_attn_exp_row_avx2(x, e1, 77, 1.5f);
        bs_attn_exp_row_generic(x, e2, 77, 1.5f);
        CHECK(memcmp(e1, e2, sizeof(e1)) == 0, "attention: avx2 exponentials differ from the portable ones");
        for (int i = 0; i < 77; i++) {
            const float arg = x[i] - 1.5f; /* the kernel's argument, rounded as it rounds it */
            const double want = arg == -INFINITY || arg < -87.0f ? 0.0 : exp((double)arg);
            CHECK(fabs(e1[i] - want) <= 3e-7 * want, "attention: exp(%g) = %.9g, want %.9g", arg, e1[i], want);
        }
        free(t);
    }
#endif
}

/* A custom op that cannot allocate its per-thread scratch (attention's products and softmax, the
 * embedding lookup; the kernel families' own scratch: test_scratch_out_of_memory): an out-of-memory
 * error naming the node and the scratch, the rows it could not compute NaN (never the stale values
 * the node held), and the op computed in full once memory is back. Each case on a fresh context, whose
 * scratch is still empty: the op's own allocation is the first one. */
static bool load_fresh(const model * m, bitsplit_ctx ** ctx) {
    char err[512] = "";
    *ctx = NULL;
    const bool ok = bitsplit_ctx_load(m->res_path, m->base_path, ctx, err, sizeof(err)) == BITSPLIT_OK;
    CHECK(ok, "%s: load: %s", m->dir, err);
    return ok;
}

/* the error of a failed scratch allocation in node t: out of memory, naming t and the scratch */
static void check_oom_error(bitsplit_ctx * ctx, const char * node, const char * what) {
    char err[512] = "";
    const int st = bitsplit_ctx_take_error(ctx, err, sizeof(err));
    CHECK(st == BITSPLIT_E_NOMEM && strstr(err, node) != NULL && strstr(err, "scratch") != NULL,
          "%s: a failed scratch allocation gave status %d '%s' (out of memory naming '%s' and the scratch wanted)",
          what, st, err, node);
}

/* how many of t's n f32 values are NaN, and how many still hold the stale 12345 */
static void count_nan_stale(const struct ggml_tensor * t, size_t * nans, size_t * stale) {
    const float * y = t->data;
    const size_t n = (size_t)ggml_nelements(t);
    *nans = *stale = 0;
    for (size_t i = 0; i < n; i++) {
        *nans += isnan(y[i]);
        *stale += y[i] == 12345.0f;
    }
}

static void fill_stale(struct ggml_tensor * t) {
    float * y = t->data;
    for (int64_t i = 0; i < ggml_nelements(t); i++) y[i] = 12345.0f;
}

static void attn_out_of_memory(bitsplit_ctx * ctx, struct ggml_tensor ** nodes, int which) {
#if HAVE_ALLOC_FAULTS
    static const char * const names[3] = {"oom-kq", "oom-softmax", "oom-kqv"};
    for (int i = 0; i < 3; i++) {
        ggml_set_name(nodes[i], names[i]);
        const bool asked = bitsplit_eval_callback(nodes[i], true, ctx);
        CHECK(!asked && nodes[i]->op == GGML_OP_CUSTOM, "attention out of memory: node %s not replaced", names[i]);
        if (nodes[i]->op != GGML_OP_CUSTOM) return;
        if (i < 2) memset(nodes[i]->data, 0, ggml_nbytes(nodes[i])); /* the next node's input, not computed here */
    }
    struct ggml_tensor * t = nodes[which];
    fill_stale(t);
    atomic_store(&g_memalign_fail_in, 1);
    run_custom(t, 1);
    atomic_store(&g_memalign_fail_in, 0);
    check_oom_error(ctx, names[which], "attention out of memory");
    size_t nans, stale;
    count_nan_stale(t, &nans, &stale);
    CHECK(nans == (size_t)ggml_nelements(t) && stale == 0, "%s out of scratch memory: %zu NaN, %zu stale of %lld",
          names[which], nans, stale, (long long)ggml_nelements(t));
    /* memory back: the same op computes every output */
    fill_stale(t);
    run_custom(t, 1);
    char err[512] = "";
    CHECK(bitsplit_ctx_take_error(ctx, err, sizeof(err)) == BITSPLIT_OK, "%s after memory is back: %s", names[which],
          err);
    count_nan_stale(t, &nans, &stale);
    CHECK(nans == 0 && stale == 0, "%s after memory is back: %zu NaN, %zu stale", names[which], nans, stale);
#else
    (void)ctx;
    (void)nodes;
    (void)which;
#endif
}

static void get_rows_out_of_memory(const model * m, const mtensor * mt, int mode) {
#if HAVE_ALLOC_FAULTS
    bitsplit_ctx * ctx;
    if (!load_fresh(m, &ctx)) return;
    const int64_t K = mt->K, N = mt->N;
    enum { NIDS = 5 };
    struct ggml_context * g;
    ggml_backend_buffer_t buf;
    struct ggml_tensor * ids;
    struct ggml_tensor * R = get_rows_node(m, mt, NIDS, &g, &buf, &ids);
    if (R != NULL) {
        const int32_t idv[NIDS] = {0, (int32_t)(N - 1), 3 % (int32_t)N, 1 % (int32_t)N, (int32_t)(N / 2)};
        ggml_backend_tensor_set(ids, idv, 0, sizeof(idv));
        bitsplit_ctx_set_mode(ctx, mode ? BITSPLIT_MODE_ADD : BITSPLIT_MODE_AUTO);
        bitsplit_ctx_set_enabled(ctx, true);
        char what[256];
        snprintf(what, sizeof(what), "embedding lookup of %s out of memory (%s)", mt->r->name, mode ? "add" : "replace");
        for (int round = 0; round < 2; round++) { /* the allocation failing, then memory back */
            fill_stale(R);
            if (mode == 0) {
                CHECK(bitsplit_eval_callback(R, true, ctx) == false && R->op == GGML_OP_CUSTOM, "%s: not replaced", what);
            } else {
                CHECK(bitsplit_eval_callback(R, true, ctx) == true && R->op == GGML_OP_GET_ROWS, "%s: add observes", what);
            }
            atomic_store(&g_memalign_fail_in, round == 0 ? 1 : 0);
            if (mode == 0) {
                run_custom(R, 1);
            } else {
                bitsplit_eval_callback(R, false, ctx);
            }
            atomic_store(&g_memalign_fail_in, 0);
            size_t nans, stale;
            count_nan_stale(R, &nans, &stale);
            if (round == 0) {
                if (mode == 0) {
                    check_oom_error(ctx, mt->r->name, what);
                } else { /* add mode's host buffers, not a kernel's scratch */
                    char err[512] = "";
                    const int st = bitsplit_ctx_take_error(ctx, err, sizeof(err));
                    CHECK(st == BITSPLIT_E_NOMEM && strstr(err, mt->r->name) != NULL, "%s: status %d '%s'", what, st, err);
                }
                CHECK(nans == (size_t)(NIDS * K) && stale == 0, "%s: %zu NaN, %zu stale of %lld", what, nans, stale,
                      (long long)(NIDS * K));
            } else if (mode == 0) { /* add mode adds R to the node's W2 rows: stale values here */
                char err[512] = "";
                CHECK(bitsplit_ctx_take_error(ctx, err, sizeof(err)) == BITSPLIT_OK, "%s, memory back: %s", what, err);
                int64_t diff = 0;
                const float * rows = R->data;
                for (int i = 0; i < NIDS; i++)
                    for (int64_t k = 0; k < K; k++) diff += rows[(size_t)i * K + k] != mt->w[(size_t)idv[i] * K + k];
                CHECK(diff == 0, "%s, memory back: %lld values differ", what, (long long)diff);
            }
            bitsplit_ctx_set_enabled(ctx, false);
            bitsplit_eval_callback(R, true, ctx); /* restore */
            bitsplit_ctx_set_enabled(ctx, true);
        }
        ggml_backend_buffer_free(buf);
        ggml_free(g);
    }
    bitsplit_ctx_free(ctx);
#else
    (void)m;
    (void)mt;
    (void)mode;
#endif
}

static void test_custom_ops_out_of_memory(const model * m) {
#if HAVE_ALLOC_FAULTS
    int contiguous[AT_NV];
    for (int j = 0; j < AT_NV; j++) contiguous[j] = j;
    float out[AT_HD * AT_NH];
    double e;
    for (int which = 0; which < 3; which++) {
        bitsplit_ctx * ctx;
        if (!load_fresh(m, &ctx)) return;
        bitsplit_ctx_set_enabled(ctx, true);
        bitsplit_ctx_set_batch_invariant(ctx, true);
        g_attn_fail = which;
        attn_case(ctx, AT_NV + 5, 3, contiguous, 1, out, &e);
        g_attn_fail = -1;
        bitsplit_ctx_free(ctx);
    }
    const mtensor * t = pick(m, false, "token_embd.weight");
    if (t != NULL && strcmp(t->r->name, "token_embd.weight") == 0) {
        get_rows_out_of_memory(m, t, 0);
        get_rows_out_of_memory(m, t, 1);
    }
#else
    (void)m;
#endif
}

static void test_callback(const model * m) {
    char err[512] = "";
    bitsplit_ctx * ctx = NULL;
    if (bitsplit_ctx_load(m->res_path, m->base_path, &ctx, err, sizeof(err)) != BITSPLIT_OK) {
        CHECK(false, "%s: load for the callback test: %s", m->dir, err);
        return;
    }
    bitsplit_ctx_set_threads(ctx, 2);
    const mtensor * t = pick(m, false, "blk.0.attn_q.weight");
    if (t != NULL) {
        test_callback_mul_mat(ctx, m, t, 1);
        test_callback_mul_mat(ctx, m, t, 5);
        test_callback_mul_mat(ctx, m, t, 40);
    }
    const mtensor * e = pick(m, false, "token_embd.weight");
    if (e != NULL && strcmp(e->r->name, "token_embd.weight") == 0) test_callback_get_rows(ctx, m, e);
    const mtensor * x = pick(m, true, NULL);
    if (x != NULL) test_callback_mul_mat_id(ctx, m, x);
    test_callback_attention(ctx);
    bitsplit_ctx_free(ctx);
}

/* ---------------------------------------------------------------------------------------------
 * well-formed files with unusual layouts: general.alignment 1..16 (tensor data at odd addresses)
 * ------------------------------------------------------------------------------------------- */

static void put_bytes(uint8_t * b, size_t * pos, const void * src, size_t n) {
    memcpy(b + *pos, src, n);
    *pos += n;
}

/* f rewritten with general.alignment = align (added, or replaced) and its tensors packed with that
 * alignment; with `odd`, a padding key makes the data start at an odd offset. Returns the size. */
static size_t realign(const gfile * f, uint32_t align, bool odd, uint8_t ** out) {
    size_t data_bytes = 0;
    for (uint64_t i = 0; i < f->n_tensors; i++) data_bytes += f->ti[i].nbytes + align;
    const size_t cap = f->header_end + 256 + data_bytes + align;
    uint8_t * b = calloc(1, cap);
    const kv_at * old_align = find_kv(f, "general.alignment");
    for (int pad = 0; pad < 3; pad++) {
        size_t pos = 0;
        memcpy(b, f->b, 8); /* magic, version */
        pos = 8;
        put_bytes(b, &pos, &f->n_tensors, 8);
        const uint64_t n_kv = f->n_kv + (old_align ? 0 : 1) + (pad > 0 ? 1 : 0);
        put_bytes(b, &pos, &n_kv, 8);
        const size_t kv_end = f->n_tensors > 0 ? f->ti[0].len_pos : f->header_end;
        put_bytes(b, &pos, f->b + 24, kv_end - 24);
        if (old_align != NULL) memcpy(b + old_align->val_pos, &align, 4);
        else {
            const uint64_t kl = strlen("general.alignment");
            const uint32_t vt = GGUF_TYPE_UINT32;
            put_bytes(b, &pos, &kl, 8);
            put_bytes(b, &pos, "general.alignment", kl);
            put_bytes(b, &pos, &vt, 4);
            put_bytes(b, &pos, &align, 4);
        }
        if (pad > 0) { /* "t.p" or "t.pp" = u8 0: 16 or 17 bytes */
            const uint64_t kl = pad == 1 ? 3 : 4;
            const uint32_t vt = GGUF_TYPE_UINT8;
            const uint8_t zero = 0;
            put_bytes(b, &pos, &kl, 8);
            put_bytes(b, &pos, "t.pp", kl);
            put_bytes(b, &pos, &vt, 4);
            put_bytes(b, &pos, &zero, 1);
        }
        uint64_t off = 0;
        for (uint64_t i = 0; i < f->n_tensors; i++) {
            const ti_at * t = &f->ti[i];
            put_bytes(b, &pos, f->b + t->len_pos, t->off_pos - t->len_pos);
            put_bytes(b, &pos, &off, 8);
            off += (t->nbytes + align - 1) / align * align;
        }
        if (odd && align == 1 && pos % 2 == 0 && pad < 2) continue; /* try another padding key */
        pos = (pos + align - 1) / align * align;
        for (uint64_t i = 0; i < f->n_tensors; i++) {
            const ti_at * t = &f->ti[i];
            put_bytes(b, &pos, f->b + t->abs, t->nbytes);
            if (i + 1 < f->n_tensors) pos = (pos + align - 1) / align * align;
        }
        *out = b;
        return pos;
    }
    *out = b;
    return 0;
}

static void test_realigned(const model * m, const char * work, bool quick) {
    char err[512];
    bitsplit_ctx * ref_ctx = NULL;
    if (bitsplit_ctx_load(m->res_path, m->base_path, &ref_ctx, err, sizeof(err)) != BITSPLIT_OK) {
        CHECK(false, "load for the realigned test: %s", err);
        return;
    }
    float * x = malloc((size_t)MAX_COLS * 2048 * sizeof(float));
    float * y0 = malloc((size_t)MAX_COLS * 4096 * sizeof(float));
    float * y1 = malloc((size_t)MAX_COLS * 4096 * sizeof(float));
    const uint32_t aligns[] = {1, 2, 8, 64};
    for (size_t ai = 0; ai < sizeof(aligns) / sizeof(aligns[0]); ai++) {
        for (int which = 0; which < 2; which++) { /* 0: residual realigned, 1: base realigned */
            const gfile * f = which ? &m->base : &m->res;
            uint8_t * b = NULL;
            const size_t n = realign(f, aligns[ai], true, &b);
            char path[PATH_MAX + 64], what[128];
            snprintf(path, sizeof(path), "%.4000s/realigned-%s-%u.gguf", work, which ? "base" : "residual", aligns[ai]);
            snprintf(what, sizeof(what), "%s with general.alignment %u", which ? "base" : "residual", aligns[ai]);
            CHECK(n > 0 && write_all(path, b, n), "%s: cannot write", what);
            free(b);
            gfile g;
            const bool parsed = gfile_open(&g, path);
            CHECK(parsed && g.alignment == aligns[ai] && (aligns[ai] != 1 || g.data_offset % 2 == 1),
                  "%s: the rewritten file has alignment %zu, data at %zu", what, g.alignment, g.data_offset);
            vlog("  %s: data at offset %zu\n", what, g.data_offset);
            gfile_close(&g);
            bitsplit_ctx * ctx = NULL;
            const int st = which ? bitsplit_ctx_load(m->res_path, path, &ctx, err, sizeof(err))
                                 : bitsplit_ctx_load(path, m->base_path, &ctx, err, sizeof(err));
            CHECK(st == BITSPLIT_OK, "%s: refused: %s", what, err);
            if (st == BITSPLIT_OK) {
                /* the same tensors: the same products, bit for bit, in every family */
                for (int fi = 0; fi < N_FAMILIES; fi++) {
                    if (!g_family_ok[fi]) continue;
                    bitsplit_ctx_set_kernel(ref_ctx, FAMILIES[fi]);
                    bitsplit_ctx_set_kernel(ctx, FAMILIES[fi]);
                    for (int ti = 0; ti < m->nt; ti++) {
                        const mtensor * t = &m->t[ti];
                        if (t->E != 1 || t->K > 2048 || t->N > 4096) continue;
                        /* at F32 precision every family runs the generic one: once is enough */
                        if (fi > 0 && effective_precision(BITSPLIT_PREC_AUTO, t) == BITSPLIT_PREC_F32) continue;
                        for (int ci = 0; ci < (quick ? 1 : 2); ci++) {
                            const int nc = quick ? 17 : ci ? 40 : 3;
                            make_x(x, nc * t->K, (uint64_t)ti + 7);
                            const int s0 = bitsplit_ctx_matmul(ref_ctx, t->r->name, x, nc, y0, true);
                            const int s1 = bitsplit_ctx_matmul(ctx, t->r->name, x, nc, y1, true);
                            CHECK(s0 == BITSPLIT_OK && s1 == BITSPLIT_OK &&
                                      memcmp(y0, y1, (size_t)nc * t->N * sizeof(float)) == 0,
                                  "%s: %s family %s cols %d differs from the original layout", what, t->r->name,
                                  FAMILIES[fi], nc);
                        }
                    }
                }
                bitsplit_ctx_free(ctx);
            }
            unlink(path);
        }
    }
    free(x);
    free(y0);
    free(y1);
    bitsplit_ctx_free(ref_ctx);
}

/* ---------------------------------------------------------------------------------------------
 * corrupted files
 * ------------------------------------------------------------------------------------------- */

typedef struct {
    long strict_refused, strict_accepted, lenient_accepted, lenient_refused;
    long by_status[8];
} corrupt_stats;

static corrupt_stats g_cs;
static char g_case_path[PATH_MAX];

/* an accepted file must still be usable: every 2-D tensor's product runs */
static void smoke(bitsplit_ctx * ctx, const char * what) {
    const int64_t n = bitsplit_ctx_n_tensors(ctx);
    for (int64_t i = 0; i < n; i++) {
        const char * name;
        int64_t ne[4];
        int bt, rt;
        if (bitsplit_ctx_tensor_info(ctx, i, &name, ne, &bt, &rt) != BITSPLIT_OK) {
            CHECK(false, "%s: tensor_info %" PRId64, what, i);
            continue;
        }
        if (ne[2] != 1 || ne[3] != 1 || ne[0] > 8192 || ne[1] > 8192) continue;
        float * x = calloc((size_t)ne[0] * 2, sizeof(float));
        float * y = calloc((size_t)ne[1] * 2, sizeof(float));
        for (int64_t k = 0; k < ne[0] * 2; k++) x[k] = (float)((k % 7) - 3) * 0.25f;
        const int st = bitsplit_ctx_matmul(ctx, name, x, 2, y, true);
        CHECK(st == BITSPLIT_OK, "%s: accepted file, but the product of %s fails: %d", what, name, st);
        free(x);
        free(y);
    }
}

/* strict: must be refused. lenient: refused, or accepted and usable. */
static void try_case(const char * res, const char * base, bool strict, const char * what) {
    char err[512];
    err[0] = '\0';
    bitsplit_ctx * ctx = (bitsplit_ctx *)0x1;
    const int st = bitsplit_ctx_load(res, base, &ctx, err, sizeof(err));
    if (st >= 0 && st < 8) g_cs.by_status[st]++;
    if (st == BITSPLIT_OK) {
        CHECK(ctx != NULL && ctx != (bitsplit_ctx *)0x1, "%s: OK without a context", what);
        if (strict) {
            g_cs.strict_accepted++;
            CHECK(false, "%s: corrupt file accepted", what);
        } else {
            g_cs.lenient_accepted++;
        }
        vlog("  accepted: %s\n", what);
        if (ctx != NULL && ctx != (bitsplit_ctx *)0x1) {
            smoke(ctx, what);
            bitsplit_ctx_free(ctx);
        }
        return;
    }
    if (strict) g_cs.strict_refused++;
    else g_cs.lenient_refused++;
    CHECK(ctx == NULL, "%s: refused (%d) but *out not NULL", what, st);
    CHECK(err[0] != '\0' && strlen(err) < sizeof(err), "%s: refused without a message", what);
    CHECK(st == BITSPLIT_E_IO || st == BITSPLIT_E_FORMAT || st == BITSPLIT_E_MISMATCH || st == BITSPLIT_E_UNSUPPORTED,
          "%s: unexpected status %d (%s)", what, st, err);
    vlog("  refused (%d): %s: %s\n", st, what, err);
}

/* The case file is rewritten only where it differs from the previous case (most cases change a
 * few header bytes of a file of megabytes). */
static uint8_t * g_prev;
static size_t g_prev_n;
static bool g_prev_ok;

static bool update_case_file(const uint8_t * b, size_t n) {
    if (!g_prev_ok) {
        free(g_prev);
        g_prev = malloc(n ? n : 1);
        if (g_prev == NULL || !write_all(g_case_path, b, n)) return false;
        memcpy(g_prev, b, n);
        g_prev_n = n;
        g_prev_ok = true;
        return true;
    }
    const size_t common = n < g_prev_n ? n : g_prev_n;
    size_t lo = 0, hi = common;
    /* memcmp over chunks first: byte loops are slow under ASan */
    while (lo + 4096 <= common && memcmp(b + lo, g_prev + lo, 4096) == 0) lo += 4096;
    while (lo < common && b[lo] == g_prev[lo]) lo++;
    while (hi >= lo + 4096 && memcmp(b + hi - 4096, g_prev + hi - 4096, 4096) == 0) hi -= 4096;
    while (hi > lo && b[hi - 1] == g_prev[hi - 1]) hi--;
    int fd = open(g_case_path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return false;
    bool ok = true;
    if (hi > lo) ok = pwrite(fd, b + lo, hi - lo, (off_t)lo) == (ssize_t)(hi - lo);
    if (ok && n > g_prev_n) ok = pwrite(fd, b + g_prev_n, n - g_prev_n, (off_t)g_prev_n) == (ssize_t)(n - g_prev_n);
    if (ok && n != g_prev_n) ok = ftruncate(fd, (off_t)n) == 0;
    ok = (close(fd) == 0) && ok;
    if (!ok) {
        g_prev_ok = false;
        return false;
    }
    if (n > g_prev_n) {
        uint8_t * p = realloc(g_prev, n);
        if (p == NULL) {
            g_prev_ok = false;
            return true; /* the file is right; the copy is rebuilt next time */
        }
        g_prev = p;
    }
    memcpy(g_prev + lo, b + lo, hi > lo ? hi - lo : 0);
    if (n > g_prev_n) memcpy(g_prev + g_prev_n, b + g_prev_n, n - g_prev_n);
    g_prev_n = n;
    return true;
}

/* write `b` with the mutation applied to the case file and try it as residual (or base) */
static void run_bytes(const model * m, const uint8_t * b, size_t n, bool as_base, bool strict, const char * what) {
    if (!update_case_file(b, n)) {
        CHECK(false, "cannot write %s", g_case_path);
        return;
    }
    if (as_base) {
        try_case(m->res_path, g_case_path, strict, what);
    } else {
        try_case(g_case_path, m->base_path, strict, what);
    }
}

typedef struct {
    uint8_t * b;
    size_t n;
} buf_t;

/* one reusable buffer for the copies (a fresh multi-megabyte allocation per case is slow under ASan) */
static uint8_t * g_scratch;
static size_t g_scratch_cap;

static buf_t copy_of(const gfile * f) {
    if (g_scratch_cap < f->n) {
        free(g_scratch);
        g_scratch = malloc(f->n);
        g_scratch_cap = g_scratch ? f->n : 0;
    }
    buf_t c = {g_scratch, f->n};
    if (c.b == NULL) {
        fprintf(stderr, "test_native: out of memory\n");
        exit(1);
    }
    memcpy(c.b, f->b, f->n);
    return c;
}

static void done_with(buf_t * c) {
    if (c->b != g_scratch) free(c->b);
    c->b = NULL;
}

static void put(buf_t * c, size_t pos, uint64_t v, int bytes) {
    if (pos + (size_t)bytes <= c->n) memcpy(c->b + pos, &v, (size_t)bytes);
}

/* one field of a fresh copy set to v, tried, undone */
static void field(const model * m, const gfile * f, bool as_base, size_t pos, int bytes, uint64_t v, bool strict,
                  const char * fmt, ...) {
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    snprintf(what + (k < 200 ? k : 200), sizeof(what) - (size_t)(k < 200 ? k : 200), " = %#" PRIx64 " (%s)", v,
             as_base ? "base" : "residual");
    buf_t c = copy_of(f);
    put(&c, pos, v, bytes);
    run_bytes(m, c.b, c.n, as_base, strict, what);
    done_with(&c);
}

static void test_corrupt(const model * m, int n_flips, uint64_t seed) {
    const gfile * r = &m->res;
    const double t0 = now_s();
    char what[256];

    /* truncation: every length through the header and the first data, then spread over the data */
    const size_t head = r->data_offset + 300 < r->n ? r->data_offset + 300 : r->n - 1;
    for (size_t len = 0; len <= head; len++) {
        snprintf(what, sizeof(what), "residual truncated to %zu of %zu bytes", len, r->n);
        run_bytes(m, r->b, len, false, true, what);
    }
    for (int i = 1; i <= 96; i++) {
        const size_t len = head + (r->n - head) * (size_t)i / 97;
        snprintf(what, sizeof(what), "residual truncated to %zu of %zu bytes", len, r->n);
        run_bytes(m, r->b, len, false, true, what);
    }
    for (size_t cut = 1; cut <= 64; cut *= 2) {
        snprintf(what, sizeof(what), "residual missing its last %zu bytes", cut);
        run_bytes(m, r->b, r->n - cut, false, true, what);
    }
    const gfile * b = &m->base;
    for (size_t len = 0; len < b->data_offset + 64 && len < b->n; len += 13) {
        snprintf(what, sizeof(what), "base truncated to %zu of %zu bytes", len, b->n);
        run_bytes(m, b->b, len, true, true, what);
    }
    for (int i = 1; i <= 24; i++) {
        const size_t len = b->data_offset + (b->n - b->data_offset) * (size_t)i / 25;
        snprintf(what, sizeof(what), "base truncated to %zu of %zu bytes", len, b->n);
        run_bytes(m, b->b, len, true, true, what);
    }
    snprintf(what, sizeof(what), "base missing its last byte");
    run_bytes(m, b->b, b->n - 1, true, true, what);
    vlog("  truncations done (%.2fs)\n", now_s() - t0);

    /* absurd header fields (strict: every one of these must be refused) */
    field(m, r, false, 0, 4, 0x47554746u, true, "magic");
    field(m, r, false, 0, 4, 0, true, "magic");
    const uint64_t bad_versions[] = {0, 1, 4, 0xffffffffu, 0x03000000u};
    for (size_t i = 0; i < sizeof(bad_versions) / sizeof(bad_versions[0]); i++) {
        field(m, r, false, 4, 4, bad_versions[i], true, "version");
    }
    const uint64_t huge[] = {UINT64_MAX, 1ull << 63, 1ull << 40, 1ull << 32, (1ull << 20) + 1, r->n};
    for (size_t i = 0; i < sizeof(huge) / sizeof(huge[0]); i++) {
        field(m, r, false, 8, 8, huge[i], true, "tensor count");
        field(m, r, false, 16, 8, huge[i], true, "key/value count");
    }
    field(m, r, false, 8, 8, r->n_tensors + 1, false, "tensor count + 1");
    field(m, r, false, 8, 8, r->n_tensors - 1, false, "tensor count - 1");
    field(m, r, false, 8, 8, 0, false, "tensor count 0");
    field(m, r, false, 16, 8, r->n_kv + 1, false, "key/value count + 1");
    field(m, r, false, 16, 8, r->n_kv - 1, false, "key/value count - 1");
    field(m, r, false, 16, 8, 0, true, "key/value count 0");

    for (uint64_t i = 0; i < r->n_kv; i++) {
        const kv_at * k = &r->kv[i];
        const uint64_t bad_len[] = {UINT64_MAX, 1ull << 40, r->n, r->n - k->key_pos + 1};
        for (size_t j = 0; j < sizeof(bad_len) / sizeof(bad_len[0]); j++) {
            field(m, r, false, k->len_pos, 8, bad_len[j], true, "length of key '%s'", k->key);
        }
        field(m, r, false, k->len_pos, 8, 0, false, "length of key '%s'", k->key);
        field(m, r, false, k->len_pos, 8, k->key_len + 1, false, "length of key '%s' + 1", k->key);
        const uint64_t bad_types[] = {13, 255, 0xffffffffu, 0x80000008u};
        for (size_t j = 0; j < sizeof(bad_types) / sizeof(bad_types[0]); j++) {
            field(m, r, false, k->type_pos, 4, bad_types[j], true, "type of key '%s'", k->key);
        }
        for (uint32_t vt = 0; vt < 13; vt++) {
            if (vt != k->type) field(m, r, false, k->type_pos, 4, vt, false, "type of key '%s'", k->key);
        }
        if (k->type == GGUF_TYPE_STRING) {
            const uint64_t bad_slen[] = {UINT64_MAX, 1ull << 40, r->n, (1ull << 63) + 5};
            for (size_t j = 0; j < sizeof(bad_slen) / sizeof(bad_slen[0]); j++) {
                field(m, r, false, k->val_pos, 8, bad_slen[j], true, "length of the value of '%s'", k->key);
            }
        }
    }
    const kv_at * fv = find_kv(r, "bitsplit.format_version");
    CHECK(fv != NULL && fv->type == GGUF_TYPE_UINT32, "residual has bitsplit.format_version (u32)");
    if (fv != NULL) {
        field(m, r, false, fv->val_pos, 4, 0, true, "format version");
        field(m, r, false, fv->val_pos, 4, 2, true, "format version");
        field(m, r, false, fv->val_pos, 4, 0xffffffffu, true, "format version");
        field(m, r, false, fv->type_pos, 4, GGUF_TYPE_INT32, true, "format version type int32");
        field(m, r, false, fv->type_pos, 4, GGUF_TYPE_FLOAT32, true, "format version type float32");
        field(m, r, false, fv->key_pos + 3, 1, 'X', true, "format version key renamed");
    }

    for (uint64_t i = 0; i < r->n_tensors; i++) {
        const ti_at * t = &r->ti[i];
        const char * nm = t->name;
        field(m, r, false, t->len_pos, 8, UINT64_MAX, true, "name length of '%s'", nm);
        field(m, r, false, t->len_pos, 8, 1ull << 40, true, "name length of '%s'", nm);
        field(m, r, false, t->len_pos, 8, GGML_MAX_NAME, false, "name length of '%s'", nm);
        field(m, r, false, t->len_pos, 8, 0, false, "name length of '%s'", nm);
        field(m, r, false, t->name_pos, 1, 'Z', true, "name of '%s' (first byte)", nm);
        field(m, r, false, t->name_pos + t->name_len - 1, 1, 0, false, "name of '%s' (NUL in last byte)", nm);
        /* another tensor's name of the same length: a duplicate */
        for (uint64_t j = 0; j < r->n_tensors; j++) {
            if (j != i && r->ti[j].name_len == t->name_len) {
                buf_t c = copy_of(r);
                memcpy(c.b + t->name_pos, r->ti[j].name, t->name_len);
                snprintf(what, sizeof(what), "tensor '%s' renamed to '%s' (duplicate)", nm, r->ti[j].name);
                run_bytes(m, c.b, c.n, false, true, what);
                done_with(&c);
                break;
            }
        }
        const uint64_t bad_nd[] = {0, 5, 0xffffffffu, 1ull << 31};
        for (size_t j = 0; j < sizeof(bad_nd) / sizeof(bad_nd[0]); j++) {
            field(m, r, false, t->ndims_pos, 4, bad_nd[j], bad_nd[j] != 0, "dimension count of '%s'", nm);
        }
        const uint64_t bad_ne0[] = {0, UINT64_MAX, 1ull << 62, 1ull << 40, (uint64_t)t->ne[0] + 1,
                                    (uint64_t)t->ne[0] * 2, (uint64_t)t->ne[0] / 2};
        for (size_t j = 0; j < sizeof(bad_ne0) / sizeof(bad_ne0[0]); j++) {
            field(m, r, false, t->dims_pos, 8, bad_ne0[j], true, "ne0 of '%s'", nm);
        }
        if (t->n_dims >= 2) {
            const uint64_t bad_ne1[] = {0, UINT64_MAX, (uint64_t)INT64_MAX, 1ull << 40, (uint64_t)t->ne[1] - 1,
                                        (uint64_t)t->ne[1] + 1};
            for (size_t j = 0; j < sizeof(bad_ne1) / sizeof(bad_ne1[0]); j++) {
                field(m, r, false, t->dims_pos + 8, 8, bad_ne1[j], true, "ne1 of '%s'", nm);
            }
            if (t->ne[0] != t->ne[1]) { /* same byte count, other shape */
                buf_t c = copy_of(r);
                put(&c, t->dims_pos, (uint64_t)t->ne[1], 8);
                put(&c, t->dims_pos + 8, (uint64_t)t->ne[0], 8);
                snprintf(what, sizeof(what), "'%s' dims swapped", nm);
                run_bytes(m, c.b, c.n, false, true, what);
                done_with(&c);
            }
        }
        const uint64_t bad_type[] = {GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q4_0, GGML_TYPE_Q8_0, GGML_TYPE_Q6_K,
                                     GGML_TYPE_Q2_K, GGML_TYPE_BF16, 4, GGML_TYPE_COUNT, GGML_TYPE_COUNT + 1, 1000,
                                     0xffffffffu, 0x80000000u};
        for (size_t j = 0; j < sizeof(bad_type) / sizeof(bad_type[0]); j++) {
            if (bad_type[j] == t->type) continue;
            /* the last tensor may take a residual type of no more bytes and still fit the file: a
             * well-formed file with other data (trailing bytes are allowed), nothing to refuse */
            const bool res_type = bad_type[j] == GGML_TYPE_F32 || bad_type[j] == GGML_TYPE_F16 ||
                                  bad_type[j] == GGML_TYPE_Q8_0 || bad_type[j] == GGML_TYPE_Q6_K;
            const bool fits = res_type && ggml_row_size((enum ggml_type)bad_type[j], t->ne[0]) <=
                                              ggml_row_size((enum ggml_type)t->type, t->ne[0]);
            field(m, r, false, t->type_pos, 4, bad_type[j], !(fits && i + 1 == r->n_tensors), "type of '%s'", nm);
        }
        const uint64_t bad_off[] = {t->off + 1, t->off + 16, t->off + 32, UINT64_MAX, UINT64_MAX - 31,
                                    1ull << 63, (uint64_t)r->n, (uint64_t)r->n - r->data_offset,
                                    (uint64_t)(0 - r->data_offset)};
        for (size_t j = 0; j < sizeof(bad_off) / sizeof(bad_off[0]); j++) {
            field(m, r, false, t->off_pos, 8, bad_off[j], true, "offset of '%s'", nm);
        }
        if (i > 0) field(m, r, false, t->off_pos, 8, r->ti[i - 1].off, true, "offset of '%s' = previous tensor's", nm);
    }
    /* the base, too: types and shapes of a tensor that has a residual */
    if (m->nt > 0) {
        const ti_at * bt = m->t[0].b;
        const uint64_t bad_type[] = {GGML_TYPE_COUNT, 1000, 0xffffffffu, GGML_TYPE_F32};
        for (size_t j = 0; j < sizeof(bad_type) / sizeof(bad_type[0]); j++) {
            field(m, b, true, bt->type_pos, 4, bad_type[j], true, "base type of '%s'", bt->name);
        }
        field(m, b, true, bt->dims_pos, 8, 0, true, "base ne0 of '%s'", bt->name);
        field(m, b, true, bt->off_pos, 8, UINT64_MAX - 31, true, "base offset of '%s'", bt->name);
        field(m, b, true, bt->name_pos, 1, 'Z', true, "base name of '%s'", bt->name);
    }
    vlog("  header fields done (%.2fs)\n", now_s() - t0);

    /* random damage: byte flips in the header region, inserted/removed bytes, data damage */
    g_rng = seed * 0x2545f4914f6cdd1dull + 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < n_flips; i++) {
        buf_t c = copy_of(r);
        const int kind = (int)(rnd() % 10);
        size_t n = c.n;
        if (kind < 6) { /* 1..4 bytes in the header set to random / flipped / extreme values */
            const int nb = 1 + (int)(rnd() % 4);
            for (int j = 0; j < nb; j++) {
                const size_t pos = (size_t)(rnd() % r->header_end);
                const int how = (int)(rnd() % 4);
                c.b[pos] = how == 0 ? (uint8_t)rnd() : how == 1 ? (uint8_t)(c.b[pos] ^ (1u << (rnd() % 8)))
                                                   : how == 2 ? 0xff : 0x00;
            }
            snprintf(what, sizeof(what), "random header damage #%d (%d bytes)", i, nb);
        } else if (kind < 7) { /* a byte inserted in the header */
            const size_t pos = (size_t)(rnd() % r->header_end);
            uint8_t * nbuf = malloc(c.n + 1);
            memcpy(nbuf, c.b, pos);
            nbuf[pos] = (uint8_t)rnd();
            memcpy(nbuf + pos + 1, c.b + pos, c.n - pos);
            done_with(&c);
            c.b = nbuf;
            n = c.n + 1;
            snprintf(what, sizeof(what), "byte inserted at %zu (#%d)", pos, i);
        } else if (kind < 8) { /* bytes removed from the header */
            const size_t pos = (size_t)(rnd() % r->header_end);
            const size_t cnt = 1 + (size_t)(rnd() % 8);
            const size_t end = pos + cnt < c.n ? pos + cnt : c.n;
            memmove(c.b + pos, c.b + end, c.n - end);
            n = c.n - (end - pos);
            snprintf(what, sizeof(what), "%zu bytes removed at %zu (#%d)", end - pos, pos, i);
        } else if (kind < 9) { /* a 64-bit field-sized overwrite with an extreme value */
            const size_t pos = (size_t)(rnd() % (r->header_end - 8));
            const uint64_t vals[] = {UINT64_MAX, 1ull << 63, 1ull << 40, 0, 0xffffffffu, (uint64_t)r->n};
            put(&c, pos, vals[rnd() % 6], 1 + (int)(rnd() % 8));
            snprintf(what, sizeof(what), "extreme value at %zu (#%d)", pos, i);
        } else { /* tensor data damage: accepted (data is not checked), must stay usable */
            const int nb = 1 + (int)(rnd() % 64);
            for (int j = 0; j < nb; j++) {
                const size_t pos = r->data_offset + (size_t)(rnd() % (r->n - r->data_offset));
                c.b[pos] = (uint8_t)rnd();
            }
            snprintf(what, sizeof(what), "random data damage #%d (%d bytes)", i, nb);
        }
        run_bytes(m, c.b, n, false, false, what);
        done_with(&c);
    }
    vlog("  random damage done (%.2fs)\n", now_s() - t0);
}

/* ---------------------------------------------------------------------------------------------
 * main
 * ------------------------------------------------------------------------------------------- */

static void usage(void) {
    fprintf(stderr, "usage: test_native MODEL_DIR [--bad FILE]... [--any FILE]... [--flips N] [--seed N] [--work DIR] "
                    "[--quick] [--selftest-oob] [-v]\n");
}

/* How many pool threads a product gets (add mode, bitsplit_ctx_matmul): one per
 * BS_THREAD_MIN_BYTES of weights, counted up to 4x as columns grow, within 1 .. n_threads. A
 * product smaller than that on every thread waited on the slowest of them to wake: 3.8 ms instead
 * of 53 us for a 118 KB residual on 2 busy cores. */
static void test_thread_sizing(const model * m) {
    char err[512];
    bitsplit_ctx * ctx = NULL;
    if (bitsplit_ctx_load(m->res_path, m->base_path, &ctx, err, sizeof(err)) != BITSPLIT_OK) {
        CHECK(false, "thread sizing: load: %s", err);
        return;
    }
    CHECK(bitsplit_ctx_set_threads(ctx, 8) == BITSPLIT_OK, "thread sizing: 8 threads");
    bs_job job;
    memset(&job, 0, sizeof(job));
    uint8_t dummy = 0;
    job.r = &dummy;
    job.r_row_bytes = 1024;
    job.n_cols = 1;
    const int64_t per = BS_THREAD_MIN_BYTES / 1024; /* rows that make one thread's share */
    static const struct { int64_t rows; int cols; bool base; int want; } cases[] = {
        {1, 1, false, 1}, {0, 1, false, 1}, {2, 1, false, 2}, {3, 1, false, 3}, {8, 1, false, 8},
        {100, 1, false, 8}, {1, 5, false, 2}, {1, 13, false, 4}, {1, 64, false, 4}, {1, 1, true, 2},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        job.N = cases[i].rows * per;
        job.n_cols = cases[i].cols;
        job.w2 = cases[i].base ? &dummy : NULL;
        job.w2_row_bytes = cases[i].base ? 1024 : 0;
        const int got = bs_threads_for_min(ctx, &job, BS_THREAD_MIN_BYTES);
        CHECK(got == cases[i].want, "thread sizing: %lld x %d KB rows (%d columns%s): %d threads, expected %d",
              (long long)job.N, (int)(job.r_row_bytes / 1024), cases[i].cols, cases[i].base ? ", with base" : "",
              got, cases[i].want);
    }
    CHECK(bitsplit_ctx_set_threads(ctx, 1) == BITSPLIT_OK, "thread sizing: 1 thread");
    job.N = 100 * per;
    CHECK(bs_threads_for_min(ctx, &job, BS_THREAD_MIN_BYTES) == 1, "thread sizing: never more than the context's threads");
    CHECK(bitsplit_ctx_set_threads(ctx, 8) == BITSPLIT_OK && bs_threads_for_min(ctx, &job, 0) == 8,
          "thread sizing: 0 bytes per thread means every thread");
    bitsplit_ctx_free(ctx);
}

/* bs_k4_scales_mins (all of Q4_K / Q5_K's scales and mins at once, which the integer families
 * take) against bs_k4_scale_min (one index, the reference layout): every value of each of the 12
 * bytes with the others random, and random blocks */
/* native/arch/<arch>/cpu_feats.c against the compiler's own tests of this CPU (libgcc's
 * __builtin_cpu_supports, which the families used before cpu_feats.c; on AArch64 the auxiliary vector) */
static void test_cpu_feats(void) {
    const uint32_t f = bs_cpu_feats();
    CHECK(bs_cpu_feats() == f, "cpu_feats: a second call differs");
#if defined(__x86_64__)
    __builtin_cpu_init();
    static const struct { uint32_t bit; const char * name; } cases[] = {
        {BS_CPU_AVX2, "avx2"}, {BS_CPU_FMA, "fma"}, {BS_CPU_F16C, "f16c"}, {BS_CPU_AVX512F, "avx512f"},
        {BS_CPU_AVX512BW, "avx512bw"}, {BS_CPU_AVX512VL, "avx512vl"}, {BS_CPU_AVX512DQ, "avx512dq"},
        {BS_CPU_AVX512VNNI, "avx512vnni"},
    };
    const int has[sizeof(cases) / sizeof(cases[0])] = {
        __builtin_cpu_supports("avx2"), __builtin_cpu_supports("fma"), __builtin_cpu_supports("f16c"),
        __builtin_cpu_supports("avx512f"), __builtin_cpu_supports("avx512bw"), __builtin_cpu_supports("avx512vl"),
        __builtin_cpu_supports("avx512dq"), __builtin_cpu_supports("avx512vnni"),
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        CHECK(((f & cases[i].bit) != 0) == (has[i] != 0), "cpu_feats: %s %d, libgcc says %d", cases[i].name,
              (f & cases[i].bit) != 0, has[i] != 0);
    }
    CHECK(!(f & (BS_CPU_NEON | BS_CPU_DOTPROD)), "cpu_feats: ARM features on x86-64 (%#x)", f);
    CHECK(!(f & BS_CPU_HALF_RATE_512) || (f & BS_CPU_AVX512F), "cpu_feats: half rate without AVX-512 (%#x)", f);
    CHECK(!bs_cpu_amx_ready() || bs_cpu_has(BS_CPU_NEED_AVX512_BF16 | BS_CPU_AMX_TILE | BS_CPU_AMX_BF16),
          "cpu_feats: AMX ready without the features (%#x)", f);
#elif defined(__aarch64__)
    CHECK((f & BS_CPU_NEON) != 0, "cpu_feats: no Advanced SIMD on AArch64 (%#x)", f);
    CHECK(((f & BS_CPU_DOTPROD) != 0) == ((getauxval(AT_HWCAP) & (1 << 20)) != 0), "cpu_feats: dot product %#x", f);
    CHECK(!bs_cpu_amx_ready(), "cpu_feats: AMX on AArch64");
#endif
    vlog("  cpu_feats %#x\n", f);
}

/* bitsplit_family_peak (native/peak.c; the steps in native/arch/<arch>/peak.c): a finite positive
 * rate for every family this CPU runs (under the cap: the library's list), and none for an unknown name, a NULL one, another
 * architecture's family or a bad duration; the time it takes is about the duration asked */
static void test_family_peaks(void) {
#if defined(__x86_64__) || defined(__aarch64__)
    const char * names[16];
    const int n = bitsplit_kernel_families(names, 16);
    CHECK(n >= 1, "peaks: no family listed");
    for (int i = 0; i < n && i < 16; i++) {
        const double t0 = now_s();
        const double p = bitsplit_family_peak(names[i], 0.005);
        const double dt = now_s() - t0;
        CHECK(isfinite(p) && p > 0.0, "peak of %s: %g (a family this CPU runs)", names[i], p);
        /* sanitized builds run the steps several times slower: a generous bound on the time */
        CHECK(dt < 5.0, "peak of %s took %.2f s for 0.005 s asked", names[i], dt);
        vlog("  peak %-16s %8.2f G weight.column MAC/s (%.1f ms)\n", names[i], p / 1e9, 1e3 * dt);
    }
    CHECK(bitsplit_family_peak("no-such-family", 0.005) < 0.0, "peak of an unknown family");
    CHECK(bitsplit_family_peak("", 0.005) < 0.0, "peak of an empty name");
    CHECK(bitsplit_family_peak(NULL, 0.005) < 0.0, "peak of NULL");
    CHECK(bitsplit_family_peak("generic", 0.0) < 0.0, "peak with 0 s");
    CHECK(bitsplit_family_peak("generic", -1.0) < 0.0, "peak with -1 s");
    CHECK(bitsplit_family_peak("generic", NAN) < 0.0, "peak with NaN s");
    CHECK(bitsplit_family_peak("generic", 1e9) < 0.0, "peak with 1e9 s");
#if defined(__x86_64__)
    CHECK(bitsplit_family_peak("neon-f32", 0.005) < 0.0, "peak of an AArch64 family on x86-64");
    if (!bs_cpu_has(BS_CPU_AMX_TILE | BS_CPU_AMX_BF16)) {
        CHECK(bitsplit_family_peak("amx-bf16", 0.005) == 0.0, "peak of amx-bf16 without AMX");
    }
    if (!bs_cpu_has(BS_CPU_NEED_AVX512_BF16)) {
        CHECK(bitsplit_family_peak("avx512-bf16", 0.005) == 0.0, "peak of avx512-bf16 without AVX512-BF16");
    }
#else
    CHECK(bitsplit_family_peak("avx2-f32", 0.005) < 0.0, "peak of an x86 family on AArch64");
    if (!bs_cpu_has(BS_CPU_DOTPROD)) {
        CHECK(bitsplit_family_peak("neon-int16", 0.005) == 0.0, "peak of neon-int16 without the dot product");
    }
#endif
#endif
}

/* bitsplit_set_measured_policy (kernels.c): the measured family first for the batches its steps cover,
 * the built-in order past them and for the other kind, refusals that change nothing, a family the
 * CPU does not run passed over, n = 0 back to the built-in order */
static void test_measured_policy(void) {
    const char * names[16];
    const int n = bitsplit_kernel_families(names, 16);
    if (n < 3) {
        vlog("  measured policy: %d families, nothing to reorder\n", n);
        return;
    }
    const char * last = names[n - 2]; /* the last SIMD family of the one-column order (generic is last) */
    char builtin1[32], builtin40[32], alone2[32];
    snprintf(builtin1, sizeof(builtin1), "%s", bitsplit_kernel_for_batch(1, false));
    snprintf(builtin40, sizeof(builtin40), "%s", bitsplit_kernel_for_batch(40, false));
    snprintf(alone2, sizeof(alone2), "%s", bitsplit_kernel_for_batch(2, true));
    CHECK(strcmp(builtin1, last) != 0, "measured policy: %s is already first", last);
    const int64_t cols[2] = {4, 16};
    const char * fams[2] = {last, names[0]};
    CHECK(bitsplit_set_measured_policy(false, cols, fams, 2) == BITSPLIT_OK, "measured policy: a good table refused");
    CHECK(strcmp(bitsplit_kernel_for_batch(1, false), last) == 0 && strcmp(bitsplit_kernel_for_batch(4, false), last) == 0,
          "measured policy: %s not first to 4 columns (%s)", last, bitsplit_kernel_for_batch(1, false));
    CHECK(strcmp(bitsplit_kernel_for_batch(5, false), names[0]) == 0, "measured policy: step 2 not taken");
    CHECK(strcmp(bitsplit_kernel_for_batch(40, false), builtin40) == 0, "measured policy: past the last step");
    CHECK(strcmp(bitsplit_kernel_for_batch(2, true), alone2) == 0, "measured policy: the other kind's table changed");
    const char * got[4] = {0};
    int64_t gcols[4] = {0};
    CHECK(bitsplit_measured_policy(false, gcols, got, 4) == 2 && gcols[0] == 4 && gcols[1] == 16 &&
              strcmp(got[0], last) == 0 && strcmp(got[1], names[0]) == 0, "measured policy: read back");
    CHECK(bitsplit_measured_policy(true, gcols, got, 4) == 0, "measured policy: R alone's table set");
    /* refusals: the table in force stays */
    const int64_t down[2] = {16, 4}, zero[1] = {0};
    const char * unknown[1] = {"no-such-family"}, * null_name[1] = {NULL};
    int64_t many[17];
    const char * many_f[17];
    for (int i = 0; i < 17; i++) {
        many[i] = i + 1;
        many_f[i] = last;
    }
    CHECK(bitsplit_set_measured_policy(false, down, fams, 2) == BITSPLIT_E_INVALID, "measured policy: descending cols");
    CHECK(bitsplit_set_measured_policy(false, zero, fams, 1) == BITSPLIT_E_INVALID, "measured policy: 0 columns");
    CHECK(bitsplit_set_measured_policy(false, cols, null_name, 1) == BITSPLIT_E_INVALID, "measured policy: NULL name");
    CHECK(bitsplit_set_measured_policy(false, NULL, NULL, 1) == BITSPLIT_E_INVALID, "measured policy: NULL arrays");
    CHECK(bitsplit_set_measured_policy(false, many, many_f, 17) == BITSPLIT_E_INVALID, "measured policy: 17 steps");
    CHECK(bitsplit_set_measured_policy(false, cols, fams, -1) == BITSPLIT_E_INVALID, "measured policy: n = -1");
    CHECK(bitsplit_set_measured_policy(false, cols, unknown, 1) == BITSPLIT_E_UNSUPPORTED, "measured policy: unknown");
    CHECK(bitsplit_measured_policy(false, NULL, NULL, 0) == 2 && strcmp(bitsplit_kernel_for_batch(1, false), last) == 0,
          "measured policy: a refused table changed the one in force");
#if defined(__x86_64__)
    /* a family of this build the CPU does not run: passed over, the built-in order instead */
    const char * absent = !bs_cpu_has(BS_CPU_AMX_TILE | BS_CPU_AMX_BF16) ? "amx-bf16" : NULL;
    if (absent != NULL) {
        CHECK(bitsplit_set_measured_policy(false, cols, &absent, 1) == BITSPLIT_OK, "measured policy: amx-bf16 refused");
        CHECK(strcmp(bitsplit_kernel_for_batch(1, false), builtin1) == 0, "measured policy: a family this CPU lacks");
    }
#endif
    CHECK(bitsplit_set_measured_policy(false, NULL, NULL, 0) == BITSPLIT_OK, "measured policy: clearing refused");
    CHECK(strcmp(bitsplit_kernel_for_batch(1, false), builtin1) == 0, "measured policy: not cleared");
}

static void test_k4_scales(void) {
    uint32_t st = 12345u;
    long bad = 0;
    for (int it = 0; it < 12 * 256 + 4096; it++) {
        uint8_t q[12];
        for (int i = 0; i < 12; i++) {
            st = st * 1664525u + 1013904223u;
            q[i] = (uint8_t)(st >> 24);
        }
        if (it < 12 * 256) q[it / 256] = (uint8_t)(it % 256);
        uint64_t s8, m8;
        bs_k4_scales_mins(q, &s8, &m8);
        for (int j = 0; j < 8; j++) {
            uint8_t s1, m1;
            bs_k4_scale_min(j, q, &s1, &m1);
            if (s1 != (uint8_t)(s8 >> (8 * j)) || m1 != (uint8_t)(m8 >> (8 * j))) bad++;
        }
    }
    CHECK(bad == 0, "bs_k4_scales_mins differs from bs_k4_scale_min in %ld values", bad);
}

/* The importance-matrix collector on hand-made products: what it asks for, its sums and counts
 * against a plain computation, copy names, bad activations, shape mismatches and expert ids. */
static void test_imatrix(void) {
    enum { K = 40, N = 6, ROWS = 20, E = 3, NUSED = 2 };
    struct ggml_init_params ip = {.mem_size = 32 * ggml_tensor_overhead(), .mem_buffer = NULL, .no_alloc = true};
    struct ggml_context * g = ggml_init(ip);
    struct ggml_tensor * W = ggml_new_tensor_2d(g, GGML_TYPE_F32, K, N);
    ggml_set_name(W, "CPU#blk.3.ffn_up.weight#0");
    struct ggml_tensor * X = ggml_new_tensor_2d(g, GGML_TYPE_F32, K, ROWS);
    struct ggml_tensor * Y = ggml_mul_mat(g, W, X);
    struct ggml_tensor * Xs = ggml_new_tensor_2d(g, GGML_TYPE_F32, K, 15); /* too few rows */
    struct ggml_tensor * Ys = ggml_mul_mat(g, W, Xs);
    struct ggml_tensor * Wo = ggml_new_tensor_2d(g, GGML_TYPE_F32, K, N);
    ggml_set_name(Wo, "output.weight");
    struct ggml_tensor * Yo = ggml_mul_mat(g, Wo, X);
    struct ggml_tensor * Ww = ggml_new_tensor_2d(g, GGML_TYPE_F32, 2 * K, N); /* same name, other width */
    ggml_set_name(Ww, "blk.3.ffn_up.weight");
    struct ggml_tensor * Xw = ggml_new_tensor_2d(g, GGML_TYPE_F32, 2 * K, ROWS);
    struct ggml_tensor * Yw = ggml_mul_mat(g, Ww, Xw);
    struct ggml_tensor * We = ggml_new_tensor_3d(g, GGML_TYPE_F32, K, N, E);
    ggml_set_name(We, "blk.0.ffn_up_exps.weight");
    struct ggml_tensor * Xe = ggml_new_tensor_3d(g, GGML_TYPE_F32, K, 1, ROWS);
    struct ggml_tensor * ids = ggml_new_tensor_2d(g, GGML_TYPE_I32, NUSED, ROWS);
    struct ggml_tensor * Ye = ggml_mul_mat_id(g, We, Xe, ids);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(g, ggml_backend_cpu_buffer_type());
    CHECK(buf != NULL, "imatrix: allocating CPU tensors");
    bitsplit_imatrix * im = NULL;
    CHECK(bitsplit_imatrix_new(&im) == BITSPLIT_OK && im != NULL, "imatrix: new");
    CHECK(bitsplit_imatrix_new(NULL) == BITSPLIT_E_INVALID, "imatrix: new(NULL)");
    if (buf == NULL || im == NULL) {
        bitsplit_imatrix_free(im);
        ggml_free(g);
        return;
    }
    float * x = (float *)X->data;
    make_x(x, K * ROWS, 7);
    make_x((float *)Xe->data, K * ROWS, 8);
    CHECK(bitsplit_imatrix_callback(NULL, true, im) == false && bitsplit_imatrix_callback(Y, true, NULL) == false &&
          bitsplit_imatrix_callback(Y, false, NULL) == true, "imatrix: NULL arguments");
    CHECK(bitsplit_imatrix_callback(X, true, im) == false, "imatrix: a non-product node is not asked for");
    CHECK(bitsplit_imatrix_callback(Ys, true, im) == false, "imatrix: a pass of 15 rows is not collected");
    CHECK(bitsplit_imatrix_callback(Yo, true, im) == false, "imatrix: the output head is not collected");
    for (int pass = 0; pass < 2; pass++) {
        CHECK(bitsplit_imatrix_callback(Y, true, im) == true && bitsplit_imatrix_callback(Y, false, im) == true,
              "imatrix: a layer product is collected (pass %d)", pass);
    }
    CHECK(bitsplit_imatrix_n_entries(im) == 1 && bitsplit_imatrix_n_products(im) == 2, "imatrix: one entry, two products");
    const char * name = NULL;
    int64_t k = 0, nm = 0, counts[E] = {0};
    double sums[K * E];
    CHECK(bitsplit_imatrix_entry(im, 0, &name, &k, &nm, sums, counts) == BITSPLIT_OK && name != NULL &&
          strcmp(name, "blk.3.ffn_up.weight") == 0 && k == K && nm == 1 && counts[0] == 2 * ROWS,
          "imatrix: entry named after the weight, not its copy ('%s', %lld x %lld, count %lld)", name ? name : "",
          (long long)nm, (long long)k, (long long)counts[0]);
    double worst = 0;
    for (int j = 0; j < K; j++) {
        double want = 0;
        for (int r = 0; r < ROWS; r++) want += 2.0 * (double)x[r * K + j] * (double)x[r * K + j];
        worst = fmax(worst, fabs(sums[j] - want) / fmax(want, 1e-30));
    }
    CHECK(worst < 1e-12, "imatrix: sums of squares (relative error %g)", worst);
    CHECK(bitsplit_imatrix_entry(im, 1, NULL, NULL, NULL, NULL, NULL) == BITSPLIT_E_INVALID &&
          bitsplit_imatrix_entry(im, -1, NULL, NULL, NULL, NULL, NULL) == BITSPLIT_E_INVALID,
          "imatrix: entry index out of range");
    char msg[512];
    CHECK(bitsplit_imatrix_take_error(im, msg, sizeof msg) == BITSPLIT_OK && msg[0] == '\0', "imatrix: no error yet");

    /* the same weight at another width: refused, named, and the entry left as it was */
    CHECK(bitsplit_imatrix_callback(Yw, true, im) == true && bitsplit_imatrix_callback(Yw, false, im) == true,
          "imatrix: mismatch continues the graph");
    CHECK(bitsplit_imatrix_take_error(im, msg, sizeof msg) == BITSPLIT_E_MISMATCH && strstr(msg, "blk.3.ffn_up") != NULL,
          "imatrix: width mismatch recorded ('%s')", msg);
    CHECK(bitsplit_imatrix_take_error(im, msg, sizeof msg) == BITSPLIT_OK, "imatrix: error cleared once taken");

    /* a NaN activation: recorded with the weight's name; nothing after it in that product counted */
    x[3 * K + 5] = NAN;
    bitsplit_imatrix_callback(Y, false, im);
    CHECK(bitsplit_imatrix_take_error(im, msg, sizeof msg) == BITSPLIT_E_STATE && strstr(msg, "NaN") != NULL,
          "imatrix: NaN recorded ('%s')", msg);
    bitsplit_imatrix_entry(im, 0, NULL, NULL, NULL, NULL, counts);
    CHECK(counts[0] == 2 * ROWS + 3, "imatrix: rows before the NaN counted (%lld)", (long long)counts[0]);

    /* experts: ids routed per token and slot; an id out of range is refused before any read */
    int32_t * idv = (int32_t *)ids->data;
    int64_t want_counts[E] = {0};
    for (int i = 0; i < NUSED * ROWS; i++) {
        idv[i] = (int32_t)((i * 5 + i / 3) % E);
        want_counts[idv[i]]++;
    }
    CHECK(bitsplit_imatrix_callback(Ye, true, im) == true && bitsplit_imatrix_callback(Ye, false, im) == true,
          "imatrix: expert product collected");
    int64_t ei = -1;
    for (int64_t i = 0; i < bitsplit_imatrix_n_entries(im); i++) {
        bitsplit_imatrix_entry(im, i, &name, NULL, NULL, NULL, NULL);
        if (strcmp(name, "blk.0.ffn_up_exps.weight") == 0) ei = i;
    }
    CHECK(ei >= 0 && bitsplit_imatrix_entry(im, ei, NULL, &k, &nm, sums, counts) == BITSPLIT_OK && nm == E && k == K,
          "imatrix: expert entry %lld x %lld", (long long)nm, (long long)k);
    const float * xe = (const float *)Xe->data;
    worst = 0;
    for (int e = 0; e < E; e++) {
        CHECK(counts[e] == want_counts[e], "imatrix: expert %d count %lld, expected %lld", e, (long long)counts[e],
              (long long)want_counts[e]);
        for (int j = 0; j < K; j++) {
            double want = 0;
            for (int t = 0; t < ROWS; t++)
                for (int s = 0; s < NUSED; s++)
                    if (idv[t * NUSED + s] == e) want += (double)xe[t * K + j] * (double)xe[t * K + j];
            worst = fmax(worst, fabs(sums[e * K + j] - want) / fmax(want, 1e-30));
        }
    }
    CHECK(worst < 1e-12, "imatrix: expert sums (relative error %g)", worst);
    idv[7] = E;
    bitsplit_imatrix_callback(Ye, false, im);
    CHECK(bitsplit_imatrix_take_error(im, msg, sizeof msg) == BITSPLIT_E_INVALID && strstr(msg, "out of range") != NULL,
          "imatrix: expert id out of range refused ('%s')", msg);
    idv[7] = -1;
    bitsplit_imatrix_callback(Ye, false, im);
    CHECK(bitsplit_imatrix_take_error(im, msg, sizeof msg) == BITSPLIT_E_INVALID, "imatrix: negative expert id refused");
    bitsplit_imatrix_free(im);
    bitsplit_imatrix_free(NULL);
    ggml_backend_buffer_free(buf);
    ggml_free(g);
}

int main(int argc, char ** argv) {
    const double t_start = now_s();
    const char * dir = NULL;
    const char * work_arg = NULL;
    const char * bad[256];
    const char * any[256];
    int n_bad = 0, n_any = 0, n_flips = 1500;
    uint64_t seed = 1;
    bool quick = false, selftest_oob = false;
    for (int i = 1; i < argc; i++) {
        const char * a = argv[i];
        if ((strcmp(a, "--bad") == 0 || strcmp(a, "--any") == 0) && i + 1 < argc) {
            if (a[2] == 'b' && n_bad < 256) bad[n_bad++] = argv[++i];
            else if (a[2] == 'a' && n_any < 256) any[n_any++] = argv[++i];
            else i++;
        } else if (strcmp(a, "--flips") == 0 && i + 1 < argc) {
            n_flips = atoi(argv[++i]);
        } else if (strcmp(a, "--seed") == 0 && i + 1 < argc) {
            seed = strtoull(argv[++i], NULL, 10);
        } else if (strcmp(a, "--work") == 0 && i + 1 < argc) {
            work_arg = argv[++i];
        } else if (strcmp(a, "--selftest-oob") == 0) {
            selftest_oob = true;
        } else if (strcmp(a, "--quick") == 0) {
            quick = true;
        } else if (strcmp(a, "-v") == 0) {
            g_verbose = true;
        } else if (a[0] != '-' && dir == NULL) {
            dir = a;
        } else {
            usage();
            return 2;
        }
    }
    if (dir == NULL) {
        usage();
        return 2;
    }
    ggml_log_set(quiet_log, NULL);
    install_traits_shims();
    if (selftest_oob) {
        /* for run_sanitizers.sh: a read one byte past a file map must be reported (exit non-zero) */
        char path[PATH_MAX];
        snprintf(path, sizeof(path), "%.4000s/residual.gguf", dir);
        const int fd = open(path, O_RDONLY | O_CLOEXEC);
        struct stat st;
        if (fd < 0 || fstat(fd, &st) != 0) return 2;
        const unsigned char * p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED) return 2;
        volatile unsigned char c = p[st.st_size]; /* past the end: ASan must stop here */
        (void)c;
        munmap((void *)p, (size_t)st.st_size);
        close(fd);
        release_maps();
        printf("test_native: selftest-oob: a read past the end of a map was NOT detected\n");
        return 0;
    }

    model m;
    if (!model_open(&m, dir)) {
        model_close(&m);
        printf("test_native: FAIL: cannot read the split model in %s\n", dir);
        return 1;
    }
    char work[PATH_MAX];
    bool own_work = false;
    if (work_arg != NULL) {
        snprintf(work, sizeof(work), "%s", work_arg);
        mkdir(work, 0700);
    } else {
        const char * tmp = getenv("TMPDIR");
        snprintf(work, sizeof(work), "%s/bitsplit-native-test.XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
        if (mkdtemp(work) == NULL) {
            perror("mkdtemp");
            model_close(&m);
            return 1;
        }
        own_work = true;
    }
    if (strlen(work) > sizeof(g_case_path) - 16) {
        fprintf(stderr, "test_native: work directory path too long\n");
        model_close(&m);
        return 2;
    }
    snprintf(g_case_path, sizeof(g_case_path), "%.4000s/case.gguf", work);

    const int fds0 = count_fds();
    double t = now_s();
    test_api_edges(&m, work);
    test_imatrix();
    test_k4_scales();
    test_cpu_feats();
    test_family_peaks();
    test_measured_policy();
    test_thread_sizing(&m);
    test_valid_load(&m, quick);
    test_scratch_out_of_memory(&m);
    const double t_products = now_s() - t;
    t = now_s();
    test_callback(&m);
    test_custom_ops_out_of_memory(&m);
    test_realigned(&m, work, quick);
    const double t_callback = now_s() - t;
    t = now_s();
    test_corrupt(&m, n_flips, seed);
    for (int i = 0; i < n_bad; i++) try_case(bad[i], m.base_path, true, bad[i]);
    for (int i = 0; i < n_any; i++) try_case(any[i], m.base_path, false, any[i]);
    const double t_corrupt = now_s() - t;
    const int fds1 = count_fds();
    CHECK(fds0 == fds1, "file descriptors leaked: %d open before, %d after", fds0, fds1);
    CHECK(live_maps() == 0, "%ld file maps not released", live_maps());

    unlink(g_case_path);
    free(g_prev);
    free(g_scratch);
    release_maps();
    if (own_work) rmdir(work);

    char fams[192] = "";
    for (int f = 0; f < N_FAMILIES; f++) {
        if (g_family_ok[f]) {
            strcat(fams, fams[0] ? "," : "");
            strcat(fams, FAMILIES[f]);
        }
    }
    if (g_verbose) {
        for (int f = 0; f < N_FAMILIES; f++) {
            if (g_family_ok[f]) {
                fprintf(stderr, "  %-12s worst |y-ref|/A: f32 %.3g  bf16 %.3g\n", FAMILIES[f], g_worst_ratio[f][1],
                        g_worst_ratio[f][2]);
            }
        }
        fprintf(stderr, "  statuses of corrupt loads: ok %ld io %ld format %ld mismatch %ld unsupported %ld other %ld\n",
                g_cs.by_status[0], g_cs.by_status[1], g_cs.by_status[2], g_cs.by_status[3], g_cs.by_status[4],
                g_cs.by_status[5] + g_cs.by_status[6] + g_cs.by_status[7]);
    }
    model_close(&m);
    printf("test_native: %s: %s: %ld checks, %ld failures; families %s; corrupt files: %ld must-refuse refused, "
           "%ld wrongly accepted, %ld random (%ld accepted and usable, %ld refused); "
           "%.1fs (products %.1fs, callback+layouts %.1fs, corrupt %.1fs)\n",
           g_failures ? "FAIL" : "PASS", dir, g_checks, g_failures, fams, g_cs.strict_refused, g_cs.strict_accepted,
           g_cs.lenient_accepted + g_cs.lenient_refused, g_cs.lenient_accepted, g_cs.lenient_refused,
           now_s() - t_start, t_products, t_callback, t_corrupt);
    return g_failures ? 1 : 0;
}
