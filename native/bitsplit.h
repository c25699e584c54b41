/*
 * bitsplit: residual weights in host memory, applied inside llama.cpp's graph.
 *
 * A bitsplit context holds residual.gguf (memory-mapped, never copied), checked against the base
 * model it corrects. Installed as a llama.cpp eval callback (llama_context_params.cb_eval, with
 * cb_eval_user_data = the context), it turns every weight product of the base into the verifier's:
 *
 *   MUL_MAT(W2, x)      ->  (W2 + R) . x
 *   GET_ROWS(W2, ids)   ->  W2[ids] + R[ids]              (token embeddings)
 *   MUL_MAT_ID(W2, x)   ->  (W2_e + R_e) . x per expert   (mixture of experts)
 *
 * On the CPU the node is computed by this library instead of ggml's kernel (one pass over both
 * halves of each weight block for the whole batch, with full-precision activations). A node that
 * lives in a device buffer (GPU offload) keeps the device's W2 . x and gets R . x added, computed
 * here from activations copied with ggml_backend_tensor_get/set (unverified until a GPU run).
 * Disabled, the callback observes nothing and the graph runs untouched (the drafter).
 *
 * Every function returns a bitsplit_status; bitsplit_status_str() names it. Messages that need
 * detail (which file, which tensor) are written to the caller's buffer.
 */
#ifndef BITSPLIT_H
#define BITSPLIT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_tensor;

typedef struct bitsplit_ctx bitsplit_ctx;

enum bitsplit_status {
    BITSPLIT_OK = 0,
    BITSPLIT_E_IO = 1,          /* a file cannot be opened, read or mapped */
    BITSPLIT_E_FORMAT = 2,      /* not a well-formed (bitsplit) GGUF */
    BITSPLIT_E_MISMATCH = 3,    /* residual and base do not belong together */
    BITSPLIT_E_UNSUPPORTED = 4, /* a tensor type or shape this library cannot apply */
    BITSPLIT_E_NOMEM = 5,
    BITSPLIT_E_INVALID = 6,     /* a bad argument */
    BITSPLIT_E_STATE = 7,       /* an error was recorded while evaluating a graph */
};

/* precision of the verifier's products (activations and combined weights) */
enum bitsplit_precision {
    BITSPLIT_PREC_AUTO = 0,     /* BF16 for quantized weights, F32 when a half is F32/F16 */
    BITSPLIT_PREC_F32 = 1,      /* exact: f32 weights (W2 + R) and f32 activations */
    BITSPLIT_PREC_BF16 = 2,     /* bf16(W2 + R) . bf16(x), products exact, f32 accumulation */
};

/* the verifier's activations in the 16-bit integer families (avx2-int16, avxvnni-int16,
 * avx512vnni-int16, neon-int16), which round each block of 256 (or 32) values to integers |X| <= 32512
 * kept as two base-255 digits; the other families ignore it */
enum bitsplit_act_bits {
    BITSPLIT_ACTS_AUTO = 0,     /* 8 with a Q6_K residual on x86 CPUs without AVX-512 (under the cap), else 16 */
    BITSPLIT_ACTS_16 = 1,       /* both digits in every block */
    BITSPLIT_ACTS_8 = 2,        /* the high digit alone (8 bits) for W2 + R in every block whose largest value
                                   is within 16x its mean magnitude; a block with an outlier keeps both */
};

/* how a hooked product is applied */
enum bitsplit_mode {
    BITSPLIT_MODE_AUTO = 0,     /* CPU nodes: replace; device nodes: add */
    BITSPLIT_MODE_ADD = 1,      /* keep the graph's W2 . x and add R . x afterwards (GPU path) */
};

