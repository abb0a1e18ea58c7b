/* kern_avx2.c - inner loops for AVX2 + FMA + F16C, compiled with their own
 * flags and only called after dispatch.c checked the CPU.
 *
 * Same plan as kern_avx512.c at 8 lanes: matvec streams four weight rows
 * against the same x registers (two rows against four tokens for small
 * batches), widening bf16/f16 in registers.  AVX2 has
 * no 16-bit masked loads, so a column tail goes through a zero-padded
 * copy of at most 7 elements.
 */
#include <immintrin.h>
#include <string.h>

#include "backend/cpu/cpu.h"

/* 8 elements from element i of a row of dt, as f32. */
static inline __attribute__((always_inline)) __m256 load8(const void *w, enum be_dtype dt, size_t i)
{
    switch (dt) {
    case BE_BF16: {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    case BE_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i)));
    case BE_F32: case BE_Q8_0: case BE_Q4_K: break; /* blocks go to q8_avx2.c, never here */
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

/* Rows [r0, r1) of W times tokens t0 .. t0+TN of x, ROWS rows at a time:
 * each weight vector is widened once and feeds all TN tokens, so a batch of
 * decode tokens streams W once per TN tokens.  ROWS x TN accumulators must
 * fit the 16 ymm registers with the weights and x: 4x1 for one token
 * (more rows in flight), 2x4 for batches.  dt, ROWS and TN are constants
 * after inlining. */
static inline __attribute__((always_inline)) void matvec_tokens(const struct cpu_mm *a, const enum be_dtype dt,
                                                                int t0, const int TN, const int ROWS, int r0,
                                                                int r1)
{
    size_t esz = be_dtype_size(dt), row = (size_t)a->in * esz;
    size_t body = (size_t)a->in / 8 * 8, left = (size_t)a->in - body;
    const float *x = a->x + (size_t)t0 * a->in;
    for (int r = r0; r < r1; r += ROWS) {
        int nr = r1 - r < ROWS ? r1 - r : ROWS;
        const char *w0 = (const char *)a->w + (size_t)r * row;
        __m256 acc[4][4];
#pragma GCC unroll 4
        for (int t = 0; t < TN; t++)
#pragma GCC unroll 4
            for (int k = 0; k < ROWS; k++)
                acc[t][k] = _mm256_setzero_ps();
        if (nr == ROWS) {
            for (size_t i = 0; i < body; i += 8) {
                __m256 wv[4];
#pragma GCC unroll 4
                for (int k = 0; k < ROWS; k++) {
                    /* the next row group, one group ahead (see kern_avx512.c) */
                    _mm_prefetch(w0 + (k + ROWS) * row + i * esz, _MM_HINT_T0);
                    wv[k] = load8(w0 + k * row, dt, i);
                }
#pragma GCC unroll 4
                for (int t = 0; t < TN; t++) {
                    __m256 xv = _mm256_loadu_ps(x + (size_t)t * a->in + i);
#pragma GCC unroll 4
                    for (int k = 0; k < ROWS; k++)
                        acc[t][k] = _mm256_fmadd_ps(wv[k], xv, acc[t][k]);
                }
            }
        } else { /* the last rows of a range: one at a time, no spills */
            for (int k = 0; k < nr; k++)
                for (size_t i = 0; i < body; i += 8) {
                    __m256 wv = load8(w0 + k * row, dt, i);
                    for (int t = 0; t < TN; t++)
                        acc[t][k] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (size_t)t * a->in + i), acc[t][k]);
                }
        }
        for (int k = 0; k < nr; k++)
            for (int t = 0; t < TN; t++) {
                if (left)
                    acc[t][k] = _mm256_fmadd_ps(load8_tail(w0 + k * row, dt, body, left),
                                                load8_tail(x + (size_t)t * a->in, BE_F32, body, left), acc[t][k]);
                a->y[(size_t)(t0 + t) * a->out + r + k] = hsum(acc[t][k]);
            }
    }
}

/* Every token of a: one at a time with four rows in flight, or four at a
 * time against two rows; dt is a constant after inlining. */
