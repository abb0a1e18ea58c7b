/* attn_quant_avx512.c - AVX-512 code loops for quantized attention: 16
 * codes at a time are widened to 32-bit lanes and converted in registers.
 * 8-, 4-, 2- and 1-bit codes and e4m3 have vector paths; 3, 5, 6 and 7 bits
 * (codes straddling bytes) and rows not a multiple of 16 codes use the
 * scalar loops.
 * Sums are accumulated in a different order than the scalar loops, so
 * results agree to rounding, not bit for bit (tests/test_quant.c).
 */
#include <immintrin.h>
#include <string.h>

#include "model/cpu/cpu.h"

/* 16 codes, starting at code 16*j of c, as floats. */
static inline __m512 codes16(const uint8_t *c, int nbits, int j)
{
    __m512i lanes;
    switch (nbits) {
    case 8:
        lanes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + 16 * j)));
        break;
    case 4: {
        /* 8 bytes hold codes 2i (low nibble) and 2i+1 (high nibble) */
        __m128i b = _mm_loadl_epi64((const __m128i *)(c + 8 * j));
        __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0f));
        __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0f));
        lanes = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
        break;
    }
    default: { /* 2 or 1 bits: the 16 codes fit one 32-bit word; lane i shifts its code down */
        uint32_t w = 0;
        memcpy(&w, c + (size_t)j * 2 * (size_t)nbits, (size_t)nbits * 2);
        __m512i sh = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                        _mm512_set1_epi32(nbits));
        lanes = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)w), sh),
                                 _mm512_set1_epi32((1 << nbits) - 1));
        break;
    }
    }
    return _mm512_cvtepi32_ps(lanes);
}

static inline bool vector_bits(int nbits)
{
    return nbits == 8 || nbits == 4 || nbits == 2 || nbits == 1;
}

static void qdot_avx512(float *s, const float *x, const uint8_t *c, size_t stride, int nbits, int n, int rows)
{
    if (!vector_bits(nbits) || n % 16) {
        cpu_qdot_scalar(s, x, c, stride, nbits, n, rows);
        return;
    }
    for (int r = 0; r < rows; r++, c += stride) {
        __m512 acc = _mm512_setzero_ps();
        for (int j = 0; 16 * j < n; j++)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + 16 * j), codes16(c, nbits, j), acc);
        s[r] = _mm512_reduce_add_ps(acc);
    }
}

/* Rows inside, 16 columns outside: each 16 floats of y stay in a register
 * over the whole chunk of rows. */
static void qaxpy_avx512(float *y, const float *a, const uint8_t *c, size_t stride, int nbits, int n, int rows)
{
    if (!vector_bits(nbits) || n % 16) {
        cpu_qaxpy_scalar(y, a, c, stride, nbits, n, rows);
        return;
    }
    for (int j = 0; 16 * j < n; j++) {
        __m512 acc = _mm512_loadu_ps(y + 16 * j);
        for (int r = 0; r < rows; r++)
            acc = _mm512_fmadd_ps(_mm512_set1_ps(a[r]), codes16(c + (size_t)r * stride, nbits, j), acc);
        _mm512_storeu_ps(y + 16 * j, acc);
    }
}

/* fp8.h's conversion in vector form: magnitude bits to f32 bit 20, times
 * 2^120, sign moved to bit 31. */
static inline __m512 e4m3_16(const uint8_t *c)
{
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c));
    __m512i mag = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7f)), 20);
    __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
    __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(0x1p120f));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign));
}

static float e4m3_dot_avx512(const float *x, const uint8_t *c, int n)
{
    __m512 acc = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), e4m3_16(c + i), acc);
    return _mm512_reduce_add_ps(acc) + cpu_e4m3_dot_scalar(x + i, c + i, n - i);
}

static void e4m3_axpy_avx512(float *y, float a, const uint8_t *c, int n)
{
    __m512 va = _mm512_set1_ps(a);
    int i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, e4m3_16(c + i), _mm512_loadu_ps(y + i)));
    cpu_e4m3_axpy_scalar(y + i, a, c + i, n - i);
}

const struct cpu_qkern cpu_qkern_avx512 = {
    .name = "avx512",
    .qdot = qdot_avx512,
    .qaxpy = qaxpy_avx512,
    .e4m3_dot = e4m3_dot_avx512,
    .e4m3_axpy = e4m3_axpy_avx512,
};
