/*
 * The verifier's weight products: y = (W2 + R) . x over a range of output rows, for the whole
 * batch at once. Each block of weights is unpacked once (base and residual together) and applied
 * to every activation column, so the cost of a batch grows with its compute, not with re-reading
 * and re-unpacking the weights column by column as ggml's vec_dot kernels do.
 *
 * Numerics (both precisions are batch-invariant: a column's result never depends on the others):
 *   F32   f32(W2) + f32(R) in f32, times f32 x, accumulated in f32: the exact verifier
 *   BF16  bf16(f32(W2) + f32(R)) times bf16(x); every product is exact in f32 (8-bit mantissas),
 *         sums in f32. No block scales on the activations, so outliers cost nothing to neighbours.
 *
 * This file holds the portable family ("generic") and the dispatcher; the SIMD families live in
 * native/arch/<arch>/ and produce the same products (their f32 summation order differs).
 */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "bs_internal.h"
#include "bitsplit.h"
#include "cpu_feats.h"

/* round-to-nearest-even to bf16, returned as the f32 it represents (NaN kept quiet) */
static inline float bs_round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        u |= 0x00400000u;
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);
    }
    u &= 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

/* ---------------------------------------------------------------------------------------------
 * generic family: portable C, any readable types, both precisions
 * ------------------------------------------------------------------------------------------- */

static bool generic_available(void) { return true; }
static bool generic_supports(const bs_job * job) { (void)job; return true; }

static size_t generic_acts_size(const bs_job * job) {
    return job->precision == BITSPLIT_PREC_BF16 ? (size_t)job->K * (size_t)job->n_cols * sizeof(float) : 0;
}

static void generic_prepare_acts(const bs_job * job, int64_t c0, int64_t c1) {
    if (job->precision != BITSPLIT_PREC_BF16) {
        return;
    }
    float * a = (float *)job->acts;
    for (int64_t c = c0; c < c1; c++) {
        const float * x = job->x + c * job->ldx;
        float * o = a + c * job->K;
        for (int64_t k = 0; k < job->K; k++) {
            o[k] = bs_round_bf16(x[k]);
        }
    }
}

/* 8 independent partial sums: vectorizable without reassociating a single chain */
static inline float dot8(const float * a, const float * b, int64_t n) {
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        for (int j = 0; j < 8; j++) {
            s[j] += a[i + j] * b[i + j];
        }
    }
    for (; i < n; i++) {
        s[i & 7] += a[i] * b[i];
    }
    return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

static void generic_rows(const bs_job * job, int64_t r0, int64_t r1, bs_scratch * scratch) {
    const int64_t K = job->K;
    float * w = (float *)bs_scratch_get(scratch, 2 * (size_t)K * sizeof(float));
    if (w == NULL) {
        return; /* out of memory: bs_run_job reports it (scratch->failed) */
    }
    float * rr = w + K;
    const bool bf16 = job->precision == BITSPLIT_PREC_BF16;
    const float * xs = bf16 ? (const float *)job->acts : job->x;
    const int64_t ldx = bf16 ? K : job->ldx;
    for (int64_t r = r0; r < r1; r++) {
        if (job->r == NULL) { /* base alone (the fast drafter) */
            bs_dequant_row(job->w2_type, job->w2 + (size_t)r * job->w2_row_bytes, w, K);
        } else if (job->w2 != NULL) {
            bs_dequant_row(job->r_type, job->r + (size_t)r * job->r_row_bytes, rr, K);
            bs_dequant_row(job->w2_type, job->w2 + (size_t)r * job->w2_row_bytes, w, K);
            for (int64_t k = 0; k < K; k++) {
                w[k] += rr[k];
            }
        } else {
            bs_dequant_row(job->r_type, job->r + (size_t)r * job->r_row_bytes, w, K);
        }
        if (bf16) {
            for (int64_t k = 0; k < K; k++) {
                w[k] = bs_round_bf16(w[k]);
            }
        }
        for (int64_t c = 0; c < job->n_cols; c++) {
            const float v = dot8(w, xs + c * ldx, K);
            float * y = job->y + c * job->ldy + r;
            *y = job->accumulate ? *y + v : v;
        }
    }
}

