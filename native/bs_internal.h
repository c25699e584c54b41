/* Internal declarations shared by the library's files and the kernels; not part of the API. Each
 * declaration names the file that defines it; the files call one another in the order of
 * native/README.md (the units bottom to top: errors.c and util.c at the bottom, bitsplit.c at the
 * top), never upwards (tests/test_layout.py checks it). */
#ifndef BS_INTERNAL_H
#define BS_INTERNAL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "bitsplit.h"
#include "bs_os.h"
#include "ggml-backend.h"
#include "ggml.h"

/* The kernels read GGUF's little-endian blocks with plain loads (e.g. bs_k4_scales_mins). */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "bitsplit's native library supports little-endian targets only (x86-64, AArch64)"
#endif

#define BS_MAX_THREADS 64
#define BS_THREAD_MIN_BYTES (512 * 1024) /* weight bytes a pool thread is worth waking for (pool.c) */
#define BS_ROW_BLOCK 16          /* rows computed together (one AMX tile of outputs) */

/* whether thread ith of a custom op's nth takes part: ggml may call more than the library's
 * BS_MAX_THREADS (every core); *nth is clamped to it and the threads beyond compute nothing.
 * (pool.c's bs_run_job counts them at its barrier instead.) */
static inline bool bs_thread_works(int ith, int * nth) {
    if (*nth > BS_MAX_THREADS) {
        *nth = BS_MAX_THREADS;
    }
    return ith < *nth;
}

typedef struct bs_entry {
    char name[GGML_MAX_NAME];
    int64_t ne[4];               /* GGUF/ggml order: ne[0] = row width */
    int64_t n_rows;              /* ne1 * ne2 * ne3 */
    enum ggml_type base_type;
    enum ggml_type res_type;
    size_t base_row_bytes;
    size_t res_row_bytes;
    const uint8_t * res_data;    /* in the residual's map */
    const uint8_t * base_data;   /* in this library's map of base.gguf */
    bool exact;                  /* a base weight without residual (res_data NULL): the source's own
                                    weight, computed here only for batch invariance */
    /* emulated device numerics: this weight's fixed exact channels (bitsplit_ctx_set_exact_channels),
     * taken for every row instead of each row's largest */
    int n_exact_ch;
    int32_t exact_ch[BITSPLIT_MAX_OUTLIERS];
    struct bitsplit_ctx * ctx;
} bs_entry;

/* Per-thread scratch, grown by its own thread only. failed: the size of the last request that could
 * not be allocated (0: none; bs_run_job clears it before a family's rows and reports it after) */
typedef struct bs_scratch {
    void * buf;
    size_t size;
    size_t failed;
} bs_scratch;

/* One weight product over a range of rows: y[c][r] (+)= sum_k (W2[r][k] + R[r][k]) x[c][k]. */
typedef struct bs_job {
    const uint8_t * w2;          /* base rows (row 0 of this matrix), NULL in add mode */
    const uint8_t * r;           /* residual rows (row 0) */
    enum ggml_type w2_type, r_type;
    size_t w2_row_bytes, r_row_bytes;
    int64_t K;                   /* row width */
    int64_t N;                   /* rows */
    const float * x;             /* n_cols columns of K floats, ldx apart */
    int64_t ldx;
    int64_t n_cols;
    float * y;                   /* n_cols columns of N floats, ldy apart */
    int64_t ldy;
    bool accumulate;             /* y += ... instead of y = ... */
    bool draft;                  /* the fast drafter's product (base alone, speed before precision);
                                    r == NULL without it: a weight that has no residual */
    int precision;               /* BITSPLIT_PREC_F32 or BITSPLIT_PREC_BF16 (resolved) */
    bool act8;                   /* W2 + R takes 8-bit activations where a block allows (the 16-bit integer
                                    families; BITSPLIT_ACTS_8, resolved) */
    void * acts;                 /* activations prepared once per job (shared by the threads) */
    bool any_cols;               /* a drafting product the draft family takes at any width (the output
                                    head's rows in a draft vocabulary: ggml's kernel cannot skip rows) */
} bs_job;

