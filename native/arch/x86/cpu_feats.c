/*
 * The x86-64 CPU features (cpu_feats.h), detected once: CPUID for what the CPU has, XGETBV for what
 * the OS saves on a context switch (a feature whose registers the OS does not save cannot be used),
 * and the vendor and family for AMD's Zen 4, which runs 512-bit operations at half rate. Calls
 * nothing else of the library (the bottom of native/README.md's order).
 */
#if defined(__x86_64__)

#define _GNU_SOURCE
#include <stdatomic.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "cpu_feats.h"

#define DETECTED (1u << 31) /* set in every detected mask: 0 means not detected yet */

static void cpuid(unsigned leaf, unsigned sub, unsigned r[4]) {
    __asm__ volatile("cpuid" : "=a"(r[0]), "=b"(r[1]), "=c"(r[2]), "=d"(r[3]) : "a"(leaf), "c"(sub));
}

static unsigned long long xgetbv0(void) {
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}

static uint32_t detect(void) {
    unsigned r[4];
    cpuid(0, 0, r);
    const unsigned max_leaf = r[0];
    const bool amd = r[1] == 0x68747541u && r[3] == 0x69746e65u && r[2] == 0x444d4163u; /* "AuthenticAMD" */
    if (max_leaf < 1) {
        return DETECTED;
    }
    cpuid(1, 0, r);
    unsigned family = (r[0] >> 8) & 0xfu;
    if (family == 0xfu) {
        family += (r[0] >> 20) & 0xffu;
    }
    const unsigned ecx1 = r[2];
    /* XGETBV exists only where the OS set CR4.OSXSAVE (CPUID.1:ECX[27]); without it no AVX state */
    const unsigned long long xcr0 = (ecx1 >> 27) & 1u ? xgetbv0() : 0;
    const bool os_ymm = (xcr0 & 0x6u) == 0x6u;                  /* SSE, AVX */
    const bool os_zmm = os_ymm && (xcr0 & 0xe0u) == 0xe0u;      /* opmask, ZMM0-15 upper halves, ZMM16-31 */
    const bool os_tiles = ((xcr0 >> 17) & 3u) == 3u;            /* XTILECFG, XTILEDATA */
    unsigned b7 = 0, c7 = 0, d7 = 0, a71 = 0;
    if (max_leaf >= 7) {
        cpuid(7, 0, r);
        b7 = r[1];
        c7 = r[2];
        d7 = r[3];
        if (r[0] >= 1) { /* sub-leaf 1 exists */
            cpuid(7, 1, r);
            a71 = r[0];
        }
    }
    uint32_t f = DETECTED;
    if (os_ymm) {
        f |= ((b7 >> 5) & 1u ? BS_CPU_AVX2 : 0) | ((ecx1 >> 12) & 1u ? BS_CPU_FMA : 0) |
             ((ecx1 >> 29) & 1u ? BS_CPU_F16C : 0) | ((a71 >> 4) & 1u ? BS_CPU_AVXVNNI : 0);
    }
    if (os_zmm) {
        f |= ((b7 >> 16) & 1u ? BS_CPU_AVX512F : 0) | ((b7 >> 30) & 1u ? BS_CPU_AVX512BW : 0) |
             ((b7 >> 31) & 1u ? BS_CPU_AVX512VL : 0) | ((b7 >> 17) & 1u ? BS_CPU_AVX512DQ : 0) |
             ((c7 >> 11) & 1u ? BS_CPU_AVX512VNNI : 0) | ((a71 >> 5) & 1u ? BS_CPU_AVX512BF16 : 0);
    }
    if (os_tiles) {
        f |= ((d7 >> 24) & 1u ? BS_CPU_AMX_TILE : 0) | ((d7 >> 22) & 1u ? BS_CPU_AMX_BF16 : 0);
    }
    /* family 19h: Zen 3 (no AVX-512) and Zen 4 (512-bit operations at half rate); Zen 5 is 1Ah */
    if (amd && family == 0x19u && (f & BS_CPU_AVX512F)) {
        f |= BS_CPU_HALF_RATE_512;
    }
    return f;
}

uint32_t bs_cpu_feats(void) {
    /* threads racing here all store the same mask */
    static atomic_uint feats;
    uint32_t f = atomic_load_explicit(&feats, memory_order_relaxed);
    if (f == 0) {
        f = detect();
        atomic_store_explicit(&feats, f, memory_order_relaxed);
    }
    return f & ~DETECTED;
}

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

bool bs_cpu_amx_ready(void) {
    static atomic_int ready = -1; /* -1: not asked yet */
    int v = atomic_load_explicit(&ready, memory_order_relaxed);
    if (v < 0) {
        v = bs_cpu_has(BS_CPU_NEED_AVX512_BF16 | BS_CPU_AMX_TILE | BS_CPU_AMX_BF16);
#if defined(__linux__)
        /* Linux hands out the tile state only on request (per process); asking twice is harmless.
         * Windows enables it for every process where XCR0 has it (detect: os_tiles) */
        v = v && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#endif
        atomic_store_explicit(&ready, v, memory_order_relaxed);
    }
    return v == 1;
}

#endif /* __x86_64__ */
