/*
 * The AVX-VNNI family ("avxvnni-int16"), for the AVX2 CPUs with AVX-VNNI and without AVX-512
 * (Intel 12th-14th gen client and later, Zen 5): avx2-int16's scheme (its activations, its exact
 * integer sums, its floating-point operations in the same order, so its results bit for bit),
 * computed with the 256-bit VEX vpdpbusd / vpdpwssd: Q2_K's codes carry their sub-block scale
 * (u = sc q <= 45), so a group of 32 base weights costs one vpdpbusd per digit and column instead
 * of vpmaddubsw + vpmaddwd + vpaddd; the other superblock types add their scaled pair sums with one
 * vpdpwssd; the block-32 types combine their digits with vpdpwssd.
 */
#define BS_INT16_VNNI 1
#include "kernels_avx2_int.c"
