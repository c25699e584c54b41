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
 * ns per unit for 1-4 columns, the per-column slope of each and B / A, for the products alone and
 * then with the decoding of a real Q2_K and Q6_K block per unit (B's includes widening the codes and
 * a vpmullw by their scale, once for every column). Where the products are bound by the multiplier
 * (as on a 2-core Zen 3), B's slope is about half A's. A here is a plain loop, slower than the
 * family's tuned kernel (about 1.2-1.8x at 1-2 columns with decoding): read the ratios, not a
 * projection of the pass.
 *
 * B was then built into the family (stop 34, not landed) and did not keep this promise at the batch
 * sizes that matter: on a 2-core Zen 3, W2 + R over Qwen2.5-Coder-1.5B's q6_k split (bench/native_ab.py,
 * one process, interleaved), time B / A 1.04-1.12 at 1 column, 0.91-1.05 at 2, 1.00-1.13 at 4, but
 * 0.75-0.91 at 8 and 0.72-0.76 at 16. The tuned A issues about as many instructions per unit as B
 * (321 against 338 vector instructions for both halves at 2 columns; B's widening, vpmullw and
 * centring are paid per group whatever the batch), and the pass follows the instruction count, not
 * the multiplies, where B saves (96 against 128).
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
#define INL TGT static inline __attribute__((always_inline))

/* A: one group of one half for one column, both digits (the family's vpmaddubsw + vpmaddwd + vpaddd) */
INL void apply_a(__m256i u, __m256i s, const void * d0, const void * d1, __m256i * il, __m256i * ih) {
    *il = _mm256_add_epi32(*il, _mm256_madd_epi16(_mm256_maddubs_epi16(u, LD(d0)), s));
    *ih = _mm256_add_epi32(*ih, _mm256_madd_epi16(_mm256_maddubs_epi16(u, LD(d1)), s));
    __asm__("" : "+x"(*il), "+x"(*ih)); /* as the family keeps its sums */
}

/* A: the two digits' sums as one f32 value, 255 ih + il */
INL __m256 digits_f32(__m256i il, __m256i ih) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(ih), _mm256_set1_ps(255.0f), _mm256_cvtepi32_ps(il));
}

/* B: one group of one half for one column: the 32 scaled 16-bit codes (w0, w1) times X (x0, x1) */
INL __m256i madd_pair(__m256i w0, __m256i w1, __m256i x0, __m256i x1) {
    return _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
}

/* what a runner returns (keeps its results live) */
INL float sum_cols(const __m256 * tot, int nc) {
    float s = 0.0f;
    for (int c = 0; c < nc; c++) s += _mm256_cvtss_f32(tot[c]);
    return s;
}

INL float run_a(const int nc, long iters) {
    __m256 tot[4] = {0};
    for (long it = 0; it < iters; it++) {
        const int k = (int)(it & (COPIES - 1));
        __m256i il[2][4], ih[2][4];
        for (int h = 0; h < 2; h++) for (int c = 0; c < nc; c++) il[h][c] = ih[h][c] = _mm256_setzero_si256();
        for (int g = 0; g < NG; g++) {
            for (int h = 0; h < 2; h++) {
                const __m256i u = LD(U[k][h][g]), s = LD(G[k][h][g]);
                for (int c = 0; c < nc; c++) apply_a(u, s, D0[k][c][g], D1[k][c][g], &il[h][c], &ih[h][c]);
            }
        }
        for (int c = 0; c < nc; c++) for (int h = 0; h < 2; h++) {
            tot[c] = _mm256_fmadd_ps(digits_f32(il[h][c], ih[h][c]), _mm256_set1_ps(1e-9f), tot[c]);
        }
    }
    return sum_cols(tot, nc);
}

INL float run_b(const int nc, long iters) {
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
                    a[h][c] = _mm256_add_epi32(a[h][c], madd_pair(w0[h], w1[h], x0, x1));
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
    return sum_cols(tot, nc);
}


/* With the decoding of real blocks (one Q2_K block of W2 and one Q6_K block of R per unit, random
 * bytes): A decodes codes and takes the scales in vpmaddwd's layout (as the family does); B widens
 * the codes to 16 bits and multiplies them by their scale (vpmullw, once for every column), Q6_K's
 * centred (q - 32). The per-unit float work of each is included. */
#define Q2_BYTES 84
#define Q6_BYTES 210
static __attribute__((aligned(64))) uint8_t B2[COPIES][Q2_BYTES + 44], B6[COPIES][Q6_BYTES + 46];

