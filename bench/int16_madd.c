/*
 * What a batch column costs avx2-int16's W2 + R products, against a 16-bit alternative, on this CPU.
 *
 *   cc -O2 -o /tmp/int16_madd bench/int16_madd.c && /tmp/int16_madd
 *
 * The per-column work of one unit (256 weights of the base and 256 of the residual, decoded, in L1):
 *   A (the family today): activations as two signed byte digits d0, d1; per group of 32 weights,
 *     half and digit, vpmaddubsw(u, d) then vpmaddwd(., G) with the half-groups' integer scales G,
 *     then vpaddd: 8 multiplies per group and column;
 *   B (not built): activations as 16-bit integers X, codes already multiplied by their scale (16-bit
 *     G u, made once per group for every column); per group and half two vpmaddwd(G u, X) and the
 *     adds: 4 multiplies per group and column (the residual's int32 sums flushed to f32 every 4
 *     groups, where (q - 32) G u X could overflow).
 * The inputs change every iteration (16 copies) so that nothing is hoisted out of the loop. Prints
 * ns per unit for 1-4 columns, the per-column slope of each and B / A: where the products are bound by
 * the multiplier (as on a 2-core Zen 3), B's slope is about half A's.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define NG 8    /* groups of 32 per unit */
#define COPIES 16
#define ITERS 5000000L

static __attribute__((aligned(64))) uint8_t U[COPIES][2][NG][32];   /* A: codes, both halves */
static __attribute__((aligned(64))) int16_t G[COPIES][2][NG][16];   /* A: scales in vpmaddwd's layout */
static __attribute__((aligned(64))) int8_t D0[COPIES][4][NG][32], D1[COPIES][4][NG][32];
static __attribute__((aligned(64))) int16_t GU[COPIES][2][NG][32];  /* B: scaled 16-bit codes */
static __attribute__((aligned(64))) int16_t X[COPIES][4][NG][32];   /* B: 16-bit activations */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

#define TGT __attribute__((target("avx2,fma")))
#define LD(p) _mm256_load_si256((const __m256i *)(const void *)(p))

TGT static inline __attribute__((always_inline)) float run_a(const int nc, long iters) {
    __m256 tot[4] = {0};
    for (long it = 0; it < iters; it++) {
        const int k = (int)(it & (COPIES - 1));
        __m256i il[2][4], ih[2][4];
        for (int h = 0; h < 2; h++) for (int c = 0; c < nc; c++) il[h][c] = ih[h][c] = _mm256_setzero_si256();
        for (int g = 0; g < NG; g++) {
            for (int h = 0; h < 2; h++) {
                const __m256i u = LD(U[k][h][g]), s = LD(G[k][h][g]);
                for (int c = 0; c < nc; c++) {
                    il[h][c] = _mm256_add_epi32(il[h][c], _mm256_madd_epi16(_mm256_maddubs_epi16(u, LD(D0[k][c][g])), s));
                    ih[h][c] = _mm256_add_epi32(ih[h][c], _mm256_madd_epi16(_mm256_maddubs_epi16(u, LD(D1[k][c][g])), s));
                    __asm__("" : "+x"(il[h][c]), "+x"(ih[h][c])); /* as the family keeps its sums */
                }
            }
        }
        for (int c = 0; c < nc; c++) for (int h = 0; h < 2; h++) {
            const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ih[h][c]), _mm256_set1_ps(255.0f), _mm256_cvtepi32_ps(il[h][c]));
            tot[c] = _mm256_fmadd_ps(v, _mm256_set1_ps(1e-9f), tot[c]);
        }
    }
    float s = 0.0f;
    for (int c = 0; c < nc; c++) s += _mm256_cvtss_f32(tot[c]);
    return s;
}