static const bs_kernel_family generic_family = {
    "generic", BS_ISA_GENERIC, generic_available, generic_supports, generic_acts_size, generic_prepare_acts,
    generic_rows, 0,
};

/* ---------------------------------------------------------------------------------------------
 * the kernel policy: the one place that decides which family computes a product
 * ------------------------------------------------------------------------------------------- */

#if defined(__x86_64__)
extern const bs_kernel_family bs_family_vnni_int24;  /* arch/x86/kernels_int.c */
extern const bs_kernel_family bs_family_avx512_bf16; /* arch/x86/kernels_tiles.c */
extern const bs_kernel_family bs_family_amx_bf16;
extern const bs_kernel_family bs_family_avx2_f32;    /* arch/x86/kernels_avx2.c */
extern const bs_kernel_family bs_family_avx2_int16;  /* arch/x86/kernels_avx2_int.c */
extern const bs_kernel_family bs_family_avxvnni_int16; /* arch/x86/kernels_avxvnni_int.c (the same source) */
extern const bs_kernel_family bs_family_avx512vnni_int16; /* arch/x86/kernels_avx512vnni_int.c (again) */
#endif
#if defined(__aarch64__)
extern const bs_kernel_family bs_family_neon_f32;    /* arch/arm/kernels_neon.c */
extern const bs_kernel_family bs_family_neon_int16;  /* arch/arm/kernels_neon_int.c (needs the dot product) */
#endif

/* Small batches (decode steps, 2-row verify passes): the per-column integer kernel is the fastest
 * where it exists, each up to its max_cols (its cost grows with the batch; vnni-int24's crossover
 * with the tile kernels is 4-5 columns on a 2-core Xeon, avx2-int16's with avx2-f32 6-7 columns on
 * a 2-core Zen 3; avxvnni-int16, the same integers with AVX-VNNI, before avx2-int16). Larger
 * batches (trees, prompts, evaluation): the tile kernels, whose cost barely grows with the batch.
 * Then the plain SIMD families of the architecture (on AVX2, avx2-int16 up to its max_cols, then
 * avx2-f32; on AArch64, neon-int16, avx2-int16's arithmetic with the dot product, to the same
 * limits (not measured on ARM hardware), then neon-f32), then generic. Products of the residual
 * alone (add mode) keep the small-batch order at every size, each family to its alone_max_cols
 * where it has one: avx2-int16 takes one activation digit there, half its multiplies, and stays
 * ahead of avx2-f32 to 32 columns. */
static const bs_kernel_family * const order_small[] = {
#if defined(__x86_64__)
    &bs_family_vnni_int24, &bs_family_amx_bf16, &bs_family_avx512_bf16, &bs_family_avx512vnni_int16,
    &bs_family_avxvnni_int16, &bs_family_avx2_int16, &bs_family_avx2_f32,
#endif
#if defined(__aarch64__)
    &bs_family_neon_int16, &bs_family_neon_f32,
#endif
    &generic_family,
};
static const bs_kernel_family * const order_large[] = {
#if defined(__x86_64__)
    &bs_family_amx_bf16, &bs_family_avx512_bf16, &bs_family_avx2_f32, &bs_family_vnni_int24,
    &bs_family_avx512vnni_int16, &bs_family_avxvnni_int16, &bs_family_avx2_int16,
#endif
#if defined(__aarch64__)
    &bs_family_neon_f32, &bs_family_neon_int16,
#endif
    &generic_family,
};
#define N_FAMILIES (sizeof(order_small) / sizeof(order_small[0]))

