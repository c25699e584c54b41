/*
 * Parity of ONE kernel family with ggml's dequantisation: kernels_avx2.c on x86-64, kernels_neon.c
 * on AArch64 (with -DPARITY_INT16: the integer families, kernels_avx2_int.c / kernels_neon_int.c), linked alone (no libggml: the family files use only ggml.h's types; scratch.c, os.c and
 * the architecture's cpu_feats.c are linked in, and iq2.c's functions are stubbed below: no IQ2 tables here, so the family never
 * takes an IQ2 base, which no parity case holds; tests/test_kernels.py checks those), so the AArch64
 * build is a static binary that runs under qemu-aarch64-static. With -DPARITY_X86_ALL every x86
 * family is linked in (the tile families' few ggml calls stubbed below) and --family names the one to
 * run: wine_parity.sh builds that for Linux and for Windows and compares the two.
 *
 *   kernel_parity VECTORS [--family NAME] [-v] [--dump FILE]
 *       VECTORS  written by native/tests/make_parity_vectors.py
 *       --dump   write every result of the batches of 16 (f32, case by case, mode by mode, column by
 *                column) to FILE: the families of two architectures can then be compared bit for bit
 *
 * Each case of the file (quantized base and residual rows, activations, float64 reference
 * products) is run in four modes, base + residual, residual alone (w2 NULL), base alone (r NULL)
 * and base alone as the fast drafter (job.draft), through the family's own interface (supports,
 * acts_size, prepare_acts, rows over row blocks of BS_ROW_BLOCK), for batches 1, 2, 3, 5 and 16,
 * with padded ldx / ldy. Checks:
 *   - every result within 1e-5 of max|ref| (the case and mode's largest reference value; the
 *     integer families: their activation rounding's size, TOL_MODE below);
 *   - batch invariance: each column bit-identical across the batches;
 *   - the same bits whatever the row split (row blocks of 16, one call, single rows);
 *   - accumulate: y += product gives the stored value plus the product, bit for bit;
 *   - rows outside [r0, r1) and padding of y untouched.
 * Prints one summary line `kernel_parity: PASS|FAIL: family, N cases, worst error E`; exit 1 on FAIL
 * (77 and `kernel_parity: SKIP: ...` where this CPU cannot run the family, e.g. x86 without AVX2).
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bitsplit.h"
#include "bs_internal.h"

#if defined(PARITY_X86_ALL) && defined(__x86_64__)
/* every x86 family linked in, the one to run named by --family (wine_parity.sh, which builds the
 * harness for Linux and for Windows and compares the two builds' results bit for bit) */
#define PARITY_ANY_FAMILY 1
extern const bs_kernel_family bs_family_avx2_f32, bs_family_avx2_int16, bs_family_avxvnni_int16,
    bs_family_avx512vnni_int16, bs_family_vnni_int24, bs_family_avx512_bf16, bs_family_amx_bf16;
#elif defined(PARITY_INT16) && defined(__x86_64__)
extern const bs_kernel_family bs_family_avx2_int16;
#define FAMILY bs_family_avx2_int16
#elif defined(PARITY_INT16) && defined(__aarch64__)
extern const bs_kernel_family bs_family_neon_int16;
#define FAMILY bs_family_neon_int16
#elif defined(__x86_64__)
extern const bs_kernel_family bs_family_avx2_f32;
#define FAMILY bs_family_avx2_f32
#elif defined(__aarch64__)
extern const bs_kernel_family bs_family_neon_f32;
#define FAMILY bs_family_neon_f32
#else
#error "kernel_parity: no SIMD kernel family for this architecture"
#endif

/* the tolerance of each mode (W2+R, R, W2, W2 draft, W2+R act8) against the float64 products, as a
 * fraction of the case and mode's max|ref|: the float families 1e-5; the integer families round each
 * activation to 2^-15 of its block's largest value (16 bits), and the residual alone to its high
 * digit (8 bits) in blocks without an outlier: held to those roundings' size (tests/test_kernels.py
 * holds avx2-int16 to 1e-5 against its own rounding's product; neon_qemu.sh requires the two integer
 * families to agree bit for bit); mode 3, the draft, takes one 8-bit digit per value (the vectors
 * hold an outlier channel, 60x the others, which takes most of its block's scale); mode 4 rounds the
 * verifier's activations to 8 bits as the residual alone does. The bf16 families round activations
 * to bf16 (8 significant bits) in every mode. */
