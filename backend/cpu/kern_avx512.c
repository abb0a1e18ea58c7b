/* kern_avx512.c - inner loops for AVX-512 (F/BW/VL/DQ), compiled with
 * their own flags and only called after dispatch.c checked the CPU.
 *
 * Matvec (decode) is bound by reading the weights: rows are streamed once,
 * four at a time against the same x registers, bf16/f16 widened to f32 in
 * registers (bf16 is the high half of an f32), f32 FMAs, and masked loads
 * for the column tail so odd sizes need no scalar loop.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "backend/cpu/cpu.h"
#include "backend/cpu/transpose16.h"

/* 16 weights from element i of a row, as f32; lanes outside m read as 0. */
static inline __attribute__((always_inline)) __m512 load16(const void *w, enum be_dtype dt, size_t i, __mmask16 m)
{
    switch (dt) {
    case BE_BF16: {
        __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)w + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    case BE_F16: return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, (const uint16_t *)w + i));
    case BE_F32: case BE_Q8_0: case BE_Q4_K: break; /* blocks go to q8_avx2.c or wq_vnni.c, never here */
    }
    return _mm512_maskz_loadu_ps(m, (const float *)w + i);
}

static inline __mmask16 tail_mask(size_t left)
{
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

/* bf16 decode without widening shuffles: a 64-byte load of 32 weights
 * holds the even elements' f32 values in the high halves after a shift
 * and the odd ones' after a mask, so x is deinterleaved once per call
 * into xp (even x of each 32-column block, then odd) and every weight
 * costs one load, one shift or and, and one FMA. */
static void deinterleave32(float *xp, const float *x, int body)
{
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int i = 0; i < body; i += 32) {
        __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
        _mm512_store_ps(xp + i, _mm512_permutex2var_ps(a, even, b));
        _mm512_store_ps(xp + i + 16, _mm512_permutex2var_ps(a, odd, b));
    }
}

static inline __m512 bf16_dot32(__m512 acc, const uint16_t *w, const float *xp)
{
    __m512i v = _mm512_loadu_si512(w);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), _mm512_load_ps(xp), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000u))),
                           _mm512_load_ps(xp + 16), acc);
}

/* Columns [from, in) of one row against x, by masked 16-wide loads. */
static inline __m512 bf16_dot_tail(__m512 acc, const uint16_t *w, const float *x, int from, int in)
{
    for (int i = from; i < in; i += 16) {
        __mmask16 m = tail_mask((size_t)(in - i));
        acc = _mm512_fmadd_ps(load16(w, BE_BF16, (size_t)i, m), _mm512_maskz_loadu_ps(m, x + i), acc);
    }
    return acc;
}

/* bf16 rows [r0, r1) of W times tokens t0 .. t0+TN (TN <= 4) of x: each
 * 64-byte weight load feeds every token, so a batch of decode tokens
 * (continuous batching) streams W once per 4 tokens.  xp: scratch for the
 * TN deinterleaved x.  TN is a constant after inlining. */
static inline __attribute__((always_inline)) void matvec_bf16_tokens(const struct cpu_mm *a, int t0, const int TN,
                                                                     int r0, int r1, float *xp)
{
    int in = a->in, body = in / 32 * 32;
    const uint16_t *w = a->w;
    const float *x = a->x + (size_t)t0 * in;
    for (int t = 0; t < TN; t++)
        deinterleave32(xp + (size_t)t * body, x + (size_t)t * in, body);
    int r = r0;
    for (; r + 4 <= r1; r += 4) {
        const uint16_t *w0 = w + (size_t)r * in;
        __m512 acc[4][4];
#pragma GCC unroll 4
        for (int t = 0; t < TN; t++)
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++)
                acc[t][k] = _mm512_setzero_ps();
        for (int i = 0; i < body; i += 32) {
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const uint16_t *wk = w0 + (size_t)k * in + i;
                /* the next four rows, one row group ahead: a row is often a
                 * page of its own, where the hardware prefetcher starts over */
                _mm_prefetch((const char *)(wk + (size_t)4 * in), _MM_HINT_T0);
#pragma GCC unroll 4
                for (int t = 0; t < TN; t++)
                    acc[t][k] = bf16_dot32(acc[t][k], wk, xp + (size_t)t * body + i);
            }
        }
