/* q4k.h - GGUF's Q4_K block format for weights (GGML type 12): a
 * super-block of 256 consecutive elements of a row is 8 sub-blocks of 32,
 * each with a 6-bit scale sc and a 6-bit min m, and every element is a
 * 4-bit code q in [0, 15]:
 *
 *     x ~ d * sc * q - dmin * m
 *
 * with d and dmin the super-block's two f16 factors.  The bytes are a GGUF
 * file's, so a Q4_K tensor read from one is used as it is (q4_k_check) and
 * one quantized here could be written to one.
 *
 * Layout of the 144 bytes: d, dmin, then scales[12] packing the sixteen
 * 6-bit values (sub-blocks 0..3 in the low 6 bits of bytes 0..3 (sc) and
 * 4..7 (m); sub-blocks 4..7 in the nibbles of bytes 8..11 (sc low, m
 * high) with their top 2 bits in the top bits of bytes 0..3 (sc) and 4..7
 * (m)), then qs[128]: sub-blocks 2i and 2i+1 share bytes 32i .. 32i+31,
 * 2i in the low nibbles, 2i+1 in the high ones.
 */
#ifndef KVTIER_UTIL_Q4K_H
#define KVTIER_UTIL_Q4K_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define Q4_K_BLOCK 256     /* elements per super-block */
#define Q4_K_SUB 32        /* elements per sub-block (one scale and min) */
#define GGML_TYPE_Q4_K 12  /* the type id of these blocks in a GGUF file */

struct q4_k_block {
    uint16_t d;    /* f16 factor of the scales */
    uint16_t dmin; /* f16 factor of the mins */
    uint8_t scales[12];
    uint8_t qs[Q4_K_BLOCK / 2];
};
#ifdef __cplusplus /* the CUDA plugin's C++ */
static_assert(sizeof(struct q4_k_block) == 144, "Q4_K blocks are 144 bytes, unpadded");
#else
_Static_assert(sizeof(struct q4_k_block) == 144, "Q4_K blocks are 144 bytes, unpadded");
#endif

/* Bytes of a row of n elements; 0 when n is not whole super-blocks. */
static inline size_t q4_k_row_bytes(size_t n)
{
    return n % Q4_K_BLOCK ? 0 : n / Q4_K_BLOCK * sizeof(struct q4_k_block);
}

#ifdef __CUDACC__
#define Q4K_INLINE __host__ __device__ static inline /* the CUDA plugin's kernels read the blocks too */
#else
#define Q4K_INLINE static inline
#endif

/* Sub-block j's (0..7) 6-bit scale and min, by the definition above. */
Q4K_INLINE void q4_k_scale_min(const uint8_t scales[12], int j, int *sc, int *m)
{
    if (j < 4) {
        *sc = scales[j] & 63;
        *m = scales[j + 4] & 63;
    } else {
        *sc = (scales[j + 4] & 0x0f) | (scales[j - 4] >> 6) << 4;
        *m = (scales[j + 4] >> 4) | (scales[j] >> 6) << 4;
    }
}

/* The same for all eight at once, as bytes: sc of sub-block j is byte j
 * of out[0..1], its m byte j of out[2..3] (little-endian words), for the
 * SIMD kernels to widen. */
static inline void q4_k_unpack(const uint8_t scales[12], uint32_t out[4])
{
    uint32_t w0 = (uint32_t)scales[0] | (uint32_t)scales[1] << 8 | (uint32_t)scales[2] << 16 |
                  (uint32_t)scales[3] << 24;
    uint32_t w1 = (uint32_t)scales[4] | (uint32_t)scales[5] << 8 | (uint32_t)scales[6] << 16 |
                  (uint32_t)scales[7] << 24;
    uint32_t w2 = (uint32_t)scales[8] | (uint32_t)scales[9] << 8 | (uint32_t)scales[10] << 16 |
                  (uint32_t)scales[11] << 24;
    out[0] = w0 & 0x3f3f3f3fu;
    out[1] = (w2 & 0x0f0f0f0fu) | ((w0 >> 2) & 0x30303030u);
    out[2] = w1 & 0x3f3f3f3fu;
    out[3] = ((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 2) & 0x30303030u);
}

/* Quantizes n elements (a multiple of Q4_K_BLOCK) of x into n / 256
 * blocks.  Each sub-block's scale and min are fitted by weighted least
 * squares over a few candidate code assignments (elements of larger
 * magnitude weigh more), the sixteen fits of a super-block are rounded
 * to 6 bits against d and dmin, and the codes are finally rounded against
 * the stored (f16, 6-bit) values, so every element within its sub-block's
 * range is within half a step of its code.  False (y partly written) when
 * an element is not finite or a super-block's factors overflow f16. */
bool q4_k_quantize(const float *x, struct q4_k_block *y, size_t n);
/* y[i] = f16(d) * sc * q - f16(dmin) * m for n elements (a multiple of Q4_K_BLOCK). */
void q4_k_dequantize(const struct q4_k_block *x, float *y, size_t n);
/* Whether n blocks read from a file (GGUF's bytes, used as they are) have
 * finite d and dmin: a code cannot make a NaN out of finite factors, so
 * this is all a Q4_K tensor needs before a matmul reads it. */
bool q4_k_check(const struct q4_k_block *x, size_t n);

#endif
