/* kvq_format.h - the quantized KV blocks laid out as backend.h's
 * be_kvq_format describes: code rows, group parameters, packed codes, the
 * affine and e4m3 codecs' arithmetic, and the order attention reads a
 * quantized view's keys in.  One copy for the backends' writers and the
 * kernels that read the blocks, on the CPU and (compiled for the device
 * too) on CUDA, so all of them agree bit for bit.
 */
#ifndef KVTIER_BACKEND_KVQ_FORMAT_H
#define KVTIER_BACKEND_KVQ_FORMAT_H

#include <math.h>
#include <stdint.h>

#include "backend/backend.h"
#include "util/half.h"

#ifdef __CUDACC__
#define KVQ_INLINE __host__ __device__ static inline
#else
#define KVQ_INLINE static inline
#endif

/* A product the device compiler may not fuse with the addition after it:
 * the CPU rounds the two separately, and the codes must not differ. */
#ifdef __CUDA_ARCH__
#define KVQ_MUL(a, b) __fmul_rn((a), (b))
#else
#define KVQ_MUL(a, b) ((a) * (b))
#endif

/* Bytes of one token's codes: the distance between consecutive code rows. */
KVQ_INLINE size_t kvq_row_bytes(const struct be_kvq_format *f)
{
    return (size_t)f->head_dim * (size_t)f->nbits / 8;
}

/* Codes of kv head kvh, block-relative token t: head_dim codes from a byte. */
KVQ_INLINE uint8_t *kvq_code_row(const struct be_kvq_format *f, const struct be_kvq_half *h, const void *blk,
                                    int kvh, int t)
{
    size_t row = (size_t)kvh * (size_t)f->block_tokens + (size_t)t;
    return (uint8_t *)blk + h->codes + row * kvq_row_bytes(f);
}

/* The f16 (scale, zero) pair of group row gr, group column gc of head kvh. */
KVQ_INLINE uint16_t *kvq_group_params(const struct be_kvq_format *f, const struct be_kvq_half *h, const void *blk,
                                         int kvh, int gr, int gc)
{
    size_t rows = (size_t)(f->block_tokens / h->gt), cols = (size_t)(f->head_dim / h->gd);
    return (uint16_t *)((char *)blk + h->params) + 2 * (((size_t)kvh * rows + (size_t)gr) * cols + (size_t)gc);
}

/* Code i of a little-endian string of nbits-wide codes. */
KVQ_INLINE unsigned kvq_code_get(const uint8_t *c, int nbits, int i)
{
    unsigned bit = (unsigned)i * (unsigned)nbits, sh = bit & 7;
    unsigned v = c[bit >> 3] >> sh;
    if (sh + (unsigned)nbits > 8) /* 3, 5, 6, 7 bits: the code continues in the next byte */
        v |= (unsigned)c[(bit >> 3) + 1] << (8 - sh);
    return v & ((1u << nbits) - 1);
}

KVQ_INLINE void kvq_code_put(uint8_t *c, int nbits, int i, unsigned code)
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
KVQ_INLINE float e4m3_to_f32(uint8_t c)
{
    float m = f32_from_bits((uint32_t)(c & 0x7f) << 20) * 0x1p120f;
    return (c & 0x80) ? -m : m;
}

/* Round to nearest even, saturating to +-448 (the "satfinite" conversion);
 * NaN encodes as 0x7f. */
KVQ_INLINE uint8_t f32_to_e4m3(float x)
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

/* ---- the affine codecs (kvq_codec.c's NOTES derive them) ---------------- */

/* f16 saturating at +-65504 rather than overflowing to inf, so an extreme
 * group degrades instead of turning into NaNs. */
KVQ_INLINE uint16_t kvq_param_f16(float x)
{
    return f32_to_f16(x > 65504.0f ? 65504.0f : x < -65504.0f ? -65504.0f : x);
}

KVQ_INLINE unsigned kvq_clamp_code(float r, int nbits)
{
    float top = (float)((1 << nbits) - 1);
    return !(r >= 0.0f) ? 0u : r > top ? (unsigned)top : (unsigned)r; /* NaN -> 0 */
}

/* A group whose values span [mn, mx]: the f16 pair stored for it, pr, and
 * the (s, z) its codes are computed with (kvq_affine_code). */