typedef struct bitsplit_counters {
    uint64_t n_products;        /* weight products computed as (W2 + R) . x */
    uint64_t n_add_products;    /* products corrected by adding R . x after the graph's node */
    uint64_t n_get_rows;        /* embedding lookups corrected */
    uint64_t n_columns;         /* activation columns over all hooked products */
    uint64_t bytes_residual;    /* residual bytes read */
    uint64_t bytes_base;        /* base weight bytes read by this library */
    uint64_t ns_inside;         /* wall time inside this library's products, nanoseconds */
    uint64_t n_errors;          /* graph nodes refused (recorded error; see bitsplit_ctx_take_error) */
    uint64_t n_draft_products;  /* base-only products computed here for the drafter (fast drafter) */
    uint64_t ns_draft;          /* wall time inside those, nanoseconds */
    uint64_t bytes_from_device; /* add mode: activations and W2 . x read from device buffers */
    uint64_t bytes_to_device;   /* add mode: corrected results written back to device buffers */
    uint64_t ns_transfer;       /* wall time in those reads and writes, nanoseconds */
    uint64_t n_overlapped;      /* add-mode products whose R . x ran while the device computed W2 . x */
    uint64_t ns_wait;           /* time the graph waited for such an R . x after the device's part */
    uint64_t n_stops;           /* nodes the graph stopped after for this library (each a device sync) */
    uint64_t n_exact_products;  /* base weights without residual computed here (batch invariance) */
    uint64_t n_attn_products;   /* attention's KV-cache products (KQ, KQV) computed here (batch invariance) */
    uint64_t ns_attn;           /* wall time inside those, nanoseconds */
    uint64_t n_softmax;         /* attention's softmaxes computed here (batch invariance) */
    uint64_t bytes_outlier_base; /* emulated device numerics with outlier channels: base bytes the host
                                    would read for them (each product's blocks holding its rows' channels) */
    uint64_t n_compensated;     /* products whose device rounding a second product corrected (on the device) */
    uint64_t ns_compensate;     /* wall time of those second products (error, transfers, the device's graph) */
} bitsplit_counters;

const char * bitsplit_status_str(int status);

/* Open residual_path (mmap) and check it against the base GGUF at base_path: every residual
 * tensor must name a base tensor of the same shape, of a type this library can read, and the
 * residual type must be Q4_K, Q5_K, Q6_K, Q8_0, F16 or F32. On failure *out is NULL and err holds one line. */
int bitsplit_ctx_load(const char * residual_path, const char * base_path, bitsplit_ctx ** out,
                      char * err, size_t err_size);
void bitsplit_ctx_free(bitsplit_ctx * ctx);

int64_t bitsplit_ctx_n_tensors(const bitsplit_ctx * ctx);
/* name, GGUF-order shape (ne[4]), base and residual ggml types of residual tensor i */
int bitsplit_ctx_tensor_info(const bitsplit_ctx * ctx, int64_t i, const char ** name, int64_t ne[4],
                             int * base_type, int * res_type);

void bitsplit_ctx_set_enabled(bitsplit_ctx * ctx, bool enabled);
/* With the residual disabled, compute the base's own weight products here too (CPU nodes only),
 * with the integer kernel: a faster drafter on CPUs. Off: the disabled callback observes nothing. */
void bitsplit_ctx_set_draft_kernel(bitsplit_ctx * ctx, bool on);
/* A draft vocabulary: with the draft kernel on, drafting passes compute the output head
 * (output.weight, kept exact, on the CPU) for token ids [0, rows) and [tail, n_vocab) alone, here,
 * and give the others -inf: the head's bytes in a drafting pass shrink to that share (BPE vocabularies
 * number their tokens roughly by frequency; the tail holds the control tokens). rows = 0: the whole
 * head (ggml's product). BITSPLIT_E_INVALID unless 0 <= rows <= tail. */
int  bitsplit_ctx_set_draft_vocab(bitsplit_ctx * ctx, int64_t rows, int64_t tail);
bool bitsplit_ctx_get_enabled(const bitsplit_ctx * ctx);
int  bitsplit_ctx_set_precision(bitsplit_ctx * ctx, int precision);
/* enum bitsplit_act_bits; BITSPLIT_E_INVALID for another value */
int  bitsplit_ctx_set_act_bits(bitsplit_ctx * ctx, int act_bits);
/* the verifier's activation bits (8 or 16) for products with a residual of ggml type res_type under
 * ctx's setting on this CPU (the cap BITSPLIT_MAX_ISA included); -1 for a NULL ctx */