TGT static inline __attribute__((always_inline)) float run_b(const int nc, long iters) {
    __m256 tot[4] = {0};
    for (long it = 0; it < iters; it++) {
        const int k = (int)(it & (COPIES - 1));
        __m256i a[2][4];
        for (int h = 0; h < 2; h++) for (int c = 0; c < nc; c++) a[h][c] = _mm256_setzero_si256();
        for (int g = 0; g < NG; g++) {
            __m256i w0[2], w1[2];
            for (int h = 0; h < 2; h++) {
                w0[h] = LD(GU[k][h][g]);
                w1[h] = LD(GU[k][h][g] + 16);
            }
            for (int c = 0; c < nc; c++) {
                const __m256i x0 = LD(X[k][c][g]), x1 = LD(X[k][c][g] + 16);
                for (int h = 0; h < 2; h++) {
                    a[h][c] = _mm256_add_epi32(a[h][c], _mm256_add_epi32(_mm256_madd_epi16(w0[h], x0), _mm256_madd_epi16(w1[h], x1)));
                }
                __asm__("" : "+x"(a[0][c]), "+x"(a[1][c]));
            }
            if (g == NG / 2 - 1) { /* the residual's flush */
                for (int c = 0; c < nc; c++) {
                    tot[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[1][c]), _mm256_set1_ps(1e-9f), tot[c]);
                    a[1][c] = _mm256_setzero_si256();
                }
            }
        }
        for (int c = 0; c < nc; c++) for (int h = 0; h < 2; h++) {
            tot[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[h][c]), _mm256_set1_ps(1e-9f), tot[c]);
        }
    }
    float s = 0.0f;
    for (int c = 0; c < nc; c++) s += _mm256_cvtss_f32(tot[c]);
    return s;
}

/* one copy per column count, so that each keeps its sums in registers */
#define RUNNERS(N) \
    TGT __attribute__((noinline)) static float a##N(long i) { return run_a(N, i); } \
    TGT __attribute__((noinline)) static float b##N(long i) { return run_b(N, i); }
RUNNERS(1) RUNNERS(2) RUNNERS(3) RUNNERS(4)
static float (*const A[4])(long) = {a1, a2, a3, a4};
static float (*const B[4])(long) = {b1, b2, b3, b4};

static int cmp(const void * p, const void * q) {
    const double x = *(const double *)p, y = *(const double *)q;
    return (x > y) - (x < y);
}

int main(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
        fprintf(stderr, "int16_madd: this CPU has no AVX2 + FMA\n");
        return 1;
    }
    for (size_t i = 0; i < sizeof(U); i++) ((uint8_t *)U)[i] = (uint8_t)(i * 7 % 64);
    for (size_t i = 0; i < sizeof(G) / 2; i++) ((int16_t *)G)[i] = (int16_t)(i % 127);
    for (size_t i = 0; i < sizeof(D0); i++) {
        ((int8_t *)D0)[i] = (int8_t)((int)(i * 13 % 255) - 127);
        ((int8_t *)D1)[i] = (int8_t)((int)(i * 29 % 255) - 127);
    }
    for (size_t i = 0; i < sizeof(GU) / 2; i++) ((int16_t *)GU)[i] = (int16_t)((int)(i * 37 % 8000) - 4000);
    for (size_t i = 0; i < sizeof(X) / 2; i++) ((int16_t *)X)[i] = (int16_t)((int)(i * 131 % 65000) - 32500);
    enum { ROUNDS = 5 };
    double ta[4][ROUNDS], tb[4][ROUNDS];
    volatile float sink = 0.0f;
    for (int r = 0; r < ROUNDS; r++) {
        for (int n = 0; n < 4; n++) { /* interleaved: A then B at each size, every round */
            double t0 = now();
            sink += A[n](ITERS);
            ta[n][r] = 1e9 * (now() - t0) / (double)ITERS;
            t0 = now();
            sink += B[n](ITERS);
            tb[n][r] = 1e9 * (now() - t0) / (double)ITERS;
        }
    }
    double ma[4], mb[4];
    printf("ns per unit (256 weights of W2 and of R), median of %d rounds\n", ROUNDS);
    for (int n = 0; n < 4; n++) {
        qsort(ta[n], ROUNDS, sizeof(double), cmp);
        qsort(tb[n], ROUNDS, sizeof(double), cmp);
        ma[n] = ta[n][ROUNDS / 2];
        mb[n] = tb[n][ROUNDS / 2];
        printf("  %d column%s: A (two byte digits) %7.2f   B (16-bit, vpmaddwd) %7.2f   B / A %.3f\n", n + 1,
               n ? "s" : " ", ma[n], mb[n], mb[n] / ma[n]);
    }
    const double sa = (ma[3] - ma[0]) / 3, sb = (mb[3] - mb[0]) / 3;
    printf("per added column: A %.2f ns, B %.2f ns, B / A %.3f\n", sa, sb, sb / sa);
    return sink == 12345.0f; /* keeps the results live */
}