#pragma GCC unroll 4
        for (int t = 0; t < TN; t++)
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++)
                a->y[(size_t)(t0 + t) * a->out + r + k] = _mm512_reduce_add_ps(
                    bf16_dot_tail(acc[t][k], w0 + (size_t)k * in, x + (size_t)t * in, body, in));
    }
    for (; r < r1; r++) {
        const uint16_t *w0 = w + (size_t)r * in;
        for (int t = 0; t < TN; t++) {
            __m512 acc = _mm512_setzero_ps();
            for (int i = 0; i < body; i += 32)
                acc = bf16_dot32(acc, w0 + i, xp + (size_t)t * body + i);
            a->y[(size_t)(t0 + t) * a->out + r] =
                _mm512_reduce_add_ps(bf16_dot_tail(acc, w0, x + (size_t)t * in, body, in));
        }
    }
}

/* y[t0 .. t0+TN) = W[r0:r1] . x for TN <= 4 tokens at once: each weight
 * vector is widened once and feeds every token, so a batch of decode
 * tokens (continuous batching) streams W once per 4 tokens instead of once
 * per token.  TN is a constant after inlining. */
static inline __attribute__((always_inline)) void matvec_tokens(const struct cpu_mm *a, const enum be_dtype dt,
                                                                int t0, const int TN, int r0, int r1)
{
    size_t esz = be_dtype_size(dt), row = (size_t)a->in * esz;
    const float *x = a->x + (size_t)t0 * a->in;
    int r = r0;
    for (; r + 4 <= r1; r += 4) {
        const char *w0 = (const char *)a->w + (size_t)r * row;
        __m512 acc[4][4];
        #pragma GCC unroll 4
        for (int t = 0; t < TN; t++)
            #pragma GCC unroll 4
            for (int k = 0; k < 4; k++)
                acc[t][k] = _mm512_setzero_ps();
        for (int i = 0; i < a->in; i += 16) {
            __mmask16 m = tail_mask((size_t)(a->in - i));
            __m512 wv[4];
            #pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                _mm_prefetch(w0 + (k + 4) * row + (size_t)i * esz, _MM_HINT_T0); /* as in matvec_bf16_tokens */
                wv[k] = load16(w0 + k * row, dt, (size_t)i, m);
            }
            #pragma GCC unroll 4
            for (int t = 0; t < TN; t++) {
                __m512 xv = _mm512_maskz_loadu_ps(m, x + (size_t)t * a->in + i);
                #pragma GCC unroll 4
                for (int k = 0; k < 4; k++)
                    acc[t][k] = _mm512_fmadd_ps(wv[k], xv, acc[t][k]);
            }
        }
        #pragma GCC unroll 4
        for (int t = 0; t < TN; t++)
            #pragma GCC unroll 4
            for (int k = 0; k < 4; k++)
                a->y[(size_t)(t0 + t) * a->out + r + k] = _mm512_reduce_add_ps(acc[t][k]);
    }
    for (; r < r1; r++) {
        const char *w0 = (const char *)a->w + (size_t)r * row;
        __m512 acc[4];
        #pragma GCC unroll 4
        for (int t = 0; t < TN; t++)
            acc[t] = _mm512_setzero_ps();
        for (int i = 0; i < a->in; i += 16) {
            __mmask16 m = tail_mask((size_t)(a->in - i));
            __m512 wv = load16(w0, dt, (size_t)i, m);
            #pragma GCC unroll 4
            for (int t = 0; t < TN; t++)
                acc[t] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m, x + (size_t)t * a->in + i), acc[t]);
        }
        #pragma GCC unroll 4
        for (int t = 0; t < TN; t++)
            a->y[(size_t)(t0 + t) * a->out + r] = _mm512_reduce_add_ps(acc[t]);
    }
}

