/*
 * What the SIMD integer and f32 families share, whatever the architecture: the codes of the weight
 * types a split holds (switches over them fold away in each type pair's compiled body), their
 * blocks, and the activation layout of the integer families avx2-int16 / avxvnni-int16
 * (native/arch/x86/kernels_avx2_int.c) and neon-int16 (native/arch/arm/kernels_neon_int.c), which
 * compute the same integers and floats in the same order.
 *
 * Internal to the family files; include after bs_internal.h.
 */
#ifndef BS_CODES_H
#define BS_CODES_H

enum { T_NONE, T_Q2_K, T_Q3_K, T_Q4_K, T_Q5_K, T_Q6_K, T_Q8_0, T_Q4_0, T_Q4_1, T_IQ2_XXS, T_IQ2_XS, T_IQ3_S,
       T_IQ1_M, T_COUNT };

/* the code of a half's type (T_NONE: no such half; -1: a type no SIMD family decodes) */
static inline int tcode(const uint8_t * data, enum ggml_type t) {
    if (data == NULL) return T_NONE;
    switch (t) {
        case GGML_TYPE_Q2_K: return T_Q2_K;
        case GGML_TYPE_Q3_K: return T_Q3_K;
        case GGML_TYPE_Q4_K: return T_Q4_K;
        case GGML_TYPE_Q5_K: return T_Q5_K;
        case GGML_TYPE_Q6_K: return T_Q6_K;
        case GGML_TYPE_Q8_0: return T_Q8_0;
        case GGML_TYPE_Q4_0: return T_Q4_0;
        case GGML_TYPE_Q4_1: return T_Q4_1;
        case GGML_TYPE_IQ2_XXS: return T_IQ2_XXS;
        case GGML_TYPE_IQ2_XS: return T_IQ2_XS;
        case GGML_TYPE_IQ3_S: return T_IQ3_S;
        case GGML_TYPE_IQ1_M: return T_IQ1_M;
        default: return -1;
    }
}

/* elements per block and bytes per block of each code */
static const int T_BLCK[T_COUNT] = {1, 256, 256, 256, 256, 256, 32, 32, 32, 256, 256, 256, 256};
static const int T_SIZE[T_COUNT] = {0, 84, 110, 144, 176, 210, 34, 18, 20, BS_IQ2XXS_BYTES, BS_IQ2XS_BYTES, BS_IQ3S_BYTES,
                                    BS_IQ1M_BYTES};

/* whether a code is a superblock type (blocks of 256 values: Q2_K .. Q6_K and the IQ types) */
static inline bool superblock(int t) { return T_BLCK[t] == 256; }

/* values per unit of a product of these codes: 256 where a superblock type is in it (then
 * K % 256 == 0), else 32 (T_NONE's block is 1) */
static inline int unit_of(int bt, int rt) { return (superblock(bt) || superblock(rt)) ? 256 : 32; }

/* ---------------------------------------------------------------------------------------------
 * The integer families' activations: per column, blocks of QA values (a unit) scaled to integers
 * |X| <= XMAX2 kept as two base-255 digits (XMAX1, one digit, for the fast drafter), and per block
 * whether the residual alone takes the high digit only (its largest value within HI_SPAN times its
 * mean magnitude). One column: digits d0[K], d1[K], then xs16[K/16] (sums of X over 16 values),
 * xh16[K/16] (sums of 255 d1 over 16 values), s[K/QA] (block scales), hi[K/QA]; 64-byte aligned.
 * ------------------------------------------------------------------------------------------- */
#define BS_XMAX2 32512 /* 255*127 + 127: two base-255 digits in [-127, 127] */
#define BS_XMAX1 127   /* one digit (the fast drafter) */
#define BS_HI_SPAN 16  /* the residual's 8-bit activations: blocks whose max is within 16x their mean |x| */

/* values per activation block of a job: those of its unit of weights */
static inline int64_t int16_qa(const bs_job * job) {
    return unit_of(tcode(job->w2, job->w2_type), tcode(job->r, job->r_type));
}

/* bytes of one column's activations */
static inline size_t int16_col_bytes(const bs_job * job) {
    const size_t K = (size_t)job->K, nb = K / (size_t)int16_qa(job);
    const size_t n = 2 * K + (2 * (K / 16) + nb) * sizeof(float) + nb;
    return (n + 63) & ~(size_t)63;
}

#endif
