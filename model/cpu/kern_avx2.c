/* kern_avx2.c - inner loops for AVX2 + FMA + F16C, compiled with their own
 * flags and only called after dispatch.c checked the CPU.
 *
 * Same plan as kern_avx512.c at 8 lanes: matvec streams four weight rows
 * against the same x registers, widening bf16/f16 in registers.  AVX2 has
 * no 16-bit masked loads, so a column tail goes through a zero-padded
 * copy of at most 7 elements.
 */
#include <immintrin.h>
#include <string.h>

#include "model/cpu/cpu.h"

/* 8 elements from element i of a row of dt, as f32. */
static inline __attribute__((always_inline)) __m256 load8(const void *w, enum be_dtype dt, size_t i)
{
    switch (dt) {
    case BE_BF16: {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    case BE_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
    case BE_F32: break;
    }
    return _mm256_loadu_ps((const float *)w + i);
}

/* The last left (< 8) elements from element i, zero-padded to 8. */
static inline __attribute__((always_inline)) __m256 load8_tail(const void *w, enum be_dtype dt, size_t i,
                                                               size_t left)
{
    _Alignas(32) unsigned char pad[32] = {0};
    size_t esz = be_dtype_size(dt);
    memcpy(pad, (const char *)w + i * esz, left * esz);
    return load8(pad, dt, 0);
}

static inline float hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[r0:r1] = W[r0:r1] . x for one token; dt is a constant after inlining. */
static inline __attribute__((always_inline)) void matvec(float *y, const float *x, const void *w, enum be_dtype dt,
                                                         int in, int r0, int r1)
{
    size_t esz = be_dtype_size(dt), row = (size_t)in * esz;
    size_t body = (size_t)in / 8 * 8, left = (size_t)in - body;
    __m256 xt = left ? load8_tail(x, BE_F32, body, left) : _mm256_setzero_ps();
    int r = r0;
    for (; r + 4 <= r1; r += 4) {
        const char *w0 = (const char *)w + (size_t)r * row;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (size_t i = 0; i < body; i += 8) {
            __m256 xv = _mm256_loadu_ps(x + i);
            a0 = _mm256_fmadd_ps(load8(w0, dt, i), xv, a0);
            a1 = _mm256_fmadd_ps(load8(w0 + row, dt, i), xv, a1);
            a2 = _mm256_fmadd_ps(load8(w0 + 2 * row, dt, i), xv, a2);
            a3 = _mm256_fmadd_ps(load8(w0 + 3 * row, dt, i), xv, a3);
        }
        if (left) {
            a0 = _mm256_fmadd_ps(load8_tail(w0, dt, body, left), xt, a0);
            a1 = _mm256_fmadd_ps(load8_tail(w0 + row, dt, body, left), xt, a1);
            a2 = _mm256_fmadd_ps(load8_tail(w0 + 2 * row, dt, body, left), xt, a2);
            a3 = _mm256_fmadd_ps(load8_tail(w0 + 3 * row, dt, body, left), xt, a3);
        }
        y[r] = hsum(a0);
        y[r + 1] = hsum(a1);
        y[r + 2] = hsum(a2);
        y[r + 3] = hsum(a3);
    }
    for (; r < r1; r++) {
        const char *w0 = (const char *)w + (size_t)r * row;
        __m256 a0 = _mm256_setzero_ps();
        for (size_t i = 0; i < body; i += 8)
            a0 = _mm256_fmadd_ps(load8(w0, dt, i), _mm256_loadu_ps(x + i), a0);
        if (left)
            a0 = _mm256_fmadd_ps(load8_tail(w0, dt, body, left), xt, a0);
        y[r] = hsum(a0);
    }
}

static void to_f32_avx2(float *y, const void *x, enum be_dtype dt, size_t n)
{
    size_t body = n / 8 * 8;
    for (size_t i = 0; i < body; i += 8)
        _mm256_storeu_ps(y + i, load8(x, dt, i));
    cpu_to_f32_scalar(y + body, (const char *)x + body * be_dtype_size(dt), dt, n - body);
}

static void matmul_rows_avx2(const struct cpu_mm *a, int r0, int r1, float *scratch)
{
    if (a->n >= CPU_GEMM_MIN_TOKENS && a->in <= CPU_SCRATCH_FLOATS) {
        cpu_matmul_panels(a, r0, r1, scratch, to_f32_avx2);
        return;
    }
    for (int t = 0; t < a->n; t++) {
        float *y = a->y + (size_t)t * a->out;
        const float *x = a->x + (size_t)t * a->in;
        switch (a->wt) {
        case BE_BF16: matvec(y, x, a->w, BE_BF16, a->in, r0, r1); break;
        case BE_F16: matvec(y, x, a->w, BE_F16, a->in, r0, r1); break;
        case BE_F32: matvec(y, x, a->w, BE_F32, a->in, r0, r1); break;
        }
    }
}

static float dot_avx2(const float *q, const void *k, enum be_dtype dt, int n)
{
    size_t body = (size_t)n / 8 * 8;
    __m256 acc = _mm256_setzero_ps();
    for (size_t i = 0; i < body; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k, dt, i), acc);
    if (body < (size_t)n)
        acc = _mm256_fmadd_ps(load8_tail(q, BE_F32, body, (size_t)n - body), load8_tail(k, dt, body, (size_t)n - body),
                              acc);
    return hsum(acc);
}