int  bitsplit_ctx_act_bits(const bitsplit_ctx * ctx, int res_type);
int  bitsplit_ctx_set_mode(bitsplit_ctx * ctx, int mode);
/* Add mode only: where R . x starts on this library's threads.
 * BITSPLIT_OVERLAP_INPUTS (the default): as soon as the product's input is computed (learned from the
 * first pass: which graph nodes feed residual products; the graph stops there too), so that it runs
 * while the device computes W2 . x; the sum is made when the device's node completes.
 * BITSPLIT_OVERLAP_PRODUCTS: the graph stops at products only; at the first product of an input its
 * R . x starts, and the rest of that input's products (k and v after q, up after gate) run beside
 * the device's. One stop per product, for a device whose W2 . x is short beside the host's R . x.
 * BITSPLIT_OVERLAP_OFF: R . x of each product after the device's node (one after the other). */
enum {
    BITSPLIT_OVERLAP_OFF = 0,
    BITSPLIT_OVERLAP_INPUTS = 1,
    BITSPLIT_OVERLAP_PRODUCTS = 2,
};
int  bitsplit_ctx_set_overlap(bitsplit_ctx * ctx, int where);
/* Batch-invariant verification, on by default: the family pinned for decode passes serves every
 * batch size (a prompt's too, unless decoded in prompt mode: bitsplit_ctx_set_prompt), and the
 * base's weights that have no residual (the output head, tensors the split kept exact) are
 * computed by this library's kernels instead of ggml's, whose arithmetic changes with the batch
 * size. A verified row's logits then do not depend on the rest of its batch (as far as the graph's
 * other nodes allow). Off: those products stay with ggml. */
int  bitsplit_ctx_set_batch_invariant(bitsplit_ctx * ctx, bool on);
bool bitsplit_ctx_get_batch_invariant(const bitsplit_ctx * ctx);
/* Emulated device numerics (bitsplit eval --device-numerics; numerics.c gives each rule and its
 * source in llama.cpp): with the base computed here (replace mode, batch-invariant or not), each
 * product of the base's weights rounds its activations as that backend's kernels would before
 * W2 . x, then adds R . x as add mode computes it on the host from the exact activations, so that
 * the all-local verifier scores as it would with its base on that device. Weights the split kept
 * exact are rounded too where this library computes them (batch-invariant mode); expert weights
 * (MUL_MAT_ID) are refused (an error for the pass). HOST, the default: (W2 + R) . x on the exact
 * activations. BITSPLIT_E_INVALID for another value. */
enum bitsplit_numerics {
    BITSPLIT_NUMERICS_HOST = 0,
    BITSPLIT_NUMERICS_CPU = 1,       /* ggml-cpu: Q8_K per 256 for K-quant and IQ weights, Q8_0 per 32 else */
    BITSPLIT_NUMERICS_CUDA = 2,      /* ggml-cuda: q8_1 per 32 up to 8 rows, mmq's layouts above */
    BITSPLIT_NUMERICS_CUDA_MMVQ = 3, /* ggml-cuda's 1-8 row rule at every batch size */
    BITSPLIT_NUMERICS_METAL = 4,     /* ggml-metal: floats up to 8 rows, half above */
    BITSPLIT_NUMERICS_FLOAT = 5,     /* a device that keeps floats: W2 . x exact, R . x as add mode computes it */
};
/* outliers (0 to BITSPLIT_MAX_OUTLIERS): a correction measured before it is built: in each row the
 * `outliers` channels of largest magnitude are left out of the device's rounding (they no longer set
 * their blocks' scales) and taken exactly, as the host would add W2[:, S] . x[S] from the base's
 * blocks holding them (counted in bytes_outlier_base). */
