/* transpose16.h - the 16 x 16 transpose of 32-bit words that the AVX-512
 * GEMMs pack weight panels with (bf16_avx512.c: a word is a pair of bf16;
 * wq_vnni.c: four int8 codes) and attention turns a tile of keys into
 * columns with (kern_avx512.c: an f32).  Include from files compiled with
 * the AVX-512 flags only.
 */
#ifndef KVTIER_CPU_TRANSPOSE16_H
#define KVTIER_CPU_TRANSPOSE16_H

#include <immintrin.h>

/* r[j] (16 words of row j) -> r[p] (word p of the 16 rows): a 16 x 16
 * transpose of 32-bit words in three rounds of shuffles. */
static inline void transpose16(__m512i r[16])
{
    __m512i t[16], u[16];
    for (int a = 0; a < 8; a++) { /* per 128-bit lane: pairs of rows */
        t[2 * a] = _mm512_unpacklo_epi32(r[2 * a], r[2 * a + 1]);
        t[2 * a + 1] = _mm512_unpackhi_epi32(r[2 * a], r[2 * a + 1]);
    }
    for (int g = 0; g < 4; g++) { /* u[4g + c] lane l: word 4l + c of rows 4g .. 4g+3 */
        u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int c = 0; c < 4; c++) { /* lane l of the four groups into word 4l + c */
        __m512i s0 = _mm512_shuffle_i32x4(u[c], u[4 + c], _MM_SHUFFLE(2, 0, 2, 0));
        __m512i s1 = _mm512_shuffle_i32x4(u[c], u[4 + c], _MM_SHUFFLE(3, 1, 3, 1));
        __m512i s2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(2, 0, 2, 0));
        __m512i s3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(3, 1, 3, 1));
        r[c] = _mm512_shuffle_i32x4(s0, s2, _MM_SHUFFLE(2, 0, 2, 0));
        r[4 + c] = _mm512_shuffle_i32x4(s1, s3, _MM_SHUFFLE(2, 0, 2, 0));
        r[8 + c] = _mm512_shuffle_i32x4(s0, s2, _MM_SHUFFLE(3, 1, 3, 1));
        r[12 + c] = _mm512_shuffle_i32x4(s1, s3, _MM_SHUFFLE(3, 1, 3, 1));
    }
}

#endif