/* instruction-set levels, for the cap BITSPLIT_MAX_ISA (generic < avx2|neon < avxvnni < avx512 < amx) */
enum bs_isa { BS_ISA_GENERIC = 0, BS_ISA_SIMD = 1, BS_ISA_AVXVNNI = 2, BS_ISA_AVX512 = 3, BS_ISA_AMX = 4 };
#define BS_ISA_AVX2 BS_ISA_SIMD
#define BS_ISA_NEON BS_ISA_SIMD

typedef struct bs_kernel_family {
    const char * name;
    int isa;                     /* enum bs_isa: the level BITSPLIT_MAX_ISA must allow */
    bool (*available)(void);     /* whether this CPU runs it (the cap aside) */
    /* whether this family computes this job (types, precision); else the generic family does */
    bool (*supports)(const bs_job * job);
    /* bytes of shared activation buffer for a job (0: the kernel reads x directly) */
    size_t (*acts_size)(const bs_job * job);
    /* fill job->acts, columns [c0, c1) (each thread does a share) */
    void (*prepare_acts)(const bs_job * job, int64_t c0, int64_t c1);
    /* compute rows [r0, r1) (multiples of BS_ROW_BLOCK except at the end) */
    void (*rows)(const bs_job * job, int64_t r0, int64_t r1, bs_scratch * scratch);
    /* the fast drafter (base alone, residual off): the smallest batch where this family beats
     * ggml's own kernel, measured; 0: never used for drafting */
    int draft_min_cols;
    /* the policy prefers this family for products of up to this many columns only (measured
     * crossover with the next family); 0: any batch */
    int max_cols;
    /* the same for products of the residual alone (add mode: the device computes W2 . x), which
     * cost a family less per column than W2 + R; 0: max_cols holds for them too */
    int alone_max_cols;
    /* weights used as they are (integer or f32 arithmetic), not rounded to bf16: where a pinned
     * family cannot compute a verifier product, one of these takes it (bs_precise_policy) */
    bool exact_weights;
} bs_kernel_family;

/* kernels.c: the kernel policy, the one place that decides which family computes a product */
#define BS_MAX_FAMILIES 12
#define BS_SMALL_BATCH 6         /* up to here the per-column kernels come first (each to its max_cols) */
#define BS_DECODE_COLS 32        /* a pinned family serves passes up to this many columns */
#define BS_PROMPT_COLS 64        /* a prompt's passes take the policy's family for this many columns */
/* whether this CPU runs 512-bit operations at half rate (AMD Zen 4), which reorders the policy
 * (kernels.c); BITSPLIT_HALF_RATE_512=0/1 overrides the CPUID test */
bool bs_half_rate_512(void);
/* whether BITSPLIT_HALF_RATE_512 is unset, empty, 0 or 1 */
bool bs_half_rate_env_ok(void);
/* that, and an AVX-512 family runs here under the cap: the half-rate order is in force */
bool bs_half_rate_in_force(void);
/* the cap in force: min(BITSPLIT_MAX_ISA, none); false (and *cap = generic) for a bad value */
bool bs_isa_cap(int * cap);
const char * bs_isa_name(int isa);
/* the family named `name` if this CPU runs it under the cap, else NULL */
const bs_kernel_family * bs_family_named(const char * name);
/* usable families in the policy's order for a batch of n_cols (job: only those that support it;
 * alone: products of the residual alone, as a job without base is) */
int bs_policy_list(int64_t n_cols, bool alone, const bs_job * job, const bs_kernel_family ** out, int max);
/* kernels.c: the measured policy (bitsplit_set_measured_policy): steps (cols ascending, family
 * names of this build) for W2 + R or R alone; and what it holds (n steps; the first max copied) */
#define BS_MEASURED_MAX 16
int bs_policy_set_measured(bool alone, const int64_t * cols, const char * const * names, int n);
int bs_policy_measured(bool alone, int64_t * cols, const char ** names, int max);
/* the policy's family for a product (job may be NULL: a quantized product of n_cols columns, with
 * the base unless alone) */
const bs_kernel_family * bs_policy(int64_t n_cols, bool alone, const bs_job * job);
/* the first family in the policy's order for n_cols that computes the job with exact weights
 * (else bs_policy's): where the pinned family does not compute a verifier product (vnni-int24 and
 * a Q4_0 base, say), the product keeps the verifier's precision instead of going to a bf16 family */