static inline __attribute__((always_inline)) void matmul_tokens(const struct cpu_mm *a, const enum be_dtype dt,
                                                                int r0, int r1)
{
    if (a->n == 1) {
        matvec_tokens(a, dt, 0, 1, 4, r0, r1);
        return;
    }
    int t = 0;
    for (; t + 4 <= a->n; t += 4)
        matvec_tokens(a, dt, t, 4, 2, r0, r1);
    switch (a->n - t) {
    case 3: matvec_tokens(a, dt, t, 3, 2, r0, r1); break;
    case 2: matvec_tokens(a, dt, t, 2, 2, r0, r1); break;
    case 1: matvec_tokens(a, dt, t, 1, 4, r0, r1); break;
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
    if (cpu_wq(a->wt)) {
        cpu_matmul_wq_avx2(a, r0, r1, scratch);
        return;
    }
    if (a->n >= CPU_GEMM_MIN_TOKENS && a->in <= CPU_SCRATCH_FLOATS) {
        cpu_matmul_panels(a, r0, r1, scratch, to_f32_avx2);
        return;
    }
    switch (a->wt) {
    case BE_BF16: matmul_tokens(a, BE_BF16, r0, r1); break;
    case BE_F16: matmul_tokens(a, BE_F16, r0, r1); break;
    case BE_F32: matmul_tokens(a, BE_F32, r0, r1); break;
    case BE_Q8_0: case BE_Q4_K: break; /* handled above */
    }
}

/* Each query head over the rows in turn: the AVX-512 level's one
 * widening per row for all heads is not worth its code here. */
static void dot_avx2(float *s, const float *q, int nq, const char *const *rows, enum be_dtype dt, int n, int nrows)
{
    size_t body = (size_t)n / 8 * 8;
    for (int g = 0; g < nq; g++, q += n, s += nrows)
        for (int r = 0; r < nrows; r++) {
            __m256 acc = _mm256_setzero_ps();
            for (size_t i = 0; i < body; i += 8)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(rows[r], dt, i), acc);
            if (body < (size_t)n)
                acc = _mm256_fmadd_ps(load8_tail(q, BE_F32, body, (size_t)n - body),
                                      load8_tail(rows[r], dt, body, (size_t)n - body), acc);
            s[r] = hsum(acc);
        }
}

static void axpy_avx2(float *y, const float *a, int nq, const char *const *rows, size_t off, enum be_dtype dt, int n,
                      int nrows, bool odd)
{
    (void)odd; /* one key at a time */
    size_t body = (size_t)n / 8 * 8;
    for (int g = 0; g < nq; g++, y += n, a += nrows) {
        for (size_t i = 0; i < body; i += 8) {
            __m256 acc = _mm256_loadu_ps(y + i);
            for (int r = 0; r < nrows; r++)
                acc = _mm256_fmadd_ps(_mm256_set1_ps(a[r]), load8(rows[r] + off, dt, i), acc);
            _mm256_storeu_ps(y + i, acc);
        }
        if (body < (size_t)n) {
            _Alignas(32) float t[8];
            __m256 acc = load8_tail(y, BE_F32, body, (size_t)n - body);
            for (int r = 0; r < nrows; r++)
                acc = _mm256_fmadd_ps(_mm256_set1_ps(a[r]), load8_tail(rows[r] + off, dt, body, (size_t)n - body),
                                      acc);
            _mm256_store_ps(t, acc);
            memcpy(y + body, t, ((size_t)n - body) * sizeof(float));
        }
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

/* exp as kern_avx512.c's exp16, with 2^k built in two halves from the
 * exponent bits (no scalef): each half stays a normal float, so the
 * product rounds to a subnormal or overflows to inf as expf does. */
static inline __m256 exp8(__m256 x)
{
    x = _mm256_min_ps(_mm256_set1_ps(89.0f), _mm256_max_ps(_mm256_set1_ps(-104.0f), x)); /* NaN stays */
    __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i ki = _mm256_cvtps_epi32(k), k1 = _mm256_srai_epi32(ki, 1), k2 = _mm256_sub_epi32(ki, k1);
    __m256i bias = _mm256_set1_epi32(127);
    __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, bias), 23));
    __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, f1), f2);
}

/* log(x) for finite x >= 1, as kern_avx512.c's log16 with the exponent and
 * mantissa taken from the bits. */