/* AMD Zen 4 (family 19h with AVX-512) runs each 512-bit operation through its 256-bit units in two
 * passes, and its AVX-512 families fall far behind their showing on a Xeon or a Zen 5. Measured on
 * a 2-core Zen 4 VM, Qwen2.5-Coder-1.5B q6_k split, 2 threads, the families interleaved in one
 * process, medians of 3 (python bench/residual_speed.py SPLIT --batches 1,2,4,6,8,12,16,24,32
 * --repeat 3 --kernel vnni-int24,avx512-bf16,avx2-int16,avx2-f32 [--residual-only]), ms per pass:
 *   columns                   1    2    4    6    8   12   16   24   32
 *   W2 + R  vnni-int24      204  196  345  295  375  573  688 1039 1462
 *           avx512-bf16     539  589  575  556  557  574  648  709  819
 *           avx2-int16      105  156  239  357  532  741  940 1399 1758
 *           avx2-f32        283  448  333  376  388  461  591  670  836
 *   R alone vnni-int24       78  101  141  256  250  351  458  779 1025
 *           avx512-bf16     296  300  298  337  346  355  396  467  566
 *           avx2-int16       49   59  102  142  191  272  372  526  687
 *           avx2-f32        160  183  221  255  277  341  438  580  765
 * and again with the base, medians of 5 (--batches 4,5,6,8,10,12,16 --repeat 5):
 *   columns                   4    5    6    8   10   12   16
 *           vnni-int24      237  300  291  400  452  633  776
 *           avx2-int16      222  328  329  568  586  824  952
 *           avx2-f32        349  421  333  417  513  498  599
 *           avx512-bf16     590  545  569  574  613  635  612
 * (the built-in order there: vnni-int24 to 4 columns, then avx512-bf16). So where this holds the
 * 256-bit integer family comes first for small batches (W2 + R to HR_INT16_MAX columns, R alone to
 * HR_INT16_ALONE_MAX), then vnni-int24 for W2 + R to HR_VNNI_MAX (5-10 columns: 4-14% ahead of the
 * next; --tree-nodes auto's calibration found the same), avx2-f32 to HR_F32_MAX (an earlier run had
 * avx512-bf16 7% ahead at 16: the two are close from 16 to 32), avx512-bf16 above. Before them all
 * avx512vnni-int16 (avx2-int16's integers with EVEX's 32 registers: one decoding of a row serves 4
 * columns): W2 + R to HR_INT16W_MAX (time against avx2-int16 0.98 / 0.91 / 0.72 / 0.69 / 0.82 / 0.80
 * / 0.88 at 1 / 2 / 3 / 4 / 5 / 6 / 8 columns, python bench/native_ab.py, 7 rounds: about 290 ms at
 * 6, level with vnni-int24 and avx2-f32 above), R alone to HR_INT16W_ALONE_MAX: 0.97 / 1.00 / 0.93 /
 * 0.98 at 1 / 2 / 4 / 8 (the same pairs of columns as avx2-int16), and from 9 columns its tiles of 4
 * rows (kernels_avx2_int.c) lead every family: python bench/residual_speed.py SPLIT --batches
 * 8,12,16,24,32 --residual-only, one process, medians of 3, ms per pass 257 / 289 / 338 / 402 / 495
 * against avx2-int16's 261 / 340 / 420 / 538 / 844, avx512-bf16's 407 / 404 / 425 / 490 / 651,
 * avx2-f32's 310 / 431 / 459 / 636 / 883 and vnni-int24's 262 / 500 / 512 / 762 / 1169.
 * Since avx512vnni-int16's W2 + R decodes each row again for every 4 columns at every batch (no
 * longer the one-column buffered loop past 6) and takes vpdpwssd at 3-4 columns, it leads every
 * family to 12 columns here: python bench/residual_speed.py SPLIT --batches 4,5,6,8,10,12,16,24,32
 * --repeat 3 --kernel avx512vnni-int16,vnni-int24,avx2-f32,avx512-bf16,avx2-int16, two runs, time
 * against avx512vnni-int16's (179 / 210 / 236 / 277 / 350 / 408 / 554 / 842 / 1091 ms in the second):
 *   columns           4    5    6    8   10   12   16   24   32
 *   vnni-int24     1.36 1.17 1.37 1.42 0.94 1.26 1.16 1.39 1.41
 *                  1.57 1.37 1.33 1.39 1.51 1.40 1.22 1.16 1.22
 *   avx2-f32       1.74 1.26 1.52 1.35 0.86 1.16 1.09 0.81 0.86
 *                  1.90 2.02 1.48 1.39 1.18 1.13 0.90 0.80 0.75
 *   avx512-bf16    2.62 2.27 2.37 2.28 1.24 1.50 1.17 0.92 0.70
 *                  3.03 2.59 2.45 2.03 1.75 1.67 1.12 0.83 0.69
 * So avx512vnni-int16 first to HR_INT16W_MAX = 12 in both half-rate orders (vnni-int24, whose limit
 * is lower, no longer leads where avx512vnni-int16 runs), then avx2-f32 to 16, avx512-bf16 above.
 * BITSPLIT_HALF_RATE_512=1 / 0 forces this order on or off (a CPU this test misjudges: a Zen 5 with
 * a 256-bit data path, say). */