static void axpy_avx2(float *y, float a, const void *x, enum be_dtype dt, int n)
{
    size_t body = (size_t)n / 8 * 8;
    __m256 av = _mm256_set1_ps(a);
    for (size_t i = 0; i < body; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, load8(x, dt, i), _mm256_loadu_ps(y + i)));
    if (body < (size_t)n) {
        _Alignas(32) float t[8];
        _mm256_store_ps(t, _mm256_fmadd_ps(av, load8_tail(x, dt, body, (size_t)n - body),
                                           load8_tail(y, BE_F32, body, (size_t)n - body)));
        memcpy(y + body, t, ((size_t)n - body) * sizeof(float));
    }
}

static void scale_avx2(float *y, float a, int n)
{
    size_t body = (size_t)n / 8 * 8;
    __m256 av = _mm256_set1_ps(a);
    for (size_t i = 0; i < body; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_loadu_ps(y + i), av));
    for (size_t i = body; i < (size_t)n; i++)
        y[i] *= a;
}

static float sumsq_avx2(const float *x, int n)
{
    size_t body = (size_t)n / 8 * 8;
    __m256 acc = _mm256_setzero_ps();
    for (size_t i = 0; i < body; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    if (body < (size_t)n) {
        __m256 v = load8_tail(x, BE_F32, body, (size_t)n - body);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    return hsum(acc);
}

static void norm_mul_avx2(float *y, const float *x, float s, const float *w, int n)
{
    size_t body = (size_t)n / 8 * 8;
    __m256 sv = _mm256_set1_ps(s);
    for (size_t i = 0; i < body; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), sv), _mm256_loadu_ps(w + i)));
    for (size_t i = body; i < (size_t)n; i++)
        y[i] = (x[i] * s) * w[i];
}

static void add_avx2(float *y, const float *x, size_t n)
{
    size_t body = n / 8 * 8;
    for (size_t i = 0; i < body; i += 8)
        _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(y + i), _mm256_loadu_ps(x + i)));
    for (size_t i = body; i < n; i++)
        y[i] += x[i];
}

/* f16 through F16C; bf16 (no AVX2 instruction) and the tails through the
 * scalar code, which rounds identically. */
static void from_f32_avx2(void *y, enum be_dtype dt, const float *x, size_t n)
{
    size_t body = dt == BE_F16 ? n / 8 * 8 : 0;
    for (size_t i = 0; i < body; i += 8) {
        __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i *)((uint16_t *)y + i), h);
    }
    cpu_from_f32_scalar((char *)y + body * be_dtype_size(dt), dt, x + body, n - body);
}

const struct cpu_kern cpu_kern_avx2 = {
    .name = "avx2",
    .matmul_rows = matmul_rows_avx2,
    .dot = dot_avx2,
    .axpy = axpy_avx2,
    .scale = scale_avx2,
    .sumsq = sumsq_avx2,
    .norm_mul = norm_mul_avx2,
    .add = add_avx2,
    .to_f32 = to_f32_avx2,
    .from_f32 = from_f32_avx2,
};