INL __m256i q2_codes(const uint8_t * b, int g) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)(const void *)(b + 16 + 32 * (g >> 2)));
    return _mm256_and_si256(_mm256_srli_epi16(q, 2 * (g & 3)), _mm256_set1_epi8(3));
}
INL __m256i q6_codes(const uint8_t * b, int g) {
    const int n = g >> 2, m = g & 3;
    const __m256i l = _mm256_loadu_si256((const __m256i *)(const void *)(b + 64 * n + 32 * (m & 1)));
    const __m256i h = _mm256_loadu_si256((const __m256i *)(const void *)(b + 128 + 32 * n));
    const __m256i lo = _mm256_and_si256(m >= 2 ? _mm256_srli_epi16(l, 4) : l, _mm256_set1_epi8(0x0F));
    const __m256i hb = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * m), _mm256_set1_epi8(3)), 4);
    return _mm256_or_si256(lo, hb);
}
INL __m256i group_scales(__m256i S, int g) {
    const __m256i B = g < 4 ? _mm256_permute2x128_si256(S, S, 0x00) : _mm256_permute2x128_si256(S, S, 0x11);
    const char a = (char)(2 * ((2 * g) % 8)), c = (char)(2 * ((2 * g + 1) % 8));
    return _mm256_shuffle_epi8(B, _mm256_setr_epi8(a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1,
                                                    c, c + 1, c, c + 1, c, c + 1, c, c + 1, c, c + 1, c, c + 1, c, c + 1, c, c + 1));
}

INL float run_ad(const int nc, long iters) {
    __m256 tot[4] = {0};
    for (long it = 0; it < iters; it++) {
        const int k = (int)(it & (COPIES - 1));
        const uint8_t * b2 = B2[k], * b6 = B6[k];
        const __m256i S2 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_loadu_si128((const __m128i *)(const void *)b2), _mm_set1_epi8(0x0F)));
        const __m256i S6 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)(b6 + 192)));
        __m256i il[2][4], ih[2][4];
        for (int h = 0; h < 2; h++) for (int c = 0; c < nc; c++) il[h][c] = ih[h][c] = _mm256_setzero_si256();
        for (int g = 0; g < NG; g++) {
            for (int h = 0; h < 2; h++) {
                const __m256i u = h ? q6_codes(b6, g) : q2_codes(b2, g), s = group_scales(h ? S6 : S2, g);
                for (int c = 0; c < nc; c++) apply_a(u, s, D0[k][c][g], D1[k][c][g], &il[h][c], &ih[h][c]);
            }
        }
        for (int c = 0; c < nc; c++) for (int h = 0; h < 2; h++) { /* sums, scale d, offsets of two halves of 8 */
            __m256 v = _mm256_mul_ps(digits_f32(il[h][c], ih[h][c]), _mm256_set1_ps(1e-9f));
            v = _mm256_fmadd_ps(_mm256_set1_ps(1e-9f), _mm256_castsi256_ps(LD(X[k][c][0])), v);
            v = _mm256_fmadd_ps(_mm256_set1_ps(1e-9f), _mm256_castsi256_ps(LD(X[k][c][1])), v);
            tot[c] = _mm256_fmadd_ps(v, _mm256_set1_ps(1e-9f), tot[c]);
        }
    }
    return sum_cols(tot, nc);
}

