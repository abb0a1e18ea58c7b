/* half.h - portable conversions between f32 and the 16-bit float formats,
 * bit for bit what F16C and the AVX-512 code produce (round to nearest
 * even, NaN kept quiet), so every SIMD level stores identical KV bytes.
 */
#ifndef KVTIER_UTIL_HALF_H
#define KVTIER_UTIL_HALF_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define HALF_INLINE __host__ __device__ static inline /* the CUDA plugin decodes quantized KV with these */
#else
#define HALF_INLINE static inline
#endif

HALF_INLINE uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

HALF_INLINE float f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

HALF_INLINE float bf16_to_f32(uint16_t h)
{
    return f32_from_bits((uint32_t)h << 16);
}

HALF_INLINE uint16_t f32_to_bf16(float f)
{
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40); /* quiet the NaN rather than round it into inf */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

HALF_INLINE float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0x1f)
        return f32_from_bits(sign | 0x7f800000u | (man << 13) | (man ? 0x400000u : 0));
    if (exp == 0) { /* zero or subnormal: man * 2^-24 is exact in f32 */
        float v = (float)man * 0x1p-24f;
        return sign ? -v : v;
    }
    return f32_from_bits(sign | ((exp + 112) << 23) | (man << 13));
}

HALF_INLINE uint16_t f32_to_f16(float f)
{
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) /* NaN: keep the top payload bits, force quiet */
        return (uint16_t)(sign | 0x7e00 | ((a >> 13) & 0x3ff));
    if (a >= 0x477ff000u) /* rounds to >= 65520: inf */
        return (uint16_t)(sign | 0x7c00);
    if (a < 0x38800000u) { /* below 2^-14: subnormal or zero, scale so the FPU rounds */
        float s = f32_from_bits(a) * 0x1p24f; /* exact */
        uint32_t m = (uint32_t)s;
        float rem = s - (float)m;
        if (rem > 0.5f || (rem == 0.5f && (m & 1)))
            m++;
        return (uint16_t)(sign | m);
    }
    uint32_t r = a + 0xfffu + ((a >> 13) & 1);
    return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}

#endif