/* Every token of a, four at a time; dt is a constant after inlining. */
static inline __attribute__((always_inline)) void matmul_tokens(const struct cpu_mm *a, const enum be_dtype dt,
                                                                int r0, int r1)
{
    int t = 0;
    for (; t + 4 <= a->n; t += 4)
        matvec_tokens(a, dt, t, 4, r0, r1);
    switch (a->n - t) {
    case 3: matvec_tokens(a, dt, t, 3, r0, r1); break;
    case 2: matvec_tokens(a, dt, t, 2, r0, r1); break;
    case 1: matvec_tokens(a, dt, t, 1, r0, r1); break;
    }
}

static void to_f32_avx512(float *y, const void *x, enum be_dtype dt, size_t n)
{
    for (size_t i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask((size_t)(n - i));
        _mm512_mask_storeu_ps(y + i, m, load16(x, dt, i, m));
    }
}

static void matmul_rows_avx512(const struct cpu_mm *a, int r0, int r1, float *scratch)
{
    if (cpu_wq(a->wt)) { /* without VNNI, the AVX2 one runs here too */
        cpu_matmul_wq_avx2(a, r0, r1, scratch);
        return;
    }
    bool fits = a->in <= CPU_SCRATCH_FLOATS; /* a converted row or the deinterleaved x fits the scratch */
    if (fits && a->n >= CPU_GEMM_MIN_TOKENS) {
        cpu_matmul_panels(a, r0, r1, scratch, to_f32_avx512);
        return;
    }
    if (a->wt == BE_BF16 && 4 * (size_t)a->in <= CPU_SCRATCH_FLOATS) {
        int t = 0;
        for (; t + 4 <= a->n; t += 4)
            matvec_bf16_tokens(a, t, 4, r0, r1, scratch);
        switch (a->n - t) {
        case 3: matvec_bf16_tokens(a, t, 3, r0, r1, scratch); break;
        case 2: matvec_bf16_tokens(a, t, 2, r0, r1, scratch); break;
        case 1: matvec_bf16_tokens(a, t, 1, r0, r1, scratch); break;
        }
        return;
    }
    switch (a->wt) {
    case BE_BF16: matmul_tokens(a, BE_BF16, r0, r1); break;
    case BE_F16: matmul_tokens(a, BE_F16, r0, r1); break;
    case BE_F32: matmul_tokens(a, BE_F32, r0, r1); break;
    case BE_Q8_0: case BE_Q4_K: break; /* handled above */
    }
}

/* The 16 x 16 block of w (16 rows, columns c .. c + 16) transposed into
 * wt: wt[i * 16 + r] = w[r * CPU_ROWS16_COLS + c + i]. */
static inline void tile_transpose(float *wt, const float *w, int c)
{
    __m512i r[16];
    for (int j = 0; j < 16; j++)
        r[j] = _mm512_castps_si512(_mm512_load_ps(w + j * CPU_ROWS16_COLS + c));
    transpose16(r);
    for (int i = 0; i < 16; i++)
        _mm512_store_ps(wt + i * 16, _mm512_castsi512_ps(r[i]));
}

/* GN heads (a constant after inlining) against the transposed tile: each
 * head's 16 scores are n multiply-adds of its element i, broadcast, with
 * column i of the tile, one chain per score, so a score's rounding is the
 * same whichever heads or rows share the call. */
static inline __attribute__((always_inline)) void dot16_heads(float *s, size_t ss, const float *x, size_t xs,
                                                               const int GN, const float *wt, __mmask16 keep,
                                                               int n, bool add)
{
    __m512 acc[8];
#pragma GCC unroll 8
    for (int g = 0; g < GN; g++)
        acc[g] = add ? _mm512_maskz_loadu_ps(keep, s + (size_t)g * ss) : _mm512_setzero_ps();
    for (int i = 0; i < n; i++) {
        __m512 w = _mm512_load_ps(wt + i * 16);
#pragma GCC unroll 8
        for (int g = 0; g < GN; g++)
            acc[g] = _mm512_fmadd_ps(_mm512_set1_ps(x[(size_t)g * xs + (size_t)i]), w, acc[g]);
    }
#pragma GCC unroll 8
    for (int g = 0; g < GN; g++)
        _mm512_mask_storeu_ps(s + (size_t)g * ss, keep, acc[g]);
}