#define TOL_F32_INIT {1e-5, 1e-5, 1e-5, 1e-5, 1e-5}
#define TOL_INT_INIT {1e-3, 5e-2, 1e-3, 2e-1, 5e-2}
#define TOL_BF16_INIT {2e-2, 5e-2, 2e-2, 2e-1, 5e-2}

#ifdef PARITY_ANY_FAMILY
#define PARITY_SKIPS_MODES 1
static const double TOL_F32[5] = TOL_F32_INIT, TOL_INT[5] = TOL_INT_INIT, TOL_BF16[5] = TOL_BF16_INIT;
static const struct {
    const bs_kernel_family * fam;
    const double * tol;
} FAMILIES[] = {
    {&bs_family_avx2_f32, TOL_F32},         {&bs_family_avx2_int16, TOL_INT},   {&bs_family_avxvnni_int16, TOL_INT},
    {&bs_family_avx512vnni_int16, TOL_INT}, {&bs_family_vnni_int24, TOL_INT},   {&bs_family_avx512_bf16, TOL_BF16},
    {&bs_family_amx_bf16, TOL_BF16},
};
static const bs_kernel_family * fam_p;
static const double * TOL_MODE;
#define FAMILY (*fam_p)
#elif defined(PARITY_INT16)
#define PARITY_SKIPS_MODES 0
static const double TOL_MODE[5] = TOL_INT_INIT;
#else
#define PARITY_SKIPS_MODES 0
static const double TOL_MODE[5] = TOL_F32_INIT;
#endif
#define PAD_X 8  /* ldx = K + PAD_X */
#define PAD_Y 3  /* ldy = N + PAD_Y */
#define SENTINEL 1234.5f

/* iq2.c needs libggml (its tables are read from ggml's dequantizer): without them, no IQ2 base */
const bs_iq_tables * bs_iq_get_tables(void) {
    static const bs_iq_tables none; /* iq2_ok, iq3s_ok false */
    return &none;
}
bool bs_iq_decoder_agrees(enum ggml_type type, void (*decode)(enum ggml_type type, const uint8_t * block, float * out)) {
    (void)type;
    (void)decode;
    return false;
}

static bool block_of(uint32_t t, int64_t * blck, size_t * bytes);

#ifdef PARITY_ANY_FAMILY
/* the tile families ask ggml for block sizes and turn a base type they have no decoder of into f32
 * through ggml's dequantizer (util.c): the types of this file are known here, and each has its
 * decoder, so no row reaches bs_dequant_row */
int64_t ggml_blck_size(enum ggml_type type) {
    int64_t blck = 0;
    size_t bytes = 0;
    return block_of((uint32_t)type, &blck, &bytes) ? blck : 0;
}
size_t ggml_type_size(enum ggml_type type) {
    int64_t blck = 0;
    size_t bytes = 0;
    return block_of((uint32_t)type, &blck, &bytes) ? bytes : 0;
}
bool bs_type_readable(enum ggml_type type) { return ggml_blck_size(type) > 0; }
void bs_dequant_row(enum ggml_type type, const void * row, float * out, int64_t k) {
    (void)row;
    (void)out;
    (void)k;
    fprintf(stderr, "kernel_parity: a family asked ggml's dequantizer for type %d (not linked here)\n", (int)type);
    exit(2);
}
#endif

static const char * type_name(uint32_t t) {
    switch (t) {
        case GGML_TYPE_Q2_K: return "Q2_K";
        case GGML_TYPE_Q3_K: return "Q3_K";
        case GGML_TYPE_Q4_K: return "Q4_K";
        case GGML_TYPE_Q5_K: return "Q5_K";
        case GGML_TYPE_Q6_K: return "Q6_K";
        case GGML_TYPE_Q8_0: return "Q8_0";
        case GGML_TYPE_Q4_0: return "Q4_0";
        case GGML_TYPE_Q4_1: return "Q4_1";
        default: return "?";
    }
}