const bs_kernel_family * bs_precise_policy(int64_t n_cols, const bs_job * job);
/* whether auto takes 8-bit verifier activations for a Q6_K residual here: an x86 CPU that runs
 * no AVX-512 family under the cap */
bool bs_act8_auto_here(void);
/* the family that computes this job (pool.c: the pinned family, the policy, the fast drafter's) */
const bs_kernel_family * bs_family_for(const bitsplit_ctx * ctx, const bs_job * job);
/* the fast drafter's family for a base-only product, or NULL where ggml's kernel is as fast */
const bs_kernel_family * bs_draft_policy(const bs_job * job);
const bs_kernel_family * bs_generic_family(void);
/* scratch.c: s grown to size bytes (64-byte aligned), or NULL with s->failed = size */
void * bs_scratch_get(bs_scratch * s, size_t size);
/* util.c: a row of k values of a readable type (bs_type_readable) to f32, by ggml's dequantizer */
void bs_dequant_row(enum ggml_type type, const void * row, float * out, int64_t k);

/* IQ2_XXS, IQ2_XS and IQ3_S (iq2.c): the grids (a byte per magnitude) and IQ2's 128 sign bytes,
 * read from ggml's own dequantizer once (iq2_ok / iq3s_ok: whether that worked; if not, those types
 * stay with ggml's dequantizer). A family's SIMD decoder of a type is used only once
 * bs_iq_decoder_agrees(type, decoder): bit for bit ggml's to_float on blocks of pseudo-random codes
 * (decode: one block of 256 values of that type). */
#define BS_IQ2XXS_BYTES 66 /* fp16 d, 32 x uint16 codes */
#define BS_IQ2XS_BYTES 74  /* fp16 d, 32 x uint16 codes, 8 bytes of scales */
#define BS_IQ3S_BYTES 110  /* fp16 d, 64 qs, 8 qh, 32 signs, 4 scales */
#define BS_IQ1M_BYTES 56   /* 32 qs, 16 qh, 8 bytes of 3-bit scales with the fp16 d in their top nibbles */
typedef struct {
    uint64_t xxs_grid[256], xs_grid[512]; /* 8 magnitudes per entry */
    uint8_t signs[128];
    uint32_t iq3s_grid[512]; /* 4 magnitudes per entry */
    uint64_t iq1m_grid[2048]; /* IQ1_M: 8 values g in {-1, 0, 1} per entry, a byte each as 128 + 8 g */
    bool iq2_ok, iq3s_ok, iq1m_ok;
} bs_iq_tables;
const bs_iq_tables * bs_iq_get_tables(void);
bool bs_iq_decoder_agrees(enum ggml_type type, void (*decode)(enum ggml_type type, const uint8_t * block, float * out));

/* group g (values 32 g .. 32 g + 31) of a block b of IQ2_XXS, IQ2_XS or IQ3_S: its 32 magnitudes,
 * 8 per mag[l] (values 8 l .. 8 l + 7, a byte each), and their sign bits in *sg (bit i: value i
 * negative) */
static inline void bs_iq_group(const bs_iq_tables * t, enum ggml_type type, const uint8_t * b, int g, uint64_t mag[4],
                               uint32_t * sg) {
    *sg = 0;
    if (type == GGML_TYPE_IQ3_S) { /* 8 entries of 4: an 8-bit index in qs, the ninth bit in qh */
        const uint8_t * qs = b + 2 + 8 * g;
        const uint32_t qh = b[66 + g];
        for (int l = 0; l < 4; l++) {
            const uint32_t e0 = qs[2 * l] | ((qh << (8 - 2 * l)) & 256), e1 = qs[2 * l + 1] | ((qh << (7 - 2 * l)) & 256);
            mag[l] = (uint64_t)t->iq3s_grid[e0] | (uint64_t)t->iq3s_grid[e1] << 32;
        }
        memcpy(sg, b + 74 + 4 * g, 4);
    } else if (type == GGML_TYPE_IQ2_XS) {
        uint16_t q[4];
        memcpy(q, b + 2 + 8 * g, 8);
        for (int l = 0; l < 4; l++) {
            mag[l] = t->xs_grid[q[l] & 511];
            *sg |= (uint32_t)t->signs[q[l] >> 9] << (8 * l);
        }
    } else {
        uint32_t aux[2];
        memcpy(aux, b + 2 + 8 * g, 8);
        for (int l = 0; l < 4; l++) {
            mag[l] = t->xxs_grid[(aux[0] >> (8 * l)) & 255];
            *sg |= (uint32_t)t->signs[(aux[1] >> (7 * l)) & 127] << (8 * l);
        }
    }
}