/* s[g * ss + r] = (add ? s[g * ss + r] : 0) + x[g] . row r of the tile, r < nr */
static void dot16(float *s, size_t ss, const float *x, size_t xs, int nq, const float *w, int nr, int n, bool add)
{
    _Alignas(64) float wt[CPU_ROWS16_COLS * 16];
    for (int c = 0; c < n; c += 16)
        tile_transpose(wt + c * 16, w, c);
    __mmask16 keep = (__mmask16)((1u << nr) - 1);
    int g = 0;
    for (; g + 8 <= nq; g += 8)
        dot16_heads(s + (size_t)g * ss, ss, x + (size_t)g * xs, xs, 8, wt, keep, n, add);
    for (; g < nq; g++)
        dot16_heads(s + (size_t)g * ss, ss, x + (size_t)g * xs, xs, 1, wt, keep, n, add);
}

/* GN heads by up to four column strips (constants after inlining): each
 * row of w feeds GN x NS accumulators held in registers over all nr rows,
 * one chain per output in the order of the rows. */
static inline __attribute__((always_inline)) void axpy16_block(float *y, size_t ys, const float *a, size_t as,
                                                                const int GN, const int NS, const float *w, int nr,
                                                                int n)
{
    __m512 acc[4][4];
    __mmask16 m[4];
#pragma GCC unroll 4
    for (int j = 0; j < NS; j++)
        m[j] = tail_mask((size_t)(n - 16 * j));
#pragma GCC unroll 4
    for (int g = 0; g < GN; g++)
#pragma GCC unroll 4
        for (int j = 0; j < NS; j++)
            acc[g][j] = _mm512_maskz_loadu_ps(m[j], y + (size_t)g * ys + 16 * j);
    for (int r = 0; r < nr; r++) {
        __m512 v[4];
#pragma GCC unroll 4
        for (int j = 0; j < NS; j++)
            v[j] = _mm512_load_ps(w + r * CPU_ROWS16_COLS + 16 * j);
#pragma GCC unroll 4
        for (int g = 0; g < GN; g++) {
            __m512 av = _mm512_set1_ps(a[(size_t)g * as + (size_t)r]);
#pragma GCC unroll 4
            for (int j = 0; j < NS; j++)
                acc[g][j] = _mm512_fmadd_ps(av, v[j], acc[g][j]);
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < GN; g++)
#pragma GCC unroll 4
        for (int j = 0; j < NS; j++)
            _mm512_mask_storeu_ps(y + (size_t)g * ys + 16 * j, m[j], acc[g][j]);
}

/* Up to 64 columns of GN heads: as many strips as the columns need. */
static inline __attribute__((always_inline)) void axpy16_strips(float *y, size_t ys, const float *a, size_t as,
                                                                 const int GN, const float *w, int nr, int n)
{
    switch ((n + 15) / 16) {
    case 4: axpy16_block(y, ys, a, as, GN, 4, w, nr, n); break;
    case 3: axpy16_block(y, ys, a, as, GN, 3, w, nr, n); break;
    case 2: axpy16_block(y, ys, a, as, GN, 2, w, nr, n); break;
    case 1: axpy16_block(y, ys, a, as, GN, 1, w, nr, n); break;
    }
}

/* y[g * ys + i] += sum over r < nr of a[g * as + r] * row r of the tile [i] */
static void axpy16(float *y, size_t ys, const float *a, size_t as, int nq, const float *w, int nr, int n)
{
    for (int c = 0; c < n; c += 64) {
        int nc = n - c < 64 ? n - c : 64, g = 0;
        for (; g + 4 <= nq; g += 4)
            axpy16_strips(y + (size_t)g * ys + c, ys, a + (size_t)g * as, as, 4, w + c, nr, nc);
        for (; g < nq; g++)
            axpy16_strips(y + (size_t)g * ys + c, ys, a + (size_t)g * as, as, 1, w + c, nr, nc);
    }
}

void cpu_tiles_avx512(bool dot, float *out, size_t os, const float *in, size_t is, int nq, cpu_widen16_fn *widen,
                      const void *src, int n, int rows)
{
    _Alignas(64) float w[16 * CPU_ROWS16_COLS];
    for (int r0 = 0; r0 < rows; r0 += 16) {
        int nr = rows - r0 < 16 ? rows - r0 : 16;
        for (int c0 = 0; c0 < n; c0 += CPU_ROWS16_COLS) {
            int nc = n - c0 < CPU_ROWS16_COLS ? n - c0 : CPU_ROWS16_COLS;
            widen(w, src, r0, nr, c0, nc);
            for (int r = nr; dot && r < 16; r++) /* dot16 transposes all 16 rows */
                memset(w + r * CPU_ROWS16_COLS, 0, (size_t)CPU_ROWS16_COLS * sizeof(float));
            if (dot)
                dot16(out + r0, (size_t)rows, in + c0, is, nq, w, nr, nc, c0 > 0);
            else
                axpy16(out + c0, os, in + r0, (size_t)rows, nq, w, nr, nc);
        }
    }
}

/* Rows of dt through pointers, V at + off. */
struct typed_rows {
    const char *const *rows;
    size_t off;
    enum be_dtype dt;
};

static void widen_typed(float *w, const void *src, int r0, int nr, int c0, int nc)
{
    const struct typed_rows *t = src;
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < nc; i += 16)
            _mm512_store_ps(w + r * CPU_ROWS16_COLS + i,
                            load16(t->rows[r0 + r] + t->off, t->dt, (size_t)(c0 + i), tail_mask((size_t)(nc - i))));
}

