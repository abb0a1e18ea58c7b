/* kvq_format.h - accessors of the quantized KV blocks laid out as
 * backend.h's be_kvq_format describes: code rows, group parameters, packed
 * codes and the e4m3 codec.  Private to the CPU backend: one copy for its
 * writer (kvq_codec.c) and its kernels that read the blocks, so both agree
 * bit for bit.
 */
#ifndef KVTIER_CPU_KVQ_FORMAT_H
#define KVTIER_CPU_KVQ_FORMAT_H

#include <math.h>
#include <stdint.h>

#include "backend/backend.h"
#include "util/half.h"

/* Bytes of one token's codes: the distance between consecutive code rows. */
static inline size_t kvq_row_bytes(const struct be_kvq_format *f)
{
    return (size_t)f->head_dim * (size_t)f->nbits / 8;
}

/* Codes of kv head kvh, block-relative token t: head_dim codes from a byte. */
static inline uint8_t *kvq_code_row(const struct be_kvq_format *f, const struct be_kvq_half *h, const void *blk,
                                    int kvh, int t)
{
    size_t row = (size_t)kvh * (size_t)f->block_tokens + (size_t)t;
    return (uint8_t *)blk + h->codes + row * kvq_row_bytes(f);
}

/* The f16 (scale, zero) pair of group row gr, group column gc of head kvh. */
static inline uint16_t *kvq_group_params(const struct be_kvq_format *f, const struct be_kvq_half *h, const void *blk,
                                         int kvh, int gr, int gc)
{
    size_t rows = (size_t)(f->block_tokens / h->gt), cols = (size_t)(f->head_dim / h->gd);
    return (uint16_t *)((char *)blk + h->params) + 2 * (((size_t)kvh * rows + (size_t)gr) * cols + (size_t)gc);
}

/* Code i of a little-endian string of nbits-wide codes. */
static inline unsigned kvq_code_get(const uint8_t *c, int nbits, int i)
{
    unsigned bit = (unsigned)i * (unsigned)nbits, sh = bit & 7;
    unsigned v = c[bit >> 3] >> sh;
    if (sh + (unsigned)nbits > 8) /* 3, 5, 6, 7 bits: the code continues in the next byte */
        v |= (unsigned)c[(bit >> 3) + 1] << (8 - sh);
    return v & ((1u << nbits) - 1);
}

static inline void kvq_code_put(uint8_t *c, int nbits, int i, unsigned code)
{
    unsigned bit = (unsigned)i * (unsigned)nbits, sh = bit & 7, mask = (1u << nbits) - 1;
    c[bit >> 3] = (uint8_t)((c[bit >> 3] & ~(mask << sh)) | (code << sh));
    if (sh + (unsigned)nbits > 8)
        c[(bit >> 3) + 1] = (uint8_t)((c[(bit >> 3) + 1] & ~(mask >> (8 - sh))) | (code >> (8 - sh)));
}

/* e4m3 "fn" (torch.float8_e4m3fn): 1 sign, 4 exponent bits (bias 7), 3
 * mantissa bits, no infinities, S.1111.111 is NaN, largest finite 448. */


/* Placing the 7 magnitude bits at f32 bit 20 makes an f32 whose exponent
 * field is the e4m3 exponent and whose mantissa starts with the 3 e4m3 bits;
 * multiplying by 2^(127-7) rebiases it exactly, subnormals included (they
 * land on f32 subnormals, exact while denormals are not flushed).  The SIMD
 * kernels use the same two steps.  NaN codes are never written (the encoder
 * saturates), so they are not special-cased: 0x7f reads as 480. */
static inline float e4m3_to_f32(uint8_t c)
{
    float m = f32_from_bits((uint32_t)(c & 0x7f) << 20) * 0x1p120f;
    return (c & 0x80) ? -m : m;
}

/* Round to nearest even, saturating to +-448 (the "satfinite" conversion);
 * NaN encodes as 0x7f. */
static inline uint8_t f32_to_e4m3(float x)
{
    uint8_t sign = (uint8_t)((f32_bits(x) >> 24) & 0x80);
    float a = fabsf(x);
    if (a != a)
        return 0x7f;
    if (a >= BE_E4M3_MAX)
        return (uint8_t)(sign | 0x7e);
    if (a < 0x1p-6f) /* subnormal: a multiple of 2^-9; 8 * 2^-9 is the smallest normal, code 0x08 */
        return (uint8_t)(sign | (uint8_t)rintf(a * 0x1p9f));
    uint32_t u = f32_bits(a);
    u += 0x7ffffu + ((u >> 20) & 1); /* round the 23-bit mantissa to 3 bits, ties to even */
    return (uint8_t)(sign | ((u - (120u << 23)) >> 20));
}

/* The writer's two halves, for the codec's own tests.  kvq_quantize
 * quantizes tokens [t0, t1) of a block from rows k and v (token i of the
 * range at k + i*row_stride, n_kv_heads*head_dim floats, head-major as the
 * forward pass produces them).  Per-channel groups are computed over the
 * tokens given, so t0 must start a group row; a range ending inside a row
 * gives that row parameters over its present tokens.  scale_k/scale_v are
 * the e4m3 tensor scales (ignored by the affine kinds).  kvq_dequantize is
 * the inverse. */
void kvq_quantize(const struct be_kvq_format *f, void *block, int t0, int t1, const float *k, const float *v,
                  size_t row_stride, float scale_k, float scale_v);
void kvq_dequantize(const struct be_kvq_format *f, const void *block, int t0, int t1, float *k, float *v,
                    size_t row_stride, float scale_k, float scale_v);

#endif
