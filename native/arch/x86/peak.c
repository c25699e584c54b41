/*
 * The peak of each x86-64 kernel family's multiply step on one core (bitsplit_family_peak): how
 * many weight.column multiply-accumulates per second the instructions that multiply weights by
 * activations in the family's inner loop can do on the calling thread, timed in registers alone (no
 * loads or stores: several independent accumulator chains, enough to cover the latency, run for a
 * few milliseconds at a time). `bitsplit doctor` divides each measured product's rate by it: the
 * share of the peak a family reaches, i.e. how much of its time goes to anything but multiplying.
 *
 * A weight.column MAC is one weight times one activation value added into a sum. Per family, the
 * step timed and the MACs it counts (the families' sources say why they multiply so):
 *
 *   generic            mulps + addps, xmm (SSE2)        4   (x86-64's baseline: the portable dot8,
 *                                                            compiled without FMA, ISO C contracts none)
 *   avx2-f32           vfmadd231ps ymm                  8   (f32 weights, f32 activations)
 *   avx2-int16         vpmaddubsw + vpmaddwd + vpaddd  32   (byte codes times one 8-bit activation
 *                      ymm                                   digit, pair sums times the scales)
 *   avxvnni-int16      vpmaddubsw + {vex} vpdpwssd ymm 32   (the same step, VNNI's scale-and-add)
 *   avx512vnni-int16   vpmaddubsw + vpdpwssd ymm (EVEX) 32  (the same, 256 bits with 32 registers:
 *                                                            the family is compiled 256-bit)
 *   vnni-int24         vpdpbusd zmm                  64 / 3 (three 8-bit digits per activation)
 *   avx512-bf16        vdpbf16ps zmm                   32   (bf16 pairs into f32 lanes)
 *   amx-bf16           tdpbf16ps                     8192   (16 x 16 x 32 per tile product)
 *
 * The 16-bit integer families count one activation digit per MAC: a product of the residual alone
 * (what doctor's R.x rows time) takes the high digit alone in every block without an outlier, so
 * one step serves 32 weight.columns; a product with both digits (W2 + R's 16-bit activations, an
 * outlier block) takes two, and its ceiling is half this. Q2_K base codes in the VNNI families go
 * through vpdpbusd alone, one instruction in place of the step.
 *
 * Each family's own features are asked of cpu_feats.c (the cap BITSPLIT_MAX_ISA aside: this is
 * the CPU's figure); every step is compiled with a target attribute of its own, so the library
 * builds and runs on CPUs without them. Calls cpu_feats.c: level 2 of native/README.md's order,
 * beside the families; native/peak.c times the steps (bs_peak_steps) for bitsplit_family_peak.
 */
#if defined(__x86_64__)

#define _GNU_SOURCE
#include <immintrin.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "bitsplit.h"
#include "bs_internal.h"
#include "amx_tiles.h"
#include "cpu_feats.h"

#define TGT_AVX2 __attribute__((target("avx2,fma")))
#define TGT_AVXVNNI __attribute__((target("avx2,avxvnni")))
#define TGT_EVEX __attribute__((target("avx2,avx512f,avx512vl,avx512bw,avx512vnni")))
#define TGT_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define TGT_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))

/* the chains: 10 where VEX code has 16 registers (8 for avx2-int16's three-instruction step, whose
 * temporaries need registers too), 16 with AVX-512's 32; each covers its instruction's latency
 * times its throughput on current cores (4-6 cycles, up to 2 per cycle) */
#define REP8(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#define REP10(X) REP8(X) X(8) X(9)
#define REP12(X) REP10(X) X(10) X(11)
#define REP16(X) REP12(X) X(12) X(13) X(14) X(15)

/* Each step below runs n iterations of its chains. The asm statements cost no instruction: an
 * accumulator (or the operand of a step whose product is not accumulated in place) marked changed
 * before each chain's step keeps the compiler from computing the chains, which start equal and see
 * the same operands, once for all of them, or a step once for the whole loop; the accumulators are
 * consumed at the end so that no chain is dropped. */

