/* attn_quant_avx512.c - AVX-512 code loops for quantized attention: 16
 * codes at a time are widened to 32-bit lanes and converted in registers.
 * A chunk of up to 16 rows is widened into an f32 tile once, then read by
 * kern_avx512.c's tile loops for every query head of the kv head.
 * 8-, 4-, 2- and 1-bit codes and e4m3 have vector paths; 3, 5, 6 and 7 bits
 * (codes straddling bytes) and rows not a multiple of 16 codes use the
 * scalar loops.
 * Sums are accumulated in a different order than the scalar loops, so
 * results agree to rounding, not bit for bit (tests/test_quant.c).
 */
#include <immintrin.h>
#include <string.h>

#include "backend/cpu/cpu.h"

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

/* Rows of codes stride bytes apart; nbits 0: e4m3 bytes. */
struct code_rows {
    const uint8_t *c;
    size_t stride;
    int nbits;
};

static void widen_codes(float *w, const void *src, int r0, int nr, int c0, int nc)
{
    const struct code_rows *t = src;
    for (int r = 0; r < nr; r++) {
        const uint8_t *row = t->c + (size_t)(r0 + r) * t->stride;
        for (int i = 0; i < nc; i += 16)
            _mm512_store_ps(w + r * CPU_ROWS16_COLS + i,
                            t->nbits ? codes16(row, t->nbits, (c0 + i) / 16) : e4m3_16(row + c0 + i));
    }
}

static void qdot_avx512(float *s, const float *x, size_t xs, int nq, const uint8_t *c, size_t stride, int nbits, int n,
                        int rows)
{
    if (!vector_bits(nbits) || n % 16) {
        cpu_qdot_scalar(s, x, xs, nq, c, stride, nbits, n, rows);
        return;
    }
    struct code_rows t = {.c = c, .stride = stride, .nbits = nbits};
    cpu_tiles_avx512(true, s, 0, x, xs, nq, widen_codes, &t, n, rows);
}

static void qaxpy_avx512(float *y, size_t ys, const float *a, int nq, const uint8_t *c, size_t stride, int nbits, int n,
                         int rows)
{
    if (!vector_bits(nbits) || n % 16) {
        cpu_qaxpy_scalar(y, ys, a, nq, c, stride, nbits, n, rows);
        return;
    }
    struct code_rows t = {.c = c, .stride = stride, .nbits = nbits};
    cpu_tiles_avx512(false, y, ys, a, 0, nq, widen_codes, &t, n, rows);
}

/* Pairs two u16 apart (consecutive): 16 pairs per 64-byte load, the
 * scales in the low halves, the zeros in the high. */
static void params_avx512(float *s, float *b, const uint16_t *pr, size_t step, int n, enum be_kvq_codes kind)
{
    if (step != 2) {
        cpu_params_scalar(s, b, pr, step, n, kind);
        return;
    }
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512i p = _mm512_maskz_loadu_epi32(m, pr + 2 * i);
        __m512 sc = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(p));
        __m512 z = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(p, 16)));
        __m512 nz = _mm512_sub_ps(_mm512_setzero_ps(), z);
        _mm512_mask_storeu_ps(s + i, m, sc);
        _mm512_mask_storeu_ps(b + i, m, kind == BE_KVQ_AFFINE_SHIFT ? nz : _mm512_mul_ps(nz, sc));
    }
}

static void e4m3_dot_avx512(float *s, const float *x, int nq, const uint8_t *c, size_t stride, int n, int rows)
{
    if (n % 16) {
        cpu_e4m3_dot_scalar(s, x, nq, c, stride, n, rows);
        return;
    }
    struct code_rows t = {.c = c, .stride = stride};
    cpu_tiles_avx512(true, s, 0, x, (size_t)n, nq, widen_codes, &t, n, rows);
}

static void e4m3_axpy_avx512(float *y, const float *a, int nq, const uint8_t *c, size_t stride, int n, int rows)
{
    if (n % 16) {
        cpu_e4m3_axpy_scalar(y, a, nq, c, stride, n, rows);
        return;
    }
    struct code_rows t = {.c = c, .stride = stride};
    cpu_tiles_avx512(false, y, (size_t)n, a, 0, nq, widen_codes, &t, n, rows);
}

const struct cpu_qkern cpu_qkern_avx512 = {
    .name = "avx512",
    .qdot = qdot_avx512,
    .qaxpy = qaxpy_avx512,
    .params = params_avx512,
    .e4m3_dot = e4m3_dot_avx512,
    .e4m3_axpy = e4m3_axpy_avx512,
};