/* the scale of half h (values 16 h .. 16 h + 15) of group g of such a block with fp16 scale d, as
 * ggml computes it: d * (0.5 + s) * 0.25 (IQ2_XXS: s per 32 values; IQ2_XS: per 16), d * (1 + 2 s)
 * (IQ3_S: per 32) */
static inline float bs_iq_scale(enum ggml_type type, float d, const uint8_t * b, int g, int h) {
    if (type == GGML_TYPE_IQ3_S) {
        return d * (float)(1 + 2 * (int)((b[106 + g / 2] >> (4 * (g & 1))) & 0xf));
    }
    uint32_t s;
    if (type == GGML_TYPE_IQ2_XS) {
        s = (uint32_t)(b[66 + g] >> (4 * h)) & 0xfu;
    } else {
        memcpy(&s, b + 2 + 8 * g + 4, 4);
        s >>= 28;
    }
    return d * (0.5f + (float)s) * 0.25f;
}

/* IQ1_M (split --base iq1_m): each 8 values are one entry of a grid of 2,048 (an 8-bit index in
 * qs, 3 more bits in qh) plus a delta of +-1/8 (a bit in qh); each 16 values have a 3-bit scale s;
 * the block's fp16 d is spread over the top nibbles of the four 16-bit scale words:
 * w = d * (2 s + 1) * (grid[j] + delta). The fp16 bits of d: */
static inline uint16_t bs_iq1m_d16(const uint8_t * b) {
    uint16_t sc[4];
    memcpy(sc, b + 48, 8);
    return (uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000));
}

/* ggml's d * (2 s + 1) for half h (values 16 h .. 16 h + 15) of group g of an IQ1_M block */
static inline float bs_iq1m_scale(float d, const uint8_t * b, int g, int h) {
    uint16_t sc;
    memcpy(&sc, b + 48 + 2 * (g / 2), 2);
    return d * (float)(2 * ((sc >> (6 * (g % 2) + 3 * h)) & 0x7) + 1);
}

/* util.c: whether ggml can turn this type into f32 (a known type with a dequantizer) (the clock,
 * bs_now_ns, is os.c's) */
bool bs_type_readable(enum ggml_type type);

/* One kernel family's multiply step, as its peak is timed (native/peak.c, bitsplit_family_peak):
 * run(n) does n iterations of macs weight.column multiply-accumulates in registers alone, where
 * runs() says this CPU has the instructions */
typedef struct {
    const char * family;
    bool (*runs)(void);
    void (*run)(int64_t n);
    double macs;
} bs_peak_step;
/* this architecture's steps, *n of them (arch/<arch>/peak.c: x86-64 and AArch64 only) */
const bs_peak_step * bs_peak_steps(size_t * n);

/* ---------------------------------------------------------------------------------------------
 * the library's state and the helpers its files share
 * ------------------------------------------------------------------------------------------- */

typedef struct bs_pool bs_pool;
typedef struct bs_overlap bs_overlap;
#define BS_OVERLAP_MAX 8 /* products one activation may feed with its R . x started early */

struct bitsplit_ctx {
    void * map_res;
    size_t map_res_size;
    void * map_base;
    size_t map_base_size;

    bs_entry * entries;          /* residual tensors [0, n_entries), then the base's exact weights */
    int64_t n_entries;
    int64_t n_all;
    int64_t * table; /* open addressing: name hash -> entry index, -1 empty */
    int64_t table_size;

