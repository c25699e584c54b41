/*
 * The AVX512-VNNI 256-bit family ("avx512vnni-int16"), for the AVX-512 CPUs with VNNI (Zen 4 and
 * 5, Intel Ice Lake and later server and client parts): avxvnni-int16's instructions in their EVEX
 * form (Zen 4 has AVX512-VNNI but not AVX-VNNI), so avx2-int16's results bit for bit, on 256-bit
 * vectors, with the 32 vector registers AVX-512 brings: enough for one decoding of a row to serve
 * 4 columns of W2 + R with every running sum in a register (FUSED_WIDE in kernels_avx2_int.c).
 * Zen 4 runs 512-bit operations at half rate, and there this family is ahead of the 512-bit ones
 * at the batch sizes of decoding and small trees.
 */
#define BS_INT16_VNNI 1
#define BS_INT16_EVEX 1
#include "kernels_avx2_int.c"