/* elements and bytes per block of the types a split holds (ggml_blck_size / ggml_type_size) */
static bool block_of(uint32_t t, int64_t * blck, size_t * bytes) {
    static const struct { uint32_t t; int64_t blck; size_t bytes; } tab[] = {
        {GGML_TYPE_Q2_K, 256, 84},  {GGML_TYPE_Q3_K, 256, 110}, {GGML_TYPE_Q4_K, 256, 144},
        {GGML_TYPE_Q5_K, 256, 176}, {GGML_TYPE_Q6_K, 256, 210}, {GGML_TYPE_Q8_0, 32, 34},
        {GGML_TYPE_Q4_0, 32, 18},   {GGML_TYPE_Q4_1, 32, 20},
    };
    for (size_t i = 0; i < sizeof(tab) / sizeof(tab[0]); i++) {
        if (tab[i].t == t) {
            *blck = tab[i].blck;
            *bytes = tab[i].bytes;
            return true;
        }
    }
    return false;
}

static int n_fail = 0;
static int verbose = 0;

static void fail(const char * fmt, ...) __attribute__((format(printf, 1, 2)));
static void fail(const char * fmt, ...) {
    if (n_fail++ < 20) {
        va_list ap;
        va_start(ap, fmt);
        fputs("kernel_parity: ", stderr);
        vfprintf(stderr, fmt, ap);
        fputc('\n', stderr);
        va_end(ap);
    }
}

static bool read_all(FILE * f, void * p, size_t n) { return fread(p, 1, n, f) == n; }

typedef struct {
    uint32_t bt, rt, K, N, brb, rrb;
    uint8_t * w2;
    uint8_t * r;
    float * x;    /* max_cols x K */
    double * ref; /* 3 x max_cols x N */
} pcase;

/* mode 3: the base alone as the fast drafter asks for it (job.draft), against mode 2's reference;
 * mode 4: W2 + R with 8-bit verifier activations (job.act8), against mode 0's */
#define N_MODES 5
static const char * MODE[N_MODES] = {"W2+R", "R", "W2", "W2 draft", "W2+R act8"};

/* the job of one run: y (n_cols columns of ldy = N + PAD_Y) = the product of the case in this mode
 * (accumulate: y += it) */
static void make_job(const pcase * c, int mode, int n_cols, const float * xpad, float * y, bool accumulate,
                     bs_job * job) {
    memset(job, 0, sizeof(*job));
    job->w2 = mode == 1 ? NULL : c->w2;
    job->r = mode == 2 || mode == 3 ? NULL : c->r;
    job->draft = mode == 3;
    job->act8 = mode == 4;
    job->w2_type = (enum ggml_type)c->bt;
    job->r_type = (enum ggml_type)c->rt;
    job->w2_row_bytes = c->brb;
    job->r_row_bytes = c->rrb;
    job->K = c->K;
    job->N = c->N;
    job->x = xpad;
    job->ldx = c->K + PAD_X;
    job->n_cols = n_cols;
    job->y = y;
    job->ldy = c->N + PAD_Y;
    job->accumulate = accumulate;
    /* the families serve the default (BF16) precision; F32 belongs to the generic family */
    job->precision = BITSPLIT_PREC_BF16;
}

static bool mode_supported(const pcase * c, int mode) {
    bs_job job;
    make_job(c, mode, 1, NULL, NULL, false, &job);
    return FAMILY.supports(&job);
}

/* one run: y (n_cols columns of ldy = N + PAD_Y, padding set to SENTINEL) = the product; rows in
 * calls of `split` rows (0: one call); accumulate adds to what y holds */
static bool run(const pcase * c, int mode, int n_cols, const float * xpad, float * y, int64_t split, bool accumulate,
                bs_scratch * scratch) {
    const int64_t K = c->K, N = c->N;
    bs_job job;
    make_job(c, mode, n_cols, xpad, y, accumulate, &job);
    if (!FAMILY.supports(&job)) {
        fail("%s does not support %s + %s (%s), K=%lld", FAMILY.name, type_name(c->bt), type_name(c->rt), MODE[mode],
             (long long)K);
        return false;
    }
    const size_t as = FAMILY.acts_size(&job);
    void * acts = NULL;
    if (as > 0) {
        if ((acts = bs_aligned_alloc(64, as + 64)) == NULL) {
            fail("out of memory");
            return false;
        }
        job.acts = acts;
        FAMILY.prepare_acts(&job, 0, n_cols);
    }
    if (split <= 0) {
        FAMILY.rows(&job, 0, N, scratch);
    } else {
        for (int64_t r0 = 0; r0 < N; r0 += split) {
            FAMILY.rows(&job, r0, r0 + split < N ? r0 + split : N, scratch);
        }
    }
    bs_aligned_free(acts);
    return true;
}