static void dot_avx512(float *s, const float *q, int nq, const char *const *rows, enum be_dtype dt, int n, int nrows)
{
    struct typed_rows t = {.rows = rows, .dt = dt};
    cpu_tiles_avx512(true, s, 0, q, (size_t)n, nq, widen_typed, &t, n, nrows);
}

static void axpy_avx512(float *y, const float *a, int nq, const char *const *rows, size_t off, enum be_dtype dt, int n,
                        int nrows, bool odd)
{
    (void)odd; /* one key at a time */
    struct typed_rows t = {.rows = rows, .off = off, .dt = dt};
    cpu_tiles_avx512(false, y, (size_t)n, a, 0, nq, widen_typed, &t, n, nrows);
}

static void scale_avx512(float *y, float a, int n)
{
    __m512 av = _mm512_set1_ps(a);
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask((size_t)(n - i));
        _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, y + i), av));
    }
}

static float max_avx512(const float *x, int n)
{
    __m512 m = _mm512_set1_ps(-INFINITY);
    for (int i = 0; i < n; i += 16) /* max_ps returns its second operand on a NaN: m */
        m = _mm512_max_ps(_mm512_mask_loadu_ps(m, tail_mask((size_t)(n - i)), x + i), m);
    return _mm512_reduce_max_ps(m);
}

/* exp(x) = 2^k exp(r), k = round(x log2 e), r = x - k ln 2 (ln 2 in two
 * parts so r keeps its low bits), exp(r) by Cephes expf's polynomial on
 * |r| <= ln(2)/2: within 2 ulp of expf.  Inputs below -104 give 0, as
 * expf does, and a NaN stays NaN. */
static inline __m512 exp16(__m512 x)
{
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, k);
}

static float exp_sum_avx512(float *s, float m, int n)
{
    __m512 mv = _mm512_set1_ps(m), sum = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        __mmask16 t = tail_mask((size_t)(n - i));
        __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(t, s + i), mv));
        _mm512_mask_storeu_ps(s + i, t, e);
        sum = _mm512_mask_add_ps(sum, t, sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

/* log(x) for x >= 1 (softplus16's): x = 2^e m with m in [sqrt(1/2), sqrt(2)),
 * log(m) by Cephes logf's polynomial in m - 1, e ln 2 in two parts: within
 * 2 ulp of logf. */
static inline __m512 log16(__m512 x)
{
    __m512 e = _mm512_getexp_ps(x), m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
    __mmask16 big = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356237f), _CMP_GT_OQ);
    m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5f));
    e = _mm512_mask_add_ps(e, big, e, _mm512_set1_ps(1.0f));
    __m512 r = _mm512_sub_ps(m, _mm512_set1_ps(1.0f)), r2 = _mm512_mul_ps(r, r);
    __m512 p = _mm512_set1_ps(7.0376836292e-2f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(-1.1514610310e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.1676998740e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(-1.2420140846e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.4249322787e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(-1.6668057665e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.0000714765e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(-2.4999993993e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(3.3333331174e-1f));
    __m512 y = _mm512_mul_ps(_mm512_mul_ps(p, r), r2);
    y = _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), y);
    y = _mm512_fnmadd_ps(r2, _mm512_set1_ps(0.5f), y);
    return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693359375f), _mm512_add_ps(r, y));
}