INL float run_bd(const int nc, long iters) {
    __m256 tot[4] = {0};
    __attribute__((aligned(64))) int16_t sc2[16], sc6[16];
    for (long it = 0; it < iters; it++) {
        const int k = (int)(it & (COPIES - 1));
        const uint8_t * b2 = B2[k], * b6 = B6[k];
        _mm256_store_si256((__m256i *)(void *)sc2, _mm256_cvtepu8_epi16(_mm_and_si128(_mm_loadu_si128((const __m128i *)(const void *)b2), _mm_set1_epi8(0x0F))));
        _mm256_store_si256((__m256i *)(void *)sc6, _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)(b6 + 192))));
        __m256i ab[4], ar[4];
        for (int c = 0; c < nc; c++) ab[c] = ar[c] = _mm256_setzero_si256();
        for (int g = 0; g < NG; g++) {
            const __m256i u2 = q2_codes(b2, g);
            const __m256i u6 = _mm256_sub_epi8(q6_codes(b6, g), _mm256_set1_epi8(32));
            const __m256i w2l = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_castsi256_si128(u2)), _mm256_set1_epi16(sc2[2 * g]));
            const __m256i w2h = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm256_extracti128_si256(u2, 1)), _mm256_set1_epi16(sc2[2 * g + 1]));
            const __m256i w6l = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(u6)), _mm256_set1_epi16(sc6[2 * g]));
            const __m256i w6h = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(u6, 1)), _mm256_set1_epi16(sc6[2 * g + 1]));
            for (int c = 0; c < nc; c++) {
                const __m256i x0 = LD(X[k][c][g]), x1 = LD(X[k][c][g] + 16);
                ab[c] = _mm256_add_epi32(ab[c], madd_pair(w2l, w2h, x0, x1));
                ar[c] = _mm256_add_epi32(ar[c], madd_pair(w6l, w6h, x0, x1));
                __asm__("" : "+x"(ab[c]), "+x"(ar[c]));
            }
            if (g == NG / 2 - 1) {
                for (int c = 0; c < nc; c++) {
                    tot[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ar[c]), _mm256_set1_ps(1e-9f), tot[c]);
                    ar[c] = _mm256_setzero_si256();
                }
            }
        }
        for (int c = 0; c < nc; c++) { /* the residual's second half, the base's sums and its mins */
            __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(ab[c]), _mm256_set1_ps(1e-9f));
            v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ar[c]), _mm256_set1_ps(1e-9f), v);
            v = _mm256_fmadd_ps(_mm256_set1_ps(1e-9f), _mm256_castsi256_ps(LD(X[k][c][0])), v);
            v = _mm256_fmadd_ps(_mm256_set1_ps(1e-9f), _mm256_castsi256_ps(LD(X[k][c][1])), v);
            tot[c] = _mm256_fmadd_ps(v, _mm256_set1_ps(1e-9f), tot[c]);
        }
    }
    return sum_cols(tot, nc);
}

/* one copy per column count, so that each keeps its sums in registers */
#define RUNNERS(N) \
    TGT __attribute__((noinline)) static float a##N(long i) { return run_a(N, i); } \
    TGT __attribute__((noinline)) static float b##N(long i) { return run_b(N, i); } \
    TGT __attribute__((noinline)) static float ad##N(long i) { return run_ad(N, i); } \
    TGT __attribute__((noinline)) static float bd##N(long i) { return run_bd(N, i); }
RUNNERS(1) RUNNERS(2) RUNNERS(3) RUNNERS(4)
static float (*const A[2][4])(long) = {{a1, a2, a3, a4}, {ad1, ad2, ad3, ad4}};
static float (*const B[2][4])(long) = {{b1, b2, b3, b4}, {bd1, bd2, bd3, bd4}};

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
    for (size_t i = 0; i < sizeof(B2); i++) ((uint8_t *)B2)[i] = (uint8_t)(i * 97 % 251);
    for (size_t i = 0; i < sizeof(B6); i++) ((uint8_t *)B6)[i] = (uint8_t)(i * 89 % 241);
    enum { ROUNDS = 5 };
    static const char * const what[2] = {"products alone (codes and scales decoded, in L1)",
                                         "with the decoding of a Q2_K and a Q6_K block per unit"};
    volatile float sink = 0.0f;
    for (int v = 0; v < 2; v++) {
        double ta[4][ROUNDS], tb[4][ROUNDS], ma[4], mb[4];
        for (int r = 0; r < ROUNDS; r++) {
            for (int n = 0; n < 4; n++) { /* interleaved: A then B at each size, every round */
                double t0 = now();
                sink += A[v][n](ITERS);
                ta[n][r] = 1e9 * (now() - t0) / (double)ITERS;
                t0 = now();
                sink += B[v][n](ITERS);
                tb[n][r] = 1e9 * (now() - t0) / (double)ITERS;
            }
        }
        printf("%s: ns per unit (256 weights of W2 and of R), median of %d rounds\n", what[v], ROUNDS);
        for (int n = 0; n < 4; n++) {
            qsort(ta[n], ROUNDS, sizeof(double), cmp);
            qsort(tb[n], ROUNDS, sizeof(double), cmp);
            ma[n] = ta[n][ROUNDS / 2];
            mb[n] = tb[n][ROUNDS / 2];
            printf("  %d column%s: A (two byte digits) %7.2f   B (16-bit, vpmaddwd) %7.2f   B / A %.3f\n", n + 1,
                   n ? "s" : " ", ma[n], mb[n], mb[n] / ma[n]);
        }
        const double sa = (ma[3] - ma[0]) / 3, sb = (mb[3] - mb[0]) / 3;
        printf("  per added column: A %.2f ns, B %.2f ns, B / A %.3f\n", sa, sb, sb / sa);
    }
    return sink == 12345.0f; /* keeps the results live */
}