/* generic: 12 chains of mulps + addps */
static void run_sse2(int64_t n) {
    __m128 w = _mm_set1_ps(1e-3f);
    const __m128 x = _mm_set1_ps(1e-3f);
#define D(j) __m128 a##j = _mm_setzero_ps();
#define S(j) __asm__("" : "+x"(w)); a##j = _mm_add_ps(a##j, _mm_mul_ps(w, x));
#define C(j) __asm__ volatile("" ::"x"(a##j));
    REP12(D)
    for (int64_t i = 0; i < n; i++) {
        REP12(S)
    }
    REP12(C)
#undef D
#undef S
#undef C
}

/* avx2-f32: 12 chains of vfmadd231ps */
TGT_AVX2 static void run_fma(int64_t n) {
    const __m256 w = _mm256_set1_ps(1e-3f), x = _mm256_set1_ps(1e-3f);
#define D(j) __m256 a##j = _mm256_setzero_ps();
#define S(j) __asm__("" : "+x"(a##j)); a##j = _mm256_fmadd_ps(w, x, a##j);
#define C(j) __asm__ volatile("" ::"x"(a##j));
    REP12(D)
    for (int64_t i = 0; i < n; i++) {
        REP12(S)
    }
    REP12(C)
#undef D
#undef S
#undef C
}

/* avx2-int16: 8 chains of vpmaddubsw (codes times a digit), vpmaddwd (pair sums times the group's
 * scales), vpaddd (into the running sum) */
TGT_AVX2 static void run_int16(int64_t n) {
    __m256i u = _mm256_set1_epi8(3);
    const __m256i e = _mm256_set1_epi8(-5), G = _mm256_set1_epi16(7);
#define D(j) __m256i a##j = _mm256_setzero_si256();
#define S(j) __asm__("" : "+x"(u)); a##j = _mm256_add_epi32(a##j, _mm256_madd_epi16(_mm256_maddubs_epi16(u, e), G));
#define C(j) __asm__ volatile("" ::"x"(a##j));
    REP8(D)
    for (int64_t i = 0; i < n; i++) {
        REP8(S)
    }
    REP8(C)
#undef D
#undef S
#undef C
}

/* avxvnni-int16: 10 chains of vpmaddubsw + VEX vpdpwssd */
TGT_AVXVNNI static void run_avxvnni(int64_t n) {
    __m256i u = _mm256_set1_epi8(3);
    const __m256i e = _mm256_set1_epi8(-5), G = _mm256_set1_epi16(7);
#define D(j) __m256i a##j = _mm256_setzero_si256();
#define S(j) __asm__("" : "+x"(u)); a##j = _mm256_dpwssd_avx_epi32(a##j, _mm256_maddubs_epi16(u, e), G);
#define C(j) __asm__ volatile("" ::"x"(a##j));
    REP10(D)
    for (int64_t i = 0; i < n; i++) {
        REP10(S)
    }
    REP10(C)
#undef D
#undef S
#undef C
}

/* avx512vnni-int16: 16 chains of vpmaddubsw + EVEX vpdpwssd, 256 bits ("v": any of the 32 registers) */
TGT_EVEX static void run_evex256(int64_t n) {
    __m256i u = _mm256_set1_epi8(3);
    const __m256i e = _mm256_set1_epi8(-5), G = _mm256_set1_epi16(7);
#define D(j) __m256i a##j = _mm256_setzero_si256();
#define S(j) __asm__("" : "+v"(u)); a##j = _mm256_dpwssd_epi32(a##j, _mm256_maddubs_epi16(u, e), G);
#define C(j) __asm__ volatile("" ::"v"(a##j));
    REP16(D)
    for (int64_t i = 0; i < n; i++) {
        REP16(S)
    }
    REP16(C)
#undef D
#undef S
#undef C
}