static bool same_bits(float a, float b) { return memcmp(&a, &b, sizeof(float)) == 0; }

int main(int argc, char ** argv) {
    const char * path = NULL, * dump_path = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "-v") == 0) {
            verbose = 1;
        } else if (strcmp(argv[i], "--dump") == 0 && i + 1 < argc) {
            dump_path = argv[++i];
#ifdef PARITY_ANY_FAMILY
        } else if (strcmp(argv[i], "--family") == 0 && i + 1 < argc) {
            const char * name = argv[++i];
            for (size_t k = 0; k < sizeof(FAMILIES) / sizeof(FAMILIES[0]); k++) {
                if (strcmp(FAMILIES[k].fam->name, name) == 0) {
                    fam_p = FAMILIES[k].fam;
                    TOL_MODE = FAMILIES[k].tol;
                }
            }
            if (fam_p == NULL) {
                fprintf(stderr, "kernel_parity: --family %s: not one of this build's families:", name);
                for (size_t k = 0; k < sizeof(FAMILIES) / sizeof(FAMILIES[0]); k++) {
                    fprintf(stderr, " %s", FAMILIES[k].fam->name);
                }
                fputc('\n', stderr);
                return 2;
            }
#endif
        } else {
            path = argv[i];
        }
    }
#ifdef PARITY_ANY_FAMILY
    if (path == NULL || fam_p == NULL) {
        fprintf(stderr, "usage: kernel_parity VECTORS --family NAME [-v] [--dump FILE]\n");
        return 2;
    }
#else
    if (path == NULL) {
        fprintf(stderr, "usage: kernel_parity VECTORS [-v] [--dump FILE]\n");
        return 2;
    }
