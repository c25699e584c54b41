/* What this CPU runs, detected once per process by native/arch/<arch>/cpu_feats.c, the only code
 * that asks the CPU and the OS (cpuid, xgetbv, arch_prctl on x86-64; getauxval on AArch64): every
 * kernel family's `available` and the kernel policy ask here, so that they cannot disagree about a
 * CPU. Not part of the API; the cap BITSPLIT_MAX_ISA is the kernel policy's (kernels.c), not this. */
#ifndef BS_CPU_FEATS_H
#define BS_CPU_FEATS_H

#include <stdbool.h>
#include <stdint.h>

/* x86-64: an AVX bit is set only where the OS saves the ymm state (XCR0 bits 1-2), an AVX-512 bit
 * only where it saves the opmask and zmm state too (bits 5-7), an AMX bit only with the tile state
 * (bits 17-18): the rule of libgcc's __builtin_cpu_supports, which the families used before */
enum bs_cpu_feat {
    BS_CPU_AVX2 = 1u << 0,
    BS_CPU_FMA = 1u << 1,
    BS_CPU_F16C = 1u << 2,
    BS_CPU_AVXVNNI = 1u << 3,     /* VEX vpdpbusd / vpdpwssd: CPUID (7, 1) EAX[4] */
    BS_CPU_AVX512F = 1u << 4,
    BS_CPU_AVX512BW = 1u << 5,
    BS_CPU_AVX512VL = 1u << 6,
    BS_CPU_AVX512DQ = 1u << 7,
    BS_CPU_AVX512VNNI = 1u << 8,
    BS_CPU_AVX512BF16 = 1u << 9,  /* CPUID (7, 1) EAX[5] */
    BS_CPU_AMX_TILE = 1u << 10,   /* the CPU and the OS; Linux's per-process permission: bs_cpu_amx_ready */
    BS_CPU_AMX_BF16 = 1u << 11,
    /* an AMD family 19h CPU with AVX-512 (Zen 4), which runs 512-bit operations at half rate:
     * the kernel policy's half-rate order (kernels.c, bs_half_rate_512) */
    BS_CPU_HALF_RATE_512 = 1u << 12,
    /* AArch64: Advanced SIMD (every AArch64 CPU), the dot product (FEAT_DotProd, AT_HWCAP) */
    BS_CPU_NEON = 1u << 16,
    BS_CPU_DOTPROD = 1u << 17,
};

/* what each family needs (the families in native/arch/<arch>/) */
#define BS_CPU_NEED_AVX2 (BS_CPU_AVX2 | BS_CPU_FMA | BS_CPU_F16C) /* avx2-f32, avx2-int16, attention's kernels */
#define BS_CPU_NEED_AVXVNNI (BS_CPU_NEED_AVX2 | BS_CPU_AVXVNNI)   /* avxvnni-int16 */
#define BS_CPU_AVX512_VNNI (BS_CPU_AVX512F | BS_CPU_AVX512BW | BS_CPU_AVX512VL | BS_CPU_AVX512VNNI)
#define BS_CPU_NEED_AVX512VNNI_256 (BS_CPU_NEED_AVX2 | BS_CPU_AVX512_VNNI) /* avx512vnni-int16 */
#define BS_CPU_NEED_VNNI_INT24 (BS_CPU_AVX512_VNNI | BS_CPU_AVX512DQ | BS_CPU_FMA | BS_CPU_F16C) /* vnni-int24 */
#define BS_CPU_NEED_AVX512_BF16                                                                          \
    (BS_CPU_AVX512F | BS_CPU_AVX512BW | BS_CPU_AVX512VL | BS_CPU_AVX512DQ | BS_CPU_AVX512BF16 | BS_CPU_FMA | \
     BS_CPU_F16C) /* avx512-bf16; amx-bf16 with the tiles (bs_cpu_amx_ready) */

/* the features of this CPU, enum bs_cpu_feat's bits (detected on the first call, from any thread) */
uint32_t bs_cpu_feats(void);

static inline bool bs_cpu_has(uint32_t need) {
    return (bs_cpu_feats() & need) == need;
}

/* whether amx-bf16 can run: BS_CPU_NEED_AVX512_BF16, the tiles, and (Linux) this process's
 * permission to use the tile data, asked for on the first call only: a granted permission makes
 * every signal frame of the process larger, so only a process that would run amx-bf16 (the
 * policy asks for it only under a cap that allows AMX) asks. False on AArch64. */
bool bs_cpu_amx_ready(void);

#endif