static inline __m256 log8(__m256 x)
{
    __m256i b = _mm256_castps_si256(x);
    __m256 e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b, 23), _mm256_set1_epi32(127)));
    __m256 m = _mm256_castsi256_ps(
        _mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi32(0x7fffff)), _mm256_set1_epi32(0x3f800000)));
    __m256 big = _mm256_cmp_ps(m, _mm256_set1_ps(1.41421356237f), _CMP_GT_OQ);
    m = _mm256_blendv_ps(m, _mm256_mul_ps(m, _mm256_set1_ps(0.5f)), big);
    e = _mm256_add_ps(e, _mm256_and_ps(big, _mm256_set1_ps(1.0f)));
    __m256 r = _mm256_sub_ps(m, _mm256_set1_ps(1.0f)), r2 = _mm256_mul_ps(r, r);
    __m256 p = _mm256_set1_ps(7.0376836292e-2f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(-1.1514610310e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.1676998740e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(-1.2420140846e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.4249322787e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(-1.6668057665e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(2.0000714765e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(-2.4999993993e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(3.3333331174e-1f));
    __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, r), r2);
    y = _mm256_fmadd_ps(e, _mm256_set1_ps(-2.12194440e-4f), y);
    y = _mm256_fnmadd_ps(r2, _mm256_set1_ps(0.5f), y);
    return _mm256_fmadd_ps(e, _mm256_set1_ps(0.693359375f), _mm256_add_ps(r, y));
}

/* kern_avx512.c's softplus16: a NaN reaches the result through u / d. */
static inline __m256 softplus8(__m256 x)
{
    __m256 one = _mm256_set1_ps(1.0f), u = exp8(x), w = _mm256_add_ps(one, u), d = _mm256_sub_ps(w, one);
    __m256 l = _mm256_mul_ps(log8(w), _mm256_div_ps(u, d));
    l = _mm256_blendv_ps(l, u, _mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_EQ_OQ));
    return _mm256_blendv_ps(l, x, _mm256_cmp_ps(x, _mm256_set1_ps(20.0f), _CMP_GT_OQ));
}

/* kern_avx512.c's ssm_scan_avx512 with eight channels a vector; h goes
 * back lane by lane (AVX2 has gathers but no scatters). */
static void ssm_scan_avx2(const struct cpu_ssm *a, size_t lo, size_t hi)
{
    const struct be_ssm_params *p = a->p;
    size_t di = (size_t)p->d_inner;
    int N = p->d_state;
    const __m256i iota = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0), lane = _mm256_mullo_epi32(iota, _mm256_set1_epi32(N));
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (size_t i = lo; i < hi; i += 8) {
        int n = hi - i < 8 ? (int)(hi - i) : 8;
        __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), iota);
        __m256 mf = _mm256_castsi256_ps(m), h[BE_SSM_MAX_STATE], A[BE_SSM_MAX_STATE];
        for (int s = 0; s < N; s++) {
            A[s] = _mm256_mask_i32gather_ps(zero, p->A + i * (size_t)N + s, lane, mf, 4);
            h[s] = _mm256_mask_i32gather_ps(zero, a->h_in + i * (size_t)N + s, lane, mf, 4);
        }
        __m256 D = _mm256_maskload_ps(p->D + i, m);
        for (int t = a->t0; t < a->t1; t++) {
            size_t r = (size_t)t * di + i;
            __m256 x = _mm256_maskload_ps(a->x + r, m), z = _mm256_maskload_ps(a->z + r, m);
            __m256 dt = softplus8(_mm256_maskload_ps(a->dt + r, m)), dtx = _mm256_mul_ps(dt, x);
            const float *B = a->B + (size_t)t * N, *C = a->C + (size_t)t * N;
            __m256 acc = zero;
            for (int s = 0; s < N; s++) {
                h[s] = _mm256_fmadd_ps(exp8(_mm256_mul_ps(dt, A[s])), h[s], _mm256_mul_ps(dtx, _mm256_set1_ps(B[s])));
                acc = _mm256_fmadd_ps(_mm256_set1_ps(C[s]), h[s], acc);
            }
            __m256 gate = _mm256_div_ps(z, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, z))));
            _mm256_maskstore_ps(a->y + r, m, _mm256_mul_ps(_mm256_fmadd_ps(D, x, acc), gate));
        }
        for (int s = 0; s < N; s++) {
            float v[8];
            _mm256_storeu_ps(v, h[s]);
            for (int c = 0; c < n; c++)
                a->h_out[(i + (size_t)c) * (size_t)N + (size_t)s] = v[c];
        }
    }
}

const struct cpu_kern cpu_kern_avx2 = {
    .name = "avx2",
    .matmul_rows = matmul_rows_avx2,
    .dot = dot_avx2,
    .axpy = axpy_avx2,
    .scale = scale_avx2,
    .max = cpu_max_scalar,
    .exp_sum = cpu_exp_sum_scalar,
    .sumsq = sumsq_avx2,
    .norm_mul = norm_mul_avx2,
    .add = add_avx2,
    .q8_act = cpu_q8_act_avx2,
    .wq_f32 = cpu_wq_f32_avx2,
    .to_f32 = to_f32_avx2,
    .from_f32 = from_f32_avx2,
    .ssm_scan = ssm_scan_avx2,
};