#define HR_INT16_MAX 4
#define HR_INT16_ALONE_MAX 16
#define HR_INT16W_MAX 12      /* avx512vnni-int16: W2 + R to 12 columns, R alone to 32 (below) */
#define HR_INT16W_ALONE_MAX 32
#define HR_VNNI_MAX 10
#define HR_F32_MAX 16
#if defined(__x86_64__)
static const bs_kernel_family * const order_small_hr[] = {
    &bs_family_avx512vnni_int16, &bs_family_avxvnni_int16, &bs_family_avx2_int16, &bs_family_vnni_int24,
    &bs_family_amx_bf16, &bs_family_avx512_bf16, &bs_family_avx2_f32, &generic_family,
};
static const bs_kernel_family * const order_large_hr[] = {
    &bs_family_avx512vnni_int16, &bs_family_amx_bf16, &bs_family_vnni_int24, &bs_family_avx2_f32,
    &bs_family_avx512_bf16, &bs_family_avxvnni_int16, &bs_family_avx2_int16, &generic_family,
};
_Static_assert(sizeof(order_small_hr) == sizeof(order_small) && sizeof(order_large_hr) == sizeof(order_small),
               "the half-rate orders hold every family");
#endif

bool bs_half_rate_512(void) {
#if defined(__x86_64__)
    /* the override is read each time, as BITSPLIT_MAX_ISA is (a bad value: refused at load) */
    const char * env = getenv("BITSPLIT_HALF_RATE_512");
    if (env != NULL && (strcmp(env, "0") == 0 || strcmp(env, "1") == 0)) {
        return env[0] == '1';
    }
    return bs_cpu_has(BS_CPU_HALF_RATE_512); /* AMD's Zen 4 (cpu_feats.c) */
#else
    return false;
#endif
}

static const char * const isa_names[] = {"generic", "simd", "avxvnni", "avx512", "amx"};

const char * bs_isa_name(int isa) {
#if defined(__aarch64__)
    if (isa == BS_ISA_SIMD) return "neon";
#else
    if (isa == BS_ISA_SIMD) return "avx2";
#endif
    return isa >= 0 && isa <= BS_ISA_AMX ? isa_names[isa] : "?";
}

bool bs_isa_cap(int * cap) {
    const char * env = getenv("BITSPLIT_MAX_ISA");
    *cap = BS_ISA_AMX;
    if (env == NULL || env[0] == '\0') {
        return true;
    }
    static const struct { const char * name; int isa; } names[] = {
        {"generic", BS_ISA_GENERIC}, {"avx2", BS_ISA_SIMD}, {"neon", BS_ISA_SIMD}, {"avxvnni", BS_ISA_AVXVNNI},
        {"avx512", BS_ISA_AVX512}, {"amx", BS_ISA_AMX},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if (strcmp(env, names[i].name) == 0) {
            *cap = names[i].isa;
            return true;
        }
    }
    *cap = BS_ISA_GENERIC;
    return false;
}

static bool usable(const bs_kernel_family * f, int cap) {
    return f->isa <= cap && f->available();
}

bool bs_half_rate_env_ok(void) {
    const char * env = getenv("BITSPLIT_HALF_RATE_512");
    return env == NULL || env[0] == '\0' || strcmp(env, "0") == 0 || strcmp(env, "1") == 0;
}

/* only where an AVX-512 family runs (under an AVX2 cap, or on a CPU without one: the AVX2 order) */
static bool half_rate_in_force(int cap) {
#if defined(__x86_64__)
    return bs_half_rate_512() && (usable(&bs_family_vnni_int24, cap) || usable(&bs_family_avx512_bf16, cap) ||
                                  usable(&bs_family_amx_bf16, cap));
#else
    (void)cap;
    return false;
#endif
}

bool bs_half_rate_in_force(void) {
    int cap;
    bs_isa_cap(&cap);
    return half_rate_in_force(cap);
}

