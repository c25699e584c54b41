/*
 * The peak of each AArch64 kernel family's multiply step on one core (bitsplit_family_peak), as
 * native/arch/x86/peak.c measures the x86 families' (which explains the figure): weight.column
 * multiply-accumulates per second of the instructions that multiply weights by activations in the
 * family's inner loop, timed in registers alone with independent accumulator chains.
 *
 *   generic     fmul + fadd, 4 x f32                   4   (the portable dot8: ISO C contracts none)
 *   neon-f32    fmla, 4 x f32                          4
 *   neon-int16  sdot (byte codes times one 8-bit      16   (avx2-int16's step: one digit per MAC,
 *               activation digit) + mla by the scale       see x86's peak.c; 2 digits take two)
 *
 * Written for AArch64 and cross-built (native/tests/cross_build.sh); not timed on ARM hardware.
 * Calls cpu_feats.c: level 2 of native/README.md's order, beside the families; native/peak.c times
 * the steps (bs_peak_steps) for bitsplit_family_peak.
 */
#if defined(__aarch64__)

#define _GNU_SOURCE
#include <arm_neon.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "bitsplit.h"
#include "bs_internal.h"
#include "cpu_feats.h"

#define TGT_DOT __attribute__((target("arch=armv8.2-a+dotprod")))

/* 16 chains (32 vector registers): enough for 4-cycle latencies at up to 4 per cycle; 12 where each
 * chain's product needs a register of its own (16 of those spilled) */
#define REP12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define REP16(X) REP12(X) X(12) X(13) X(14) X(15)

/* As on x86: the asm statements cost no instruction; they keep the compiler from computing chains
 * that start equal once for all of them, or a step once for the whole loop. */

/* generic: fmul + fadd */
static void run_fmul_fadd(int64_t n) {
    float32x4_t w = vdupq_n_f32(1e-3f);
    const float32x4_t x = vdupq_n_f32(1e-3f);
#define D(j) float32x4_t a##j = vdupq_n_f32(0.0f);
#define S(j) __asm__("" : "+w"(w)); a##j = vaddq_f32(a##j, vmulq_f32(w, x));
#define C(j) __asm__ volatile("" ::"w"(a##j));
    REP12(D)
    for (int64_t i = 0; i < n; i++) {
        REP12(S)
    }
    REP12(C)
#undef D
#undef S
#undef C
}

/* neon-f32: fmla */
static void run_fmla(int64_t n) {
    const float32x4_t w = vdupq_n_f32(1e-3f), x = vdupq_n_f32(1e-3f);
#define D(j) float32x4_t a##j = vdupq_n_f32(0.0f);
#define S(j) __asm__("" : "+w"(a##j)); a##j = vfmaq_f32(a##j, w, x);
#define C(j) __asm__ volatile("" ::"w"(a##j));
    REP16(D)
    for (int64_t i = 0; i < n; i++) {
        REP16(S)
    }
    REP16(C)
#undef D
#undef S
#undef C
}

/* neon-int16: sdot of 16 byte codes by 16 digits into a zeroed register (4 sums of 4), then mla of
 * those by the group's scale into the running sum, as kernels_neon_int.c does */
TGT_DOT static void run_sdot(int64_t n) {
    int8x16_t u = vdupq_n_s8(3);
    const int8x16_t e = vdupq_n_s8(-5);
    const int32x4_t z = vdupq_n_s32(0);
#define D(j) int32x4_t a##j = vdupq_n_s32(0);
#define S(j) __asm__("" : "+w"(u)); a##j = vmlaq_n_s32(a##j, vdotq_s32(z, u, e), 7);
#define C(j) __asm__ volatile("" ::"w"(a##j));
    REP16(D)
    for (int64_t i = 0; i < n; i++) {
        REP16(S)
    }
    REP16(C)
#undef D
#undef S
#undef C
}

static bool always(void) { return true; }
static bool has_dot(void) { return bs_cpu_has(BS_CPU_NEON | BS_CPU_DOTPROD); }

static const bs_peak_step steps[] = {
    {"generic", always, run_fmul_fadd, 12 * 4},
    {"neon-f32", always, run_fmla, 16 * 4},
    {"neon-int16", has_dot, run_sdot, 16 * 16},
};

/* this architecture's steps, timed by native/peak.c */
const bs_peak_step * bs_peak_steps(size_t * n) {
    *n = sizeof(steps) / sizeof(steps[0]);
    return steps;
}

#endif /* __aarch64__ */