/* vnni-int24: 16 chains of vpdpbusd zmm */
TGT_EVEX static void run_dpbusd512(int64_t n) {
    const __m512i u = _mm512_set1_epi8(3), e = _mm512_set1_epi8(-5);
#define D(j) __m512i a##j = _mm512_setzero_si512();
#define S(j) __asm__("" : "+v"(a##j)); a##j = _mm512_dpbusd_epi32(a##j, u, e);
#define C(j) __asm__ volatile("" ::"v"(a##j));
    REP16(D)
    for (int64_t i = 0; i < n; i++) {
        REP16(S)
    }
    REP16(C)
#undef D
#undef S
#undef C
}

/* avx512-bf16: 16 chains of vdpbf16ps zmm (0x3c00: bf16 2^-7, so the sums stay finite and normal) */
TGT_BF16 static void run_bf16(int64_t n) {
    const __m512bh w = (__m512bh)_mm512_set1_epi16(0x3c00), x = (__m512bh)_mm512_set1_epi16(0x3c00);
#define D(j) __m512 a##j = _mm512_setzero_ps();
#define S(j) __asm__("" : "+v"(a##j)); a##j = _mm512_dpbf16_ps(a##j, w, x);
#define C(j) __asm__ volatile("" ::"v"(a##j));
    REP16(D)
    for (int64_t i = 0; i < n; i++) {
        REP16(S)
    }
    REP16(C)
#undef D
#undef S
#undef C
}

/* amx-bf16: 4 accumulator tiles (0-3), two weight tiles (4, 5) times two activation tiles (6, 7),
 * loaded once; the tile configuration is kernels_tiles.c's (8 tiles of 16 rows x 64 bytes), and
 * whoever used the tiles on this thread before gets its own back. Not run on a CPU without AMX
 * (none here when this was written: untested on AMX hardware) */
TGT_AMX static void run_amx(int64_t n) {
    static const uint16_t zeros[16 * 32] __attribute__((aligned(64)));
    bs_tile_cfg saved, cfg;
    bs_tile_cfg_8x16x64(&cfg);
    __asm__ volatile("sttilecfg %0" : "=m"(saved)::"memory");
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg) : "memory");
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    BS_TILE_LOADD(4, zeros, 64);
    BS_TILE_LOADD(5, zeros, 64);
    BS_TILE_LOADD(6, zeros, 64);
    BS_TILE_LOADD(7, zeros, 64);
    for (int64_t i = 0; i < n; i++) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
    }
    if (saved.palette != 0) {
        __asm__ volatile("ldtilecfg %0" ::"m"(saved) : "memory");
    } else {
        _tile_release();
    }
}

static bool always(void) { return true; }
static bool has_avx2(void) { return bs_cpu_has(BS_CPU_NEED_AVX2); }
static bool has_avxvnni(void) { return bs_cpu_has(BS_CPU_NEED_AVXVNNI); }
static bool has_evex256(void) { return bs_cpu_has(BS_CPU_NEED_AVX512VNNI_256); }
static bool has_vnni512(void) { return bs_cpu_has(BS_CPU_NEED_VNNI_INT24); }
static bool has_bf16(void) { return bs_cpu_has(BS_CPU_NEED_AVX512_BF16); }
/* the tiles and this process's permission to use them: asked (of the OS) only when AMX's peak is */
static bool has_amx(void) { return bs_cpu_amx_ready(); }

static const bs_peak_step steps[] = {
    {"generic", always, run_sse2, 12 * 4},
    {"avx2-f32", has_avx2, run_fma, 12 * 8},
    {"avx2-int16", has_avx2, run_int16, 8 * 32},
    {"avxvnni-int16", has_avxvnni, run_avxvnni, 10 * 32},
    {"avx512vnni-int16", has_evex256, run_evex256, 16 * 32},
    {"vnni-int24", has_vnni512, run_dpbusd512, 16 * 64 / 3.0},
    {"avx512-bf16", has_bf16, run_bf16, 16 * 32},
    {"amx-bf16", has_amx, run_amx, 4 * 16 * 16 * 32},
};

/* this architecture's steps, timed by native/peak.c */
const bs_peak_step * bs_peak_steps(size_t * n) {
    *n = sizeof(steps) / sizeof(steps[0]);
    return steps;
}

#endif /* __x86_64__ */