/* the family of this build named `name` (whether or not this CPU runs it), or NULL */
static const bs_kernel_family * family_of_build(const char * name) {
    for (size_t i = 0; i < N_FAMILIES; i++) {
        if (strcmp(order_small[i]->name, name) == 0) {
            return order_small[i];
        }
    }
    return NULL;
}

const bs_kernel_family * bs_family_named(const char * name) {
    int cap;
    bs_isa_cap(&cap);
    const bs_kernel_family * f = family_of_build(name);
    return f != NULL && usable(f, cap) ? f : NULL;
}

/* the order in force: for decode-sized batches (small) or larger ones, the half-rate orders where
 * hr (half_rate_in_force); bs_policy_list and bs_draft_policy both take theirs from here */
static const bs_kernel_family * const * policy_order(bool small, bool hr) {
#if defined(__x86_64__)
    if (hr) return small ? order_small_hr : order_large_hr;
#else
    (void)hr;
#endif
    return small ? order_small : order_large;
}

/* a product of the residual alone: add mode's R . x (the device computes W2 . x) */
static bool residual_alone(const bs_job * job) {
    return job->w2 == NULL && job->r != NULL && !job->draft;
}

/* the most columns f is preferred for (0: no limit); hr: the half-rate order is in force */
static int col_limit(const bs_kernel_family * f, bool alone, bool hr) {
#if defined(__x86_64__)
    if (hr) {
        if (f == &bs_family_avx2_int16 || f == &bs_family_avxvnni_int16) return alone ? HR_INT16_ALONE_MAX : HR_INT16_MAX;
        if (f == &bs_family_avx512vnni_int16) return alone ? HR_INT16W_ALONE_MAX : HR_INT16W_MAX;
        if (f == &bs_family_vnni_int24) return HR_VNNI_MAX;
        if (f == &bs_family_avx2_f32) return HR_F32_MAX;
    }
#else
    (void)hr;
#endif
    return alone && f->alone_max_cols > 0 ? f->alone_max_cols : f->max_cols;
}

/* The measured policy (bs_policy_set_measured): per kind of product (W2 + R, R alone), steps of
 * (columns, family), columns ascending: a product of n_cols <= cols[i] (the first such i) takes
 * family[i] first, where it runs under the cap and computes the product; past the last step, or with
 * none, the built-in order alone. Published by the step count (release / acquire): a product sees the
 * table before or after a change, never half of one. Set before the products it steers. */
typedef struct {
    _Atomic int n;
    int64_t cols[BS_MEASURED_MAX];
    const bs_kernel_family * fam[BS_MEASURED_MAX];
} measured_table;
static measured_table measured[2]; /* [alone] */

int bs_policy_set_measured(bool alone, const int64_t * cols, const char * const * names, int n) {
    if (n < 0 || n > BS_MEASURED_MAX || (n > 0 && (cols == NULL || names == NULL))) {
        return BITSPLIT_E_INVALID;
    }
    const bs_kernel_family * fams[BS_MEASURED_MAX];
    for (int i = 0; i < n; i++) {
        if (cols[i] < 1 || (i > 0 && cols[i] <= cols[i - 1]) || names[i] == NULL) {
            return BITSPLIT_E_INVALID;
        }
        if ((fams[i] = family_of_build(names[i])) == NULL) {
            return BITSPLIT_E_UNSUPPORTED;
        }
    }
    measured_table * t = &measured[alone ? 1 : 0];
    atomic_store_explicit(&t->n, 0, memory_order_release);
    for (int i = 0; i < n; i++) {
        t->cols[i] = cols[i];
        t->fam[i] = fams[i];
    }
    atomic_store_explicit(&t->n, n, memory_order_release);
    return BITSPLIT_OK;
}

int bs_policy_measured(bool alone, int64_t * cols, const char ** names, int max) {
    const measured_table * t = &measured[alone ? 1 : 0];
    const int n = atomic_load_explicit(&t->n, memory_order_acquire);
    for (int i = 0; i < n && i < max; i++) {
        if (cols != NULL) cols[i] = t->cols[i];
        if (names != NULL) names[i] = t->fam[i]->name;
    }
    return n;
}