/* softplus as torch computes it: x above 20, else log1p(exp(x)), log1p(u)
 * as log(w) u / (w - 1) with w = 1 + u, which keeps the bits of a small u
 * that w rounds away (u itself where w rounds to 1); NaN stays NaN. */
static inline __m512 softplus16(__m512 x)
{
    __m512 one = _mm512_set1_ps(1.0f), u = exp16(x), w = _mm512_add_ps(one, u), d = _mm512_sub_ps(w, one);
    __m512 l = _mm512_mul_ps(log16(w), _mm512_div_ps(u, d));
    l = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_EQ_OQ), l, u);
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(20.0f), _CMP_GT_OQ), l, x);
}

/* Sixteen channels at a time, one per lane, rather than one channel's
 * state across the lanes: a row's sum over the state is then a lane's own
 * (no horizontal add per token), and softplus, D x and the SiLU gate are
 * vector ops too.  A and h move in and out of that layout once per view. */
static void ssm_scan_avx512(const struct cpu_ssm *a, size_t lo, size_t hi)
{
    const struct be_ssm_params *p = a->p;
    size_t di = (size_t)p->d_inner;
    int N = p->d_state;
    const __m512i lane = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(N));
    const __m512 one = _mm512_set1_ps(1.0f);
    for (size_t i = lo; i < hi; i += 16) {
        __mmask16 m = tail_mask(hi - i);
        __m512 h[BE_SSM_MAX_STATE], A[BE_SSM_MAX_STATE];
        for (int s = 0; s < N; s++) {
            A[s] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, lane, p->A + i * (size_t)N + s, 4);
            h[s] = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, lane, a->h_in + i * (size_t)N + s, 4);
        }
        __m512 D = _mm512_maskz_loadu_ps(m, p->D + i);
        for (int t = a->t0; t < a->t1; t++) {
            size_t r = (size_t)t * di + i;
            __m512 x = _mm512_maskz_loadu_ps(m, a->x + r), z = _mm512_maskz_loadu_ps(m, a->z + r);
            __m512 dt = softplus16(_mm512_maskz_loadu_ps(m, a->dt + r)), dtx = _mm512_mul_ps(dt, x);
            const float *B = a->B + (size_t)t * N, *C = a->C + (size_t)t * N;
            __m512 acc = _mm512_setzero_ps();
            for (int s = 0; s < N; s++) {
                h[s] = _mm512_fmadd_ps(exp16(_mm512_mul_ps(dt, A[s])), h[s],
                                       _mm512_mul_ps(dtx, _mm512_set1_ps(B[s])));
                acc = _mm512_fmadd_ps(_mm512_set1_ps(C[s]), h[s], acc);
            }
            __m512 gate = _mm512_div_ps(z, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), z))));
            _mm512_mask_storeu_ps(a->y + r, m, _mm512_mul_ps(_mm512_fmadd_ps(D, x, acc), gate));
        }
        for (int s = 0; s < N; s++)
            _mm512_mask_i32scatter_ps(a->h_out + i * (size_t)N + s, m, lane, h[s], 4);
    }
}

static float sumsq_avx512(const float *x, int n)
{
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
        __m512 v = _mm512_maskz_loadu_ps(tail_mask((size_t)(n - i)), x + i);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    return _mm512_reduce_add_ps(acc);
}

static void norm_mul_avx512(float *y, const float *x, float s, const float *w, int n)
{
    __m512 sv = _mm512_set1_ps(s);
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask((size_t)(n - i));
        __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), sv);
        _mm512_mask_storeu_ps(y + i, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + i)));
    }
}

static void add_avx512(float *y, const float *x, size_t n)
{
    for (size_t i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask((size_t)(n - i));
        __m512 v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, y + i), _mm512_maskz_loadu_ps(m, x + i));
        _mm512_mask_storeu_ps(y + i, m, v);
    }
}