#define BITSPLIT_MAX_OUTLIERS 64
int bitsplit_ctx_set_numerics(bitsplit_ctx * ctx, int numerics, int outliers);
/* Compensation of a device's activation rounding: `numerics` names the rule the device rounds the
 * activations by before W2 . x (BITSPLIT_NUMERICS_HOST: off, the default). The host knows x and the
 * rule, so it knows the rounding's error e = x - round(x) exactly; a second product of the base,
 * W2 . e, rounded by the device as it rounds anything (e's own scale is ~1/254 of x's, so what is left
 * is ~254 times smaller), is added with R . x: in add mode computed by the device that holds W2 (its
 * backend, on a graph of its own; e up, W2 . e down), under emulated numerics
 * (bitsplit_ctx_set_numerics) emulated here. No extra host bytes; the device computes each base
 * product twice. cpu_device (a ggml_backend_dev_t, or NULL): the device that computes W2 . e for weights
 * in host memory (add mode run locally), whose buffers name none: llama.cpp's CPU device,
 * ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU) of libggml, which this library does not link
 * (NULL keeps the one given before). BITSPLIT_E_INVALID for another value, or with outlier channels set. */
int bitsplit_ctx_set_compensation(bitsplit_ctx * ctx, int numerics, void * cpu_device);
/* The backends and buffers compensation opened on devices, freed (before the model that holds the
 * weights goes; the next compensated pass opens them again), or with lost (the device is gone, e.g. an
 * RPC server that stopped answering) let go without a word to the device. bitsplit_ctx_free frees them. */
void bitsplit_ctx_release_devices(bitsplit_ctx * ctx, bool lost);
/* Add mode's sum made on the device (on: the default): for a product node in a device buffer, R . x
 * (and, compensating, W2 . e) goes up and a graph on the device adds it in place, instead of W2 . x
 * coming to the host and the sum going back: half the bytes, and on llama.cpp's RPC client no round
 * trip per product. Off: the sum on the host. */
void bitsplit_ctx_set_device_add(bitsplit_ctx * ctx, bool on);
/* A fixed set of exact channels for the weight `name` under emulated numerics (each in [0, row
 * width), at most BITSPLIT_MAX_OUTLIERS; n = 0 clears it): every row takes these instead of its own
 * largest (the set an importance matrix names; the host would hold those columns as a dense slab of
 * N x n halves, counted in bytes_outlier_base); with bitsplit_ctx_set_numerics's outliers > 0, each
 * row takes its `outliers` largest among them. While any weight has a set, a weight without one takes
 * no exact channels. BITSPLIT_E_INVALID for an unknown name or bad channels (the set is then unchanged). */
int bitsplit_ctx_set_exact_channels(bitsplit_ctx * ctx, const char * name, int n, const int32_t * channels);
/* x (n_cols columns of K floats) rounded as `numerics` (with `outliers` exact channels per column)
 * rounds the activations of a pass of n_cols rows for weights of ggml type weight_type, into out
 * (which may be x). BITSPLIT_E_UNSUPPORTED where that backend has no rule here for the type (or K is
 * not a multiple of the rule's block), BITSPLIT_E_INVALID for a bad argument. */
int bitsplit_round_activations(int numerics, int weight_type, int64_t K, int64_t n_cols, int outliers, const float * x,
                               float * out);
/* While on, the passes are a prompt's: their products take the kernel policy's family for a
 * 64-row batch, whatever each pass's size, instead of the pinned family (BITSPLIT_KERNEL's pin
 * still holds). A prompt's rows are computed once, never verified again in another pass, so their
 * arithmetic need not be the generation's; one family for all of them keeps a prompt token's value
 * independent of how the prompt was cut into batches (or where a cached prefix ended). The pinned
 * family, chosen for decode passes of a few rows, can be several times slower on 64-row batches.
 * Off by default. */
int  bitsplit_ctx_set_prompt(bitsplit_ctx * ctx, bool on);
bool bitsplit_ctx_get_prompt(const bitsplit_ctx * ctx);
/* threads for work outside ggml's own thread pool (add mode, bitsplit_ctx_matmul) */
int  bitsplit_ctx_set_threads(bitsplit_ctx * ctx, int n_threads);

