/*
 * The AArch64 CPU features (cpu_feats.h), detected once: Advanced SIMD is part of every AArch64 CPU;
 * the dot product (FEAT_DotProd, neon-int16) is read from the kernel's hardware capabilities
 * (Linux's AT_HWCAP). Calls nothing else of the library (the bottom of native/README.md's order).
 */
#if defined(__aarch64__)

#define _GNU_SOURCE
#include <stdatomic.h>
#include <sys/auxv.h>

#include "cpu_feats.h"

#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20) /* AT_HWCAP bit of FEAT_DotProd (Linux) */
#endif

#define DETECTED (1u << 31) /* set in every detected mask: 0 means not detected yet */

uint32_t bs_cpu_feats(void) {
    /* threads racing here all store the same mask */
    static atomic_uint feats;
    uint32_t f = atomic_load_explicit(&feats, memory_order_relaxed);
    if (f == 0) {
        f = DETECTED | BS_CPU_NEON | ((getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0 ? BS_CPU_DOTPROD : 0);
        atomic_store_explicit(&feats, f, memory_order_relaxed);
    }
    return f & ~DETECTED;
}

bool bs_cpu_amx_ready(void) { return false; }

#endif /* __aarch64__ */