    atomic_bool enabled;
    atomic_bool draft_fast;
    /* drafting passes compute the output head's rows [0, draft_rows) and [draft_tail, rows) alone,
     * the others -inf (bitsplit_ctx_set_draft_vocab; 0: the whole head, by ggml) */
    int64_t draft_rows, draft_tail;
    int precision;
    int act_bits;                /* enum bitsplit_act_bits */
    int mode;
    int numerics;                /* enum bitsplit_numerics (numerics.c): emulated device rounding */
    int numerics_outliers;       /* channels per row kept exact under it (0 to BITSPLIT_MAX_OUTLIERS) */
    int compensate;              /* enum bitsplit_numerics: the device rounding a second base product corrects */
    void * comp_cpu_dev;         /* ggml_backend_dev_t: llama.cpp's CPU device, for weights in host memory */
    bool device_add;             /* add mode: R . x (and compensation) added on the device, in place */
    atomic_int n_exact_sets;     /* weights with a fixed exact set: then the others take none */
    bool replace_ok; /* custom-op layout check passed */
    /* A family pinned for decode passes (<= BS_DECODE_COLS columns) by bitsplit_ctx_set_kernel /
     * choose_kernel, so that every pass of a generation runs the same arithmetic; with pin_all
     * (BITSPLIT_KERNEL) it serves every batch. NULL: the kernel policy decides per product. */
    const bs_kernel_family * pinned;
    bool pin_all;
    /* batch-invariant verification (on by default): the pinned family serves every batch size (not
     * in prompt mode), and the base's weights without residual (the output head, base-exact
     * tensors) are computed here too, so that a row's result never depends on the rest of its
     * batch */
    bool invariant;
    /* a prompt being decoded (bitsplit_ctx_set_prompt): its products take the kernel policy's
     * family for BS_PROMPT_COLS columns, whatever the pass's size, not the pinned one (unless
     * pin_all) */
    bool prompt;

    /* shared by the threads of one product (nodes run one after another) */
    void * acts;
    size_t acts_size;
    void * gather; /* MUL_MAT_ID: gathered columns and results */
    size_t gather_size;
    void * xdev; /* emulated device numerics: the pass's activations as the device rounds them */
    size_t xdev_size;
    void * xcomp; /* the rounding's error, x - round(x), as the second product takes it */
    size_t xcomp_size;
    bs_scratch scratch[BS_MAX_THREADS];
    atomic_bool job_failed; /* a thread of the product running on the pool could not compute its rows */
    atomic_int bar_count;
    atomic_int bar_gen;

    /* add mode and bitsplit_ctx_matmul */
    int n_threads;
    int64_t thread_min_bytes; /* weight bytes per pool thread (BITSPLIT_THREAD_MIN_KB, read at load) */
    bs_pool * pool;
    bs_scratch host_x, host_y, host_d;
    /* add mode: R . x started when its input is computed (overlap.c) */
    bool overlap;
    bool overlap_at_products; /* started at an input's first product, no stop at the input itself */
    bs_overlap * ov;
    struct bs_comp * comp; /* the devices' second products (compensate.c) */
    bs_scratch host_c;

    /* counters (updated by thread 0 of a product) */
    atomic_uint_fast64_t c_products, c_add, c_rows, c_cols, c_bres, c_bbase, c_ns, c_err, c_draft, c_ns_draft;
    atomic_uint_fast64_t c_bdev_in, c_bdev_out, c_ns_xfer, c_overlap, c_ns_wait, c_stops, c_exact;
    atomic_uint_fast64_t c_attn, c_ns_attn, c_softmax; /* attention computed here (attn.c) */
    atomic_uint_fast64_t c_boutlier; /* emulated numerics: base bytes holding the exact outlier channels */
    atomic_uint_fast64_t c_comp, c_ns_comp; /* products compensated on their device (compensate.c), time */

    bs_mutex err_lock;
    int err_status;
    char err_msg[512];
};

/* loader.c: the residual entry of this name, or NULL */
const bs_entry * bs_find_entry(const struct bitsplit_ctx * ctx, const char * name);

/* errors.c: count an error and keep the first one's status and message for
 * bitsplit_ctx_take_error */
