/*
 * Q3_K's 16 six-bit scales in one vector, for the x86 families (AVX2 and up): the same integers
 * as bs_q3k_scales (bs_internal.h) without its round trip through memory, where four 32-bit stores
 * read back as one 128-bit load cannot be forwarded (the load waits for the stores to reach L1),
 * once per block of 256 weights. Measured on a 2-core Zen 4 (python bench/native_ab.py MAIN.so NEW.so
 * qwen-q6k --only ffn_down, Qwen2.5-Coder-1.5B q6_k split, whose ffn_down bases are Q3_K; W2 + R,
 * results bit-identical): time 0.915 / 0.901 / 0.950 at 1 / 2 / 4 rows with avx512vnni-int16,
 * 0.913 / 0.907 / 0.945 with avx2-int16.
 *
 * Internal to native/arch/x86.
 */
#ifndef BS_X86_Q3K_SCALES_H
#define BS_X86_Q3K_SCALES_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* the 16 signed scales (-32..31: the six-bit codes minus Q3_K's 32) from the 12 bytes at s12: the
 * codes' low four bits are the low nibbles of bytes 0-7 (scales 0-7) and their high nibbles (8-15),
 * their top two bits those of scale j, j + 4, j + 8, j + 12 in bits 0-1, 2-3, 4-5, 6-7 of byte 8 + j.
 * Reads exactly 12 bytes. */
static inline __attribute__((always_inline, target("avx2"))) __m128i bs_q3k_scales_v(const uint8_t * s12) {
    uint32_t top;
    memcpy(&top, s12 + 8, 4);
    const __m128i lo = _mm_loadl_epi64((const __m128i *)s12), m4 = _mm_set1_epi8(0x0F);
    const __m128i nib = _mm_unpacklo_epi64(_mm_and_si128(lo, m4), _mm_and_si128(_mm_srli_epi16(lo, 4), m4));
    /* bytes 8-11 as one 32-bit word broadcast to the four lanes, lane i shifted right by 2 i: in
     * lane i, byte j holds bits 2i, 2i+1 of byte 8 + j at its bits 0-1 (what the shift brings in from
     * the next byte sits above them, masked off), the top bits of scale 4 i + j */
    const __m128i top2 = _mm_srlv_epi32(_mm_set1_epi32((int)top), _mm_setr_epi32(0, 2, 4, 6));
    const __m128i codes = _mm_or_si128(nib, _mm_slli_epi16(_mm_and_si128(top2, _mm_set1_epi8(3)), 4));
    return _mm_sub_epi8(codes, _mm_set1_epi8(32));
}

#endif