KVQ_INLINE void kvq_affine_params(enum be_kvq_codes kind, int nbits, float mn, float mx, uint16_t pr[2], float *s,
                                  float *z)
{
    float top = (float)((1 << nbits) - 1);
    if (kind == BE_KVQ_AFFINE_SHIFT) { /* quanto computes its codes with the rounded pair */
        pr[0] = kvq_param_f16((mx - mn) / top);
        pr[1] = kvq_param_f16(-mn);
        *s = f16_to_f32(pr[0]);
        *z = f16_to_f32(pr[1]);
    } else {
        /* hqq works with the inverse scale, in f32; torch evaluates its
         * max_v / (max - min) (a number over a tensor) as a reciprocal
         * times max_v, which rounds differently from a division */
        *s = (1.0f / (mx - mn)) * top;
        if (!(*s <= 2e4f))
            *s = 2e4f;
        *z = KVQ_MUL(-mn, *s);
        pr[0] = kvq_param_f16(1.0f / *s);
        pr[1] = kvq_param_f16(*z);
    }
}

KVQ_INLINE unsigned kvq_affine_code(enum be_kvq_codes kind, int nbits, float e, float s, float z)
{
    if (kind == BE_KVQ_AFFINE_SHIFT) /* a constant group divides 0 by 0; code 0 decodes to min */
        return s == 0.0f ? 0u : kvq_clamp_code(rintf((e + z) / s), nbits);
    return kvq_clamp_code(rintf(KVQ_MUL(e, s) + z), nbits);
}

KVQ_INLINE float kvq_affine_value(enum be_kvq_codes kind, unsigned c, const uint16_t *pr)
{
    float s = f16_to_f32(pr[0]), z = f16_to_f32(pr[1]);
    return kind == BE_KVQ_AFFINE_SHIFT ? KVQ_MUL((float)c, s) - z : ((float)c - z) * s;
}

/* Element d of head kvh, block-relative token t, of half h of a block,
 * decoded (scale: the e4m3 tensor scale). */
KVQ_INLINE float kvq_decode(const struct be_kvq_format *f, const struct be_kvq_half *h, const void *blk, int kvh,
                            int t, int d, float scale)
{
    const uint8_t *c = kvq_code_row(f, h, blk, kvh, t);
    if (f->kind == BE_KVQ_E4M3)
        return e4m3_to_f32(c[d]) * scale;
    return kvq_affine_value(f->kind, kvq_code_get(c, f->nbits, d),
                            kvq_group_params(f, h, blk, kvh, t / h->gt, d / h->gd));
}

/* The first position a flush from hi must rewrite in half h: the start of
 * hi's group row for per-channel groups (its earlier tokens are decoded
 * and quantized again with the new ones, so groups are computed over
 * whole rows), hi itself otherwise. */
KVQ_INLINE int64_t kvq_reopen_from(const struct be_kvq_half *h, enum be_kvq_codes kind, int64_t hi)
{
    return kind != BE_KVQ_E4M3 && h->gt > 1 ? hi / h->gt * h->gt : hi;
}

/* ---- the keys attention reads ---------------------------------------------- */

/* The keys of the token at qpos, in the order attention reads them: the
 * sinks (positions [0, sinks) of the rest), the quantized positions
 * [qlo, qhi), then the full-precision rest [rlo, rhi). */
struct kvq_keys {
    int64_t sinks, qlo, qhi, rlo, rhi;
};

/* Fills kk; returns the number of keys. */
static inline int64_t kvq_keys(const struct be_attn_params *p, const struct be_kvq_view *v, int64_t qpos,
                               struct kvq_keys *kk)
{
    int64_t k0 = v->lo, k1 = p->bidirectional ? INT64_MAX : qpos + 1; /* as be_attention bounds them */
    int window = v->rest.window ? v->rest.window : p->window; /* a sequence's own window first */
    if (window > 0 && qpos - window + 1 > k0)
        k0 = qpos - window + 1;
    kk->sinks = v->rest.sinks;
    kk->qlo = k0;
    kk->qhi = v->fmt && k1 < v->hi ? k1 : v->fmt ? v->hi : k0; /* no format: a dense sequence of a mixed batch */
    kk->rlo = k0 > v->rest.lo ? k0 : v->rest.lo;
    kk->rhi = k1 < v->rest.hi ? k1 : v->rest.hi;
    if (kk->qhi < kk->qlo)
        kk->qhi = kk->qlo;
    if (kk->rhi < kk->rlo)
        kk->rhi = kk->rlo;
    return kk->sinks + (kk->qhi - kk->qlo) + (kk->rhi - kk->rlo);
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