void bitsplit_ctx_get_counters(const bitsplit_ctx * ctx, bitsplit_counters * out);
void bitsplit_ctx_reset_counters(bitsplit_ctx * ctx);
/* BITSPLIT_OK, or the status of the first error recorded during evaluation (message in buf);
 * the error is cleared by this call. */
int bitsplit_ctx_take_error(bitsplit_ctx * ctx, char * buf, size_t buf_size);

/* From now on, a ggml abort (llama.cpp's RPC client aborts when it loses its server) writes msg
 * and ggml's own message to stderr, one line each, and ends the process with status 1 (no stack
 * trace, no core dump); NULL gives ggml its default back. msg is copied (at most 1023 bytes). */
void bitsplit_set_abort_message(const char * msg);

/* The llama.cpp / ggml scheduler eval callback; user_data is a bitsplit_ctx. */
bool bitsplit_eval_callback(struct ggml_tensor * t, bool ask, void * user_data);

/* y[c][r] = sum_k (with_base ? W2[r][k] : 0) + R[r][k]) * x[c][k] for residual tensor `name` (or W2 . x
 * for a base weight without residual, with_base only),
 * r < ne1 (all rows of a 2-D weight), c < n_cols; x is n_cols rows of ne0 floats, y n_cols rows of
 * ne1 floats. base_data: the base weight's bytes (NULL: this library's own map of base.gguf).
 * For tests and benchmarks: the same kernels the callback uses, on this library's threads. */
int bitsplit_ctx_matmul(bitsplit_ctx * ctx, const char * name, const float * x, int64_t n_cols,
                        float * y, bool with_base);
/* y = W2 . x as the fast drafter computes it (the residual off: the draft policy's family, 8-bit
 * activations) for a weight with residual; BITSPLIT_E_UNSUPPORTED where ggml's own kernel drafts
 * it (no draft family here, too few columns, a type that family does not read). For benchmarks. */
int bitsplit_ctx_draft_matmul(bitsplit_ctx * ctx, const char * name, const float * x, int64_t n_cols, float * y);
/* the kernel family that computes bitsplit_ctx_matmul(ctx, name, ., n_cols, ., with_base) now
 * ("" where that call would be refused: an unknown or 3-D weight, a bad column count, R . x of a
 * weight without residual) */
const char * bitsplit_ctx_family_of(bitsplit_ctx * ctx, const char * name, int64_t n_cols, bool with_base);

/* Kernel families. One policy (kernels.c) decides which family computes a product, by batch size,
 * types and precision, among the families this CPU runs under the cap BITSPLIT_MAX_ISA
 * (generic < avx2 | neon < avxvnni < avx512 < amx; unset: no cap). BITSPLIT_KERNEL names one family that then
 * serves every batch size (for measurements). Every family computes the same products up to
 * rounding and each is batch-invariant; tests compare them. */

/* the family the policy picks for one column (or the one BITSPLIT_KERNEL names) */
const char * bitsplit_kernel_name(void);
/* the family the policy picks for a quantized product of n_cols columns: W2 + R, or the residual
 * alone (add mode: the device computes W2 . x) */
const char * bitsplit_kernel_for_batch(int64_t n_cols, bool residual_alone);
/* the families this CPU runs under the cap, fastest for one column first; returns how many
 * (names[] gets at most max of them) */
int bitsplit_kernel_families(const char ** names, int max);
/* A kernel policy measured on this machine (bitsplit doctor's profile: the fastest family per batch,
 * read by bitsplit_llama.native.policy.apply_measured): for a product of n_cols <= cols[i] columns
 * (the first such i; cols ascending, at most 16 steps), families[i] comes first where it runs under
 * the cap and computes the product; past the last step the built-in order. residual_alone: the table
 * of R . x alone (add mode), else of W2 + R. n = 0 clears it. BITSPLIT_E_INVALID for a bad n or
 * cols, BITSPLIT_E_UNSUPPORTED for a name no family of this build has (the table is then unchanged).
 * Set it before the products it should steer: a generation pins its family when it starts. */