/* bf16 rounding done on the integers, as half.h does, because the
 * hardware conversion (vcvtneps2bf16) flushes subnormals to zero. */
static __m256i f32_to_bf16_16(__m512 v)
{
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

static void from_f32_avx512(void *y, enum be_dtype dt, const float *x, size_t n)
{
    if (dt == BE_F32) {
        cpu_from_f32_scalar(y, dt, x, n);
        return;
    }
    uint16_t *h = y;
    for (size_t i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask((size_t)(n - i));
        __m512 v = _mm512_maskz_loadu_ps(m, x + i);
        __m256i r = dt == BE_F16 ? _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
                                 : f32_to_bf16_16(v);
        _mm256_mask_storeu_epi16(h + i, m, r);
    }
}

static void matmul_rows_avx512vnni(const struct cpu_mm *a, int r0, int r1, float *scratch)
{
    if (cpu_wq(a->wt))
        cpu_matmul_wq_vnni(a, r0, r1, scratch);
    else
        matmul_rows_avx512(a, r0, r1, scratch);
}

/* The avx512vnni level on a CPU with AVX512_BF16 too: bf16 weights go to
 * bf16_avx512.c with the tokens the driver rounded and packed (mm.xb). */
static void matmul_rows_avx512bf16(const struct cpu_mm *a, int r0, int r1, float *scratch)
{
    if (a->xb)
        cpu_matmul_bf16_avx512(a, r0, r1, scratch);
    else
        matmul_rows_avx512vnni(a, r0, r1, scratch);
}

/* A bf16 cache on the bf16 dot products; anything else widened. */
static void dot_avx512bf16(float *s, const float *q, int nq, const char *const *rows, enum be_dtype dt, int n,
                           int nrows)
{
    if (dt == BE_BF16)
        cpu_attn_dot_bf16_avx512(s, q, nq, rows, n, nrows);
    else
        dot_avx512(s, q, nq, rows, dt, n, nrows);
}

static void axpy_avx512bf16(float *y, const float *a, int nq, const char *const *rows, size_t off, enum be_dtype dt,
                            int n, int nrows, bool odd)
{
    if (dt == BE_BF16)
        cpu_attn_axpy_bf16_avx512(y, a, nq, rows, off, n, nrows, odd);
    else
        axpy_avx512(y, a, nq, rows, off, dt, n, nrows, odd);
}

/* Everything but the name, the matmul and attention's products, which
 * VNNI and BF16 change. */
#define AVX512_LOOPS                                                                                                   \
    .scale = scale_avx512,                                                                                             \
    .max = max_avx512,                                                                                                 \
    .exp_sum = exp_sum_avx512,                                                                                         \
    .sumsq = sumsq_avx512,                                                                                             \
    .norm_mul = norm_mul_avx512,                                                                                       \
    .add = add_avx512,                                                                                                 \
    .q8_act = cpu_q8_act_avx2,                                                                                         \
    .to_f32 = to_f32_avx512,                                                                                           \
    .from_f32 = from_f32_avx512,                                                                                       \
    .ssm_scan = ssm_scan_avx512

const struct cpu_kern cpu_kern_avx512 = {.name = "avx512",
                                         .matmul_rows = matmul_rows_avx512,
                                         .wq_f32 = cpu_wq_f32_avx2,
                                         .dot = dot_avx512,
                                         .axpy = axpy_avx512,
                                         AVX512_LOOPS};
const struct cpu_kern cpu_kern_avx512vnni = {.name = "avx512vnni",
                                             .matmul_rows = matmul_rows_avx512vnni,
                                             .wq_f32 = cpu_wq_f32_vnni,
                                             .dot = dot_avx512,
                                             .axpy = axpy_avx512,
                                             AVX512_LOOPS};
const struct cpu_kern cpu_kern_avx512bf16 = {.name = "avx512bf16",
                                             .matmul_rows = matmul_rows_avx512bf16,
                                             .wq_f32 = cpu_wq_f32_vnni,
                                             .dot = dot_avx512bf16,
                                             .axpy = axpy_avx512bf16,
                                             AVX512_LOOPS,
                                             .bf16_pack_act = cpu_bf16_pack_act_avx512};