void bs_record_error(struct bitsplit_ctx * ctx, int status, const char * fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* pool.c: running a product on threads */
void bs_pool_free(bs_pool * pool);
/* grow *buf (64-byte aligned) to hold need bytes; false when out of memory */
bool bs_ensure(void ** buf, size_t * cap, size_t need);
/* all nth threads of one product meet here */
void bs_barrier(struct bitsplit_ctx * ctx, int nth);
/* numerics.c: the rounding rule of enum bitsplit_numerics `numerics` for weights of type t in a pass
 * of n_rows rows (-1: none for this type, or K not a multiple of its block), and one column of K
 * values rounded by it into out (which may be x) */
int bs_numerics_rule(int numerics, enum ggml_type t, int64_t n_rows, int64_t K);
/* with outliers > 0: the column's `outliers` channels of largest magnitude (their indices into sel)
 * kept exact, the rest rounded without them */
void bs_numerics_round(int rule, const float * x, int64_t K, float * out, int outliers, int32_t * sel);
/* the column's m largest among the npool channels of pool (into sel; all of them where m >= npool)
 * exact, the rest rounded */
void bs_numerics_round_pool(int rule, const float * x, int64_t K, float * out, int m, const int32_t * pool, int npool,
                            int32_t * sel);
/* out (not x) = x - x rounded by rule: the rounding's error, which a second product corrects
 * (bitsplit_ctx_set_compensation) */
void bs_numerics_error(int rule, const float * x, int64_t K, float * out);
int bs_resolve_precision(const struct bitsplit_ctx * ctx, enum ggml_type base, enum ggml_type res);
/* ctx's act_bits for a product with a residual of type res: 8-bit activations (true) or 16 */
bool bs_resolve_act8(const struct bitsplit_ctx * ctx, enum ggml_type res);
size_t bs_job_acts_size(const struct bitsplit_ctx * ctx, const bs_job * job);
void bs_run_job(struct bitsplit_ctx * ctx, const bs_job * job, int ith, int nth);
void bs_count_job(struct bitsplit_ctx * ctx, const bs_job * job, uint64_t t0, bool add);
void bs_fill_job(bs_job * job, const bs_entry * e, const uint8_t * w2, int64_t row0, int64_t N);
/* after bs_fill_job (and clearing r for the base alone): the product's n_cols columns, x packed
 * rows of K floats and y packed rows of N floats (NULL while only sizing the job), and the
 * precision for its types */
void bs_job_columns(bs_job * job, const struct bitsplit_ctx * ctx, const float * x, int64_t n_cols, float * y);
/* custom_op.c keeps a node's first op_params bytes here while the node is this library's custom op */
#define BS_STASH_BYTES 40

/* attn.c: attention for batch-invariant verification (the KV cache's products, the softmax) */
typedef struct bs_attn_args {
    const float * t; /* a's slice transposed: t[k * t_row + i0], f32, rows padded with zeros */
    int64_t t_row;   /* a multiple of 8, >= M */
    const char * b;  /* column 0: K f32 values */
    size_t b_col;    /* bytes between columns */
    char * y;        /* y[i1 * y_col bytes + i0]: f32 */
    size_t y_col;
    int64_t K, M;    /* terms per sum, outputs per column */
} bs_attn_args;
/* whether node t is a product / softmax attn.c computes (shapes, types, strides) */
bool bs_attn_shape_ok(const struct ggml_tensor * t);
bool bs_softmax_shape_ok(const struct ggml_tensor * t);
/* the custom ops (userdata: the bitsplit_ctx) */
void bs_attn_op(struct ggml_tensor * dst, int ith, int nth, void * userdata);
void bs_softmax_op(struct ggml_tensor * dst, int ith, int nth, void * userdata);
/* the portable kernels (tests compare the SIMD ones with them, bit for bit) */
void bs_attn_product_generic(const bs_attn_args * g, int64_t c0, int64_t c1);
void bs_attn_exp_row_generic(const float * x, float * y, int64_t n, float max);
#if defined(__x86_64__)
void bs_attn_product_avx2(const bs_attn_args * g, int64_t c0, int64_t c1);
void bs_attn_exp_row_avx2(const float * x, float * y, int64_t n, float max);
void bs_attn_transpose_avx2(const char * a, size_t a_row, bool f16, int64_t K, int64_t M, float * t, int64_t t_row);
#endif

/* a whole product on the library's own pool (add mode, bitsplit_ctx_matmul) */
int bs_run_on_pool(struct bitsplit_ctx * ctx, bs_job * job);
/* BITSPLIT_THREAD_MIN_KB in bytes (unset: BS_THREAD_MIN_BYTES); false for a value that is not a
 * non-negative whole number of KB */
bool bs_thread_min_bytes(int64_t * out);
/* the threads of the pool a product runs on (bs_run_on_pool): fewer for small products */
int bs_threads_for(const struct bitsplit_ctx * ctx, const bs_job * job);
/* the same for a given minimum of weight bytes per thread (0: every thread) */
int bs_threads_for_min(const struct bitsplit_ctx * ctx, const bs_job * job, int64_t min_bytes);

/* compensate.c: out[j] = W2_j . (x - round(x)) for the n (<= BS_OVERLAP_MAX) products of one input x
 * (n_cols columns of K floats on the host), computed by the device holding the weights w[j] (one
 * device; weights in host memory: the CPU device given), round() the rule of ctx->compensate for each
 * weight's type; false after recording an error */
typedef struct bs_comp bs_comp;
bool bs_compensate(struct bitsplit_ctx * ctx, const struct ggml_tensor * const * w, int n, const float * x,
                   int64_t n_cols, float * const * out);
/* the devices' backends and buffers freed (lost: let go without a word to the device) */
void bs_comp_free(struct bitsplit_ctx * ctx, bool lost);
/* add mode on the device: t (a product node in a device buffer, W2 . x) += delta (n_cols x N on the host)
 * and, compensating, + W2 . (x - round(x)) (x: the host's activations), by an in-place graph on t's
 * device; false after recording an error */
bool bs_device_add(struct bitsplit_ctx * ctx, struct ggml_tensor * t, const float * delta, const float * x);

/* overlap.c: R . x on a runner thread while the device computes W2 . x (add mode) */
bool bs_overlap_enable(struct bitsplit_ctx * ctx, bool on);
void bs_overlap_free(struct bitsplit_ctx * ctx);
/* wait until the runner is idle: before anything else uses the pool, acts, scratch or barrier */
void bs_overlap_drain(struct bitsplit_ctx * ctx);
/* first passes: remember that x feeds e's product */
void bs_overlap_learn(struct bitsplit_ctx * ctx, const struct ggml_tensor * x, const bs_entry * e,
                      const struct ggml_tensor * w);
bool bs_overlap_is_feed(const struct bitsplit_ctx * ctx, const struct ggml_tensor * t);
/* x is computed: copy it and start R . x of every product it feeds */
void bs_overlap_start(struct bitsplit_ctx * ctx, const struct ggml_tensor * x);
/* with the overlap at products: the device computed e's product of x; if it is the first of x's
 * products (graph order, as learned), start them all as bs_overlap_start does */
void bs_overlap_start_at(struct bitsplit_ctx * ctx, const struct ggml_tensor * x, const bs_entry * e);
/* the device computed t = W2 . x: R . x for it (waiting for it if need be), or NULL if it was not
 * started from this very x (then compute it now) */
const float * bs_overlap_take(struct bitsplit_ctx * ctx, const struct ggml_tensor * t, const bs_entry * e);
/* the host's copy of product t's input x, made at x's stop (NULL if t was not started from it) */
const float * bs_overlap_x(const struct bitsplit_ctx * ctx, const struct ggml_tensor * t);

/* FNV-1a of a tensor or node name (the residual's name table, overlap's table of inputs) */
static inline uint64_t bs_hash_name(const char * s) {
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++) {
        h = (h ^ (uint8_t)*s) * 1099511628211ull;
    }
    return h;
}