int bitsplit_set_measured_policy(bool residual_alone, const int64_t * cols, const char * const * families, int n);
/* the measured table in force: its number of steps (the first max into cols / families) */
int bitsplit_measured_policy(bool residual_alone, int64_t * cols, const char ** families, int max);
/* the cap in force ("generic", "avx2" or "neon", "avxvnni", "avx512", "amx"); "generic" for a bad value */
const char * bitsplit_max_isa(void);
/* whether the policy's half-rate order is in force: this CPU runs 512-bit operations at half rate
 * (AMD Zen 4; BITSPLIT_HALF_RATE_512=0/1 overrides the CPUID test) and an AVX-512 family runs here
 * under the cap, so the 256-bit families come first where they measured faster */
bool bitsplit_half_rate_512(void);
/* the family the fast drafter computes base products with here ("" if none: ggml's kernels draft),
 * and the smallest batch it takes (ggml is faster below) */
const char * bitsplit_draft_kernel(void);
int bitsplit_draft_min_cols(void);
/* the peak of a family's multiply step on the calling thread, in weight.column multiply-accumulates
 * per second: its instructions timed in registers alone (no memory traffic) for about `seconds`
 * (0 < seconds <= 60), the fastest of its runs (native/arch/<arch>/peak.c says which instructions
 * and how a MAC is counted). 0 for a family of this build that this CPU cannot run (the cap
 * BITSPLIT_MAX_ISA aside: the CPU's figure), -1 for a name no family of this build has or a bad
 * `seconds`. Defined on x86-64 and AArch64 only. */
double bitsplit_family_peak(const char * family, double seconds);

/* pin the named family for this context's decode passes (up to 32 columns; larger passes follow
 * the policy, except in batch-invariant mode: every pass): NULL or "" unpins. BITSPLIT_E_UNSUPPORTED if this CPU cannot run it (under the cap).
 * One family for every pass of a generation keeps speculative output identical to plain decoding. */
int bitsplit_ctx_set_kernel(bitsplit_ctx * ctx, const char * name);
/* pin the family the policy picks for decode passes of n_cols columns whose products are W2 + R,
 * or R alone (residual_alone: the base's layers on a device); returns its name */
const char * bitsplit_ctx_choose_kernel(bitsplit_ctx * ctx, int64_t n_cols, bool residual_alone);
/* the pinned family, or the policy's pick for one column */
const char * bitsplit_ctx_kernel(const bitsplit_ctx * ctx);

/* Importance matrix (llama.cpp's imatrix definition), collected by an eval callback of its own:
 * for every product of a "blk.*" weight in a pass of at least 16 rows, the sum of the squared
 * activations entering each input column (per expert for MUL_MAT_ID) and the number of rows. */
typedef struct bitsplit_imatrix bitsplit_imatrix;
int bitsplit_imatrix_new(bitsplit_imatrix ** out);
void bitsplit_imatrix_free(bitsplit_imatrix * im);
/* llama_context_params.cb_eval with cb_eval_user_data = the collector */
bool bitsplit_imatrix_callback(struct ggml_tensor * t, bool ask, void * user_data);
int64_t bitsplit_imatrix_n_entries(const bitsplit_imatrix * im);
/* products collected so far */
uint64_t bitsplit_imatrix_n_products(const bitsplit_imatrix * im);
/* entry i: its weight's name (valid while the collector lives), n_per_row, n_mat (experts, or 1);
 * sums (n_mat * n_per_row doubles) and counts (n_mat) are copied out where not NULL */
int bitsplit_imatrix_entry(const bitsplit_imatrix * im, int64_t i, const char ** name, int64_t * n_per_row,
                           int64_t * n_mat, double * sums, int64_t * counts);
/* the first error recorded while collecting (buf gets its message), then cleared */
int bitsplit_imatrix_take_error(bitsplit_imatrix * im, char * buf, size_t buf_size);

#ifdef __cplusplus
}
#endif

#endif /* BITSPLIT_H */