#endif
    if (!FAMILY.available()) {
        printf("kernel_parity: SKIP: %s, this CPU cannot run it\n", FAMILY.name);
        return 77;
    }
    FILE * f = fopen(path, "rb");
    if (f == NULL) {
        perror(path);
        return 2;
    }
    char magic[8];
    uint32_t hdr[2];
    if (!read_all(f, magic, 8) || memcmp(magic, "BSPARV01", 8) != 0 || !read_all(f, hdr, sizeof(hdr))) {
        fprintf(stderr, "kernel_parity: %s: not a parity vector file\n", path);
        return 2;
    }
    const uint32_t n_cases = hdr[0], max_cols = hdr[1];
    static const int BATCHES[] = {1, 2, 3, 5, 16};
    const int NB = (int)(sizeof(BATCHES) / sizeof(BATCHES[0]));
    if (max_cols < 16) {
        fprintf(stderr, "kernel_parity: %s has %u columns per case, 16 needed\n", path, max_cols);
        return 2;
    }
    FILE * dump = NULL;
    if (dump_path != NULL && (dump = fopen(dump_path, "wb")) == NULL) {
        perror(dump_path);
        return 2;
    }
    bs_scratch scratch = {NULL, 0};
    double worst = 0.0;
    int n_checked = 0, n_runs = 0, n_unsupported = 0;
    const char * worst_at = "";
    static char worst_buf[160];
    for (uint32_t ci = 0; ci < n_cases; ci++) {
        pcase c;
        memset(&c, 0, sizeof(c));
        if (!read_all(f, &c.bt, 6 * sizeof(uint32_t))) {
            fprintf(stderr, "kernel_parity: %s: truncated at case %u\n", path, ci);
            return 2;
        }
        int64_t bb, rbk;
        size_t bsz, rsz;
        if (!block_of(c.bt, &bb, &bsz) || !block_of(c.rt, &rbk, &rsz) || c.K % bb || c.K % rbk ||
            c.brb != c.K / bb * bsz || c.rrb != c.K / rbk * rsz) {
            fprintf(stderr, "kernel_parity: case %u: unexpected types %u/%u or row sizes %u/%u for K=%u\n", ci, c.bt,
                    c.rt, c.brb, c.rrb, c.K);
            return 2;
        }
        const int64_t K = c.K, N = c.N, ldx = K + PAD_X, ldy = N + PAD_Y;
        c.w2 = malloc((size_t)N * c.brb);
        c.r = malloc((size_t)N * c.rrb);
        c.x = malloc((size_t)max_cols * K * sizeof(float));
        c.ref = malloc((size_t)3 * max_cols * N * sizeof(double));
        float * xpad = malloc((size_t)max_cols * ldx * sizeof(float));
        float * ys[16];
        float * yacc = malloc((size_t)max_cols * ldy * sizeof(float));
        for (int b = 0; b < NB; b++) ys[b] = malloc((size_t)max_cols * ldy * sizeof(float));
        if (!c.w2 || !c.r || !c.x || !c.ref || !xpad || !yacc) {
            fprintf(stderr, "kernel_parity: out of memory\n");
            return 2;
        }
        if (!read_all(f, c.w2, (size_t)N * c.brb) || !read_all(f, c.r, (size_t)N * c.rrb) ||
            !read_all(f, c.x, (size_t)max_cols * K * sizeof(float)) ||
            !read_all(f, c.ref, (size_t)3 * max_cols * N * sizeof(double))) {
            fprintf(stderr, "kernel_parity: %s: truncated at case %u\n", path, ci);
            return 2;
        }
        for (uint32_t col = 0; col < max_cols; col++) {
            memcpy(xpad + col * ldx, c.x + (size_t)col * K, (size_t)K * sizeof(float));
            for (int p = 0; p < PAD_X; p++) xpad[col * ldx + K + p] = NAN; /* never read */
        }
        for (int mode = 0; mode < N_MODES; mode++) {
            /* the bf16 families take W2 + R alone (the base alone and the draft are other families'):
             * with every family linked in, a mode a family does not take is counted, not run; the
             * one-family builds take every mode (run() fails a mode that is not taken) */
            if (PARITY_SKIPS_MODES && !mode_supported(&c, mode)) {
                n_unsupported++;
                continue;
            }
            const double * ref = c.ref + (size_t)(mode == 3 ? 2 : mode == 4 ? 0 : mode) * max_cols * N;
            double scale = 0.0, err = 0.0;
            for (int64_t i = 0; i < (int64_t)max_cols * N; i++) scale = fmax(scale, fabs(ref[i]));
            if (scale == 0.0) scale = 1.0;
            char where[96];
            snprintf(where, sizeof(where), "%s + %s K=%u N=%u %s", type_name(c.bt), type_name(c.rt), c.K, c.N,
                     MODE[mode]);
            for (int b = 0; b < NB; b++) {
                const int nc = BATCHES[b];
                float * y = ys[b];
                for (int64_t i = 0; i < (int64_t)max_cols * ldy; i++) y[i] = SENTINEL;
                if (!run(&c, mode, nc, xpad, y, BS_ROW_BLOCK, false, &scratch)) break;
                n_runs++;
                for (int col = 0; col < nc; col++) {
                    for (int64_t row = 0; row < N; row++) {
                        const double e = fabs((double)y[col * ldy + row] - ref[col * N + row]) / scale;
                        if (!(e <= err)) err = isnan(e) ? INFINITY : e;
                    }
                    for (int p = 0; p < PAD_Y; p++) {
                        if (!same_bits(y[col * ldy + N + p], SENTINEL)) {
                            fail("%s batch %d: wrote past row N in column %d", where, nc, col);
                            break;
                        }
                    }
                }
                for (int64_t i = (int64_t)nc * ldy; i < (int64_t)max_cols * ldy; i++) {
                    if (!same_bits(y[i], SENTINEL)) {
                        fail("%s batch %d: wrote past column %d", where, nc, nc);
                        break;
                    }
                }
            }
            if (dump != NULL) {
                for (int col = 0; col < 16; col++) {
                    if (fwrite(ys[NB - 1] + col * ldy, sizeof(float), (size_t)N, dump) != (size_t)N) {
                        fail("cannot write %s", dump_path);
                    }
                }
            }
            /* batch invariance: every column as in the batch of 16 */
            for (int b = 0; b + 1 < NB; b++) {
                for (int col = 0; col < BATCHES[b]; col++) {
                    for (int64_t row = 0; row < N; row++) {
                        if (!same_bits(ys[b][col * ldy + row], ys[NB - 1][col * ldy + row])) {
                            fail("%s: column %d row %lld differs between batch %d (%.9g) and 16 (%.9g)", where, col,
                                 (long long)row, BATCHES[b], ys[b][col * ldy + row], ys[NB - 1][col * ldy + row]);
                            col = BATCHES[b];
                            break;
                        }
                    }
                }
            }
            /* row splits: one call, and one row per call, give the same bits as blocks of 16 */
            for (int s = 0; s < 2; s++) {
                const int nc = 3; /* ys[2] */
                for (int64_t i = 0; i < (int64_t)max_cols * ldy; i++) yacc[i] = SENTINEL;
                if (!run(&c, mode, nc, xpad, yacc, s == 0 ? 0 : 1, false, &scratch)) break;
                n_runs++;
                for (int64_t i = 0; i < (int64_t)nc * ldy; i++) {
                    if (!same_bits(yacc[i], ys[2][i])) {
                        fail("%s: %s differs from row blocks of %d at column %lld row %lld", where,
                             s == 0 ? "one call" : "one row per call", BS_ROW_BLOCK, (long long)(i / ldy),
                             (long long)(i % ldy));
                        break;
                    }
                }
            }
            /* accumulate: y0 + product, bit for bit (batch 5) */
            {
                const int nc = 5;
                for (int64_t i = 0; i < (int64_t)max_cols * ldy; i++) yacc[i] = (float)((i % 7) - 3) * 0.37f;
                if (run(&c, mode, nc, xpad, yacc, BS_ROW_BLOCK, true, &scratch)) {
                    n_runs++;
                    for (int col = 0; col < nc; col++) {
                        for (int64_t row = 0; row < N; row++) {
                            const int64_t i = col * ldy + row;
                            const float want = (float)((i % 7) - 3) * 0.37f + ys[3][i];
                            if (!same_bits(yacc[i], want)) {
                                fail("%s: accumulate column %d row %lld: %.9g, expected %.9g", where, col,
                                     (long long)row, yacc[i], want);
                                col = nc;
                                break;
                            }
                        }
                    }
                }
            }
            n_checked++;
            if (!(err <= TOL_MODE[mode])) {
                fail("%s: error %.3g of max|ref| (%.4g), tolerance %.0e", where, err, scale, TOL_MODE[mode]);
            }
            if (verbose) {
                printf("  %-32s error %.3g\n", where, err);
            }
            if (!(err <= worst)) {
                worst = err;
                snprintf(worst_buf, sizeof(worst_buf), " (%s)", where);
                worst_at = worst_buf;
            }
        }
        for (int b = 0; b < NB; b++) free(ys[b]);
        free(yacc);
        free(xpad);
        free(c.w2);
        free(c.r);
        free(c.x);
        free(c.ref);
    }
    fclose(f);
    if (dump != NULL && fclose(dump) != 0) {
        fail("cannot write %s", dump_path);
    }
    bs_aligned_free(scratch.buf);
    char skipped[64] = "";
    if (n_unsupported > 0) {
        snprintf(skipped, sizeof(skipped), ", %d case modes the family does not take", n_unsupported);
    }
    printf("kernel_parity: %s: %s, %d cases, worst error %.3g%s (%d runs, batches 1,2,3,5,16, tolerance %.0e "
           "W2+R, %.0e R, %.0e W2, %.0e W2 draft, %.0e W2+R act8%s)\n", n_fail == 0 && n_checked > 0 ? "PASS" : "FAIL",
           FAMILY.name, n_checked, worst, worst_at, n_runs, TOL_MODE[0], TOL_MODE[1], TOL_MODE[2], TOL_MODE[3], TOL_MODE[4],
           skipped);
    return n_fail == 0 && n_checked > 0 ? 0 : 1;
}