/* the measured family for a product of n_cols, or NULL (no step covers it) */
static const bs_kernel_family * measured_first(bool alone, int64_t n_cols) {
    const measured_table * t = &measured[alone ? 1 : 0];
    const int n = atomic_load_explicit(&t->n, memory_order_acquire);
    for (int i = 0; i < n; i++) {
        if (n_cols <= t->cols[i]) {
            return t->fam[i];
        }
    }
    return NULL;
}

int bs_policy_list(int64_t n_cols, bool alone, const bs_job * job, const bs_kernel_family ** out, int max) {
    int cap;
    bs_isa_cap(&cap);
    alone = job != NULL ? residual_alone(job) : alone;
    /* products of the residual alone keep the per-column kernels' order at every batch: each
     * stays first to its own limit (alone_max_cols), past it the tile and f32 families take over */
    const bool small = n_cols <= BS_SMALL_BATCH || alone;
    const bool hr = half_rate_in_force(cap);
    const bs_kernel_family * const * order = policy_order(small, hr);
    int n = 0;
    /* first the family this machine measured fastest for this batch, where there is one (and it
     * runs and computes the job); then the built-in order */
    const bs_kernel_family * m = measured_first(alone, n_cols);
    if (m != NULL && m != &generic_family && max > 0 && usable(m, cap) && (job == NULL || m->supports(job))) {
        out[n++] = m;
    } else {
        m = NULL;
    }
    /* pass 0: the families for this batch in the order's sequence; pass 1: those past their
     * max_cols, which still compute it (before generic, the last resort) */
    for (int pass = 0; pass < 2; pass++) {
        for (size_t i = 0; i < N_FAMILIES && n < max; i++) {
            const bs_kernel_family * f = order[i];
            const int limit = col_limit(f, alone, hr);
            const bool past = limit > 0 && n_cols > limit;
            if (f == &generic_family || f == m || past != (pass == 1)) {
                continue;
            }
            if (usable(f, cap) && (job == NULL || f->supports(job))) {
                out[n++] = f;
            }
        }
    }
    if (n < max) {
        out[n++] = &generic_family;
    }
    return n;
}

const bs_kernel_family * bs_policy(int64_t n_cols, bool alone, const bs_job * job) {
    const bs_kernel_family * f;
    return bs_policy_list(n_cols, alone, job, &f, 1) == 1 ? f : &generic_family;
}

const bs_kernel_family * bs_precise_policy(int64_t n_cols, const bs_job * job) {
    const bs_kernel_family * list[BS_MAX_FAMILIES];
    const int n = bs_policy_list(n_cols, false, job, list, BS_MAX_FAMILIES);
    for (int i = 0; i < n; i++) {
        if (list[i]->exact_weights) {
            return list[i];
        }
    }
    return bs_policy(n_cols, false, job);
}

const bs_kernel_family * bs_draft_policy(const bs_job * job) {
    int cap;
    bs_isa_cap(&cap);
    /* where 512-bit operations run at half rate, the 256-bit families draft first too (on a Zen 4,
     * avx512vnni-int16's drafting passes of 2 / 3 / 4 rows took 0.75 / 0.78 / 0.80 of vnni-int24's) */
    const bs_kernel_family * const * order = policy_order(true, half_rate_in_force(cap));
    for (size_t i = 0; i < N_FAMILIES; i++) {
        const bs_kernel_family * f = order[i];
        if (f->draft_min_cols > 0 && usable(f, cap) && (job == NULL || f->supports(job))) {
            /* the first drafting family that computes this product, from its own smallest batch;
             * narrower ones stay with ggml rather than fall to a later family, so that the family
             * named as the drafter (the first: job NULL) is the one that drafts */
            return job == NULL || job->n_cols >= f->draft_min_cols || job->any_cols ? f : NULL;
        }
    }
    return NULL;
}

bool bs_act8_auto_here(void) {
#if defined(__x86_64__)
    int cap;
    bs_isa_cap(&cap);
    for (size_t i = 0; i < N_FAMILIES; i++) {
        if (order_small[i]->isa >= BS_ISA_AVX512 && usable(order_small[i], cap)) {
            return false;
        }
    }
    return true;
#else
    return false; /* not measured on ARM */
#endif
}

const bs_kernel_family * bs_generic_family(void) { return &generic_family; }