static inline bool bs_host_tensor(const struct ggml_tensor * t) {
    return t->buffer != NULL && ggml_backend_buffer_is_host(t->buffer) && t->data != NULL;
}

/* custom_op.c: whether ggml's private custom-op parameters have the layout this library writes
 * (checked once per process) */
bool bs_custom_layout_ok(void);
/* node t turned into this library's custom op fn(userdata), its own op and first parameters kept
 * aside (BS_STASH_BYTES on); whether it is one; its own op given back */
void bs_custom_mutate(struct ggml_tensor * t, ggml_custom_op_t fn, const void * userdata);
bool bs_custom_is_ours(const struct ggml_tensor * t);
void bs_custom_restore(struct ggml_tensor * t);

/* the residual types a split may hold */
static inline bool bs_residual_type(enum ggml_type t) {
    return t == GGML_TYPE_Q4_K || t == GGML_TYPE_Q5_K || t == GGML_TYPE_Q6_K || t == GGML_TYPE_Q8_0 ||
           t == GGML_TYPE_F16 || t == GGML_TYPE_F32;
}

/* The jobs the f32 SIMD families (avx2-f32, neon-f32) compute themselves: bases of the types
 * llama.cpp's Q2_K mix produces (Q2_K..Q6_K on rows of a multiple of 256, Q8_0/Q4_0/Q4_1 on rows
 * of a multiple of 32) and the quantized residual types (Q4_K, Q5_K, Q6_K, Q8_0). F32 precision, the exact
 * contract, stays with the generic family (tests compare it bit for bit). */
static inline bool bs_f32_family_type(enum ggml_type t, int64_t K) {
    switch (t) {
        case GGML_TYPE_Q2_K: case GGML_TYPE_Q3_K: case GGML_TYPE_Q4_K: case GGML_TYPE_Q5_K: case GGML_TYPE_Q6_K:
            return K % 256 == 0;
        case GGML_TYPE_Q8_0: case GGML_TYPE_Q4_0: case GGML_TYPE_Q4_1:
            return K % 32 == 0;
        default:
            return false;
    }
}

static inline bool bs_f32_family_supports(const bs_job * job) {
    if (job->precision == BITSPLIT_PREC_F32) {
        return false;
    }
    if (job->r != NULL && !(bs_residual_type(job->r_type) && job->r_type != GGML_TYPE_F16 &&
                            job->r_type != GGML_TYPE_F32 && bs_f32_family_type(job->r_type, job->K))) {
        return false;
    }
    return job->w2 == NULL || bs_f32_family_type(job->w2_type, job->K);
}

/* Q4_K / Q5_K: the 6-bit scale d and min m of sub-block j (0-7) from the 12 packed bytes q */
static inline void bs_k4_scale_min(int j, const uint8_t * q, uint8_t * d, uint8_t * m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
    }
}

/* All eight of Q4_K / Q5_K's 6-bit scales and mins at once (bs_k4_scale_min's values for j = 0..7,
 * as bytes 0-7 of *sc and *m), four bytes per 32-bit operation: the scalar loop over j, unrolled,
 * cost a Q5_K residual's unit more than its eight groups' products at one column (measured).
 * Byte j of a result is its bits 8j..8j+7 and the 32-bit loads take q[0] as the low byte: this
 * assumes a little-endian target (x86-64, AArch64; this header refuses a big-endian build). */
static inline void bs_k4_scales_mins(const uint8_t * q, uint64_t * sc, uint64_t * m) {
    uint32_t a, b, c;
    memcpy(&a, q, 4);
    memcpy(&b, q + 4, 4);
    memcpy(&c, q + 8, 4);
    const uint32_t low6 = 0x3F3F3F3Fu, low4 = 0x0F0F0F0Fu, bits45 = 0x30303030u;
    /* j < 4: q[j] & 63, q[j + 4] & 63; j >= 4: q[j + 4]'s nibble, and bits 6-7 of q[j - 4] (scales)
     * or q[j] (mins) as bits 4-5 (a byte's bits 6-7 shifted right by 2; the next byte's low bits
     * that the shift brings in are masked off) */
    const uint32_t s_hi = (c & low4) | ((a >> 2) & bits45), m_hi = ((c >> 4) & low4) | ((b >> 2) & bits45);
    const uint32_t s_lo = a & low6, m_lo = b & low6;
    *sc = s_lo | (uint64_t)s_hi << 32;
    *m = m_lo | (uint64_t)m_hi << 32;
}

/* Q3_K's sixteen 6-bit scales, packed in 12 bytes, as signed bytes still offset by 32 */
static inline void bs_q3k_scales(const uint8_t * s12, int8_t out[16]) {
    uint32_t aux[4];
    memcpy(aux, s12, 12);
    const uint32_t k1 = 0x03030303, k2 = 0x0f0f0f0f;
    const uint32_t tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4);
    aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4);
    aux[0] = (aux[0] & k2) | (((tmp >> 0) & k1) << 4);
    aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4);
    memcpy(out, aux, 16);
}

#endif
