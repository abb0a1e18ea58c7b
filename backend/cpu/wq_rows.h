/* wq_rows.h - the quantized-weight matmul (Q8_0, Q4_K) of the SIMD
 * levels, written once for the AVX2 file (q8_avx2.c) and the AVX-512 VNNI
 * one (wq_vnni.c), which differ only in the integer dot product.  Each
 * includes this after defining
 *
 *     static inline __m256i dot_u8s8(__m256i u, __m256i s);
 *
 * eight int32 lanes, lane i the sum of the four products u[4i+k] * s[4i+k]
 * of unsigned and signed bytes (VNNI's vpdpbusd; AVX2's maddubs then madd).
 *
 * Decode (few tokens) multiplies in integers as llama.cpp does: the
 * driver rounded each activation block of 32 to int8 with an f32 scale.
 * Q8_0: a weight block and an activation block make one dot_u8s8 with
 * the sign trick (|w| unsigned times x with w's sign), scaled by both
 * blocks' scales into an f32 accumulator.  Q4_K: the 4-bit codes are
 * unsigned already, so each sub-block is one dot_u8s8 against its
 * activation block; the eight sub-block sums of a super-block are gathered
 * into one vector and scaled by d * sc * dx at once, and the mins by
 * dmin * m * dx * (sum of the activation codes), computed once per call
 * (q4k_acts).  Four weight rows share each activation load.  Batches of
 * CPU_GEMM_MIN_TOKENS and more take gemm.c's panels instead, with the
 * blocks dequantized to f32: sgemm multiplies the same rounded
 * activations (the driver's a->x).  The VNNI level has a blocked int8
 * GEMM of its own for batches (wq_vnni.c) and comes here for the rest.
 */
#include <immintrin.h>

#include "backend/cpu/cpu.h"
#include "util/half.h"
#include "util/q4k.h"
#include "util/q8.h"

static inline float wq_hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Lane j = the sum of v[j]'s eight lanes. */
static inline __m256i wq_sum8(const __m256i v[8])
{
    __m256i a = _mm256_hadd_epi32(v[0], v[1]), b = _mm256_hadd_epi32(v[2], v[3]);
    __m256i c = _mm256_hadd_epi32(v[4], v[5]), d = _mm256_hadd_epi32(v[6], v[7]);
    __m256i lo = _mm256_hadd_epi32(a, b), hi = _mm256_hadd_epi32(c, d); /* per 128-bit half: v0..3, v4..7 */
    return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
}

/* ---- Q8_0 ------------------------------------------------------------------- */

/* The 32 products of a weight block w and an activation block x as eight
 * f32 partial sums.  |w| fits a byte unsigned even for -128 (0x80 = 128),
 * and the activations are in [-127, 127]. */
static inline __attribute__((always_inline)) __m256 q8_dot_block(__m256i w, __m256i x)
{
    return _mm256_cvtepi32_ps(dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)));
}

/* Rows [r, r + ROWS) of W against every token; ROWS is a constant after
 * inlining, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void q8_rows(const struct cpu_mm *a, int r, const int ROWS)
{
    size_t nb = (size_t)a->in / Q8_0_BLOCK;
    const struct q8_0_block *w0 = (const struct q8_0_block *)a->w + (size_t)r * nb;
    for (int t = 0; t < a->n; t++) {
        const struct cpu_q8_act *x = a->xq + (size_t)t * nb;
        __m256 acc[4];
#pragma GCC unroll 4
        for (int k = 0; k < ROWS; k++)
            acc[k] = _mm256_setzero_ps();
        for (size_t b = 0; b < nb; b++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)x[b].qs);
#pragma GCC unroll 4
            for (int k = 0; k < ROWS; k++) {
                const struct q8_0_block *wb = w0 + (size_t)k * nb + b;
                /* the next row group, one group ahead (see kern_avx2.c) */
                _mm_prefetch((const char *)(wb + (size_t)ROWS * nb), _MM_HINT_T0);
                __m256 d = _mm256_set1_ps(_cvtsh_ss(wb->d) * x[b].d);
                acc[k] = _mm256_fmadd_ps(d, q8_dot_block(_mm256_loadu_si256((const __m256i *)wb->qs), xv), acc[k]);
            }
        }
#pragma GCC unroll 4
        for (int k = 0; k < ROWS; k++)
            a->y[(size_t)t * a->out + r + k] = wq_hsum(acc[k]);
    }
}

/* ---- Q4_K ------------------------------------------------------------------- */

/* Eight bytes (a little-endian pair of words) widened to f32 lanes. */
static inline __m256 wq_bytes8(uint32_t lo, uint32_t hi)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)((uint64_t)hi << 32 | lo))));
}

/* The activations of a call as the Q4_K loops read them: per token, its
 * in codes in one run (two sub-blocks' activation blocks are 64
 * consecutive bytes), then its in / 32 block scales dx, then the products
 * dx * (sum of the block's codes) that the mins multiply. */
struct q4k_acts {
    const int8_t *codes;
    const float *dx, *xs;
};

/* Floats of scratch the layout takes per token. */
static inline size_t q4k_acts_floats(int in)
{
    return (size_t)in / sizeof(float) + 2 * ((size_t)in / Q8_0_BLOCK);
}

/* The layout of a->n tokens of a->xq, in scratch. */
static struct q4k_acts q4k_acts_fill(const struct cpu_mm *a, float *scratch)
{
    size_t nb = (size_t)a->n * ((size_t)a->in / Q8_0_BLOCK);
    int8_t *codes = (int8_t *)scratch;
    float *dx = scratch + (size_t)a->n * (size_t)a->in / sizeof(float), *xs = dx + nb;
    for (size_t b = 0; b < nb; b++) {
        _mm256_storeu_si256((__m256i *)(codes + b * 32), _mm256_loadu_si256((const __m256i *)a->xq[b].qs));
        dx[b] = a->xq[b].d;
        xs[b] = a->xq[b].d * (float)a->xsum[b];
    }
    return (struct q4k_acts){.codes = codes, .dx = dx, .xs = xs};
}

/* Rows [r0, r1) of a Q4_K W against every token of a, whose activations x holds. */
typedef void q4k_rows_fn(const struct cpu_mm *a, const struct q4k_acts *x, int r0, int r1);

static inline __attribute__((always_inline)) void q4k_group(const struct cpu_mm *a, const struct q4k_acts *x, int r,
                                                            const int ROWS)
{
    size_t nsb = (size_t)a->in / Q4_K_BLOCK, nb = (size_t)a->in / Q8_0_BLOCK;
    const struct q4_k_block *w0 = (const struct q4_k_block *)a->w + (size_t)r * nsb;
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    for (int t = 0; t < a->n; t++) {
        const int8_t *xc = x->codes + (size_t)t * (size_t)a->in;
        const float *dx = x->dx + (size_t)t * nb, *xs = x->xs + (size_t)t * nb;
        __m256 acc[4];
#pragma GCC unroll 4
        for (int k = 0; k < ROWS; k++)
            acc[k] = _mm256_setzero_ps();
        for (size_t sb = 0; sb < nsb; sb++) {
            __m256i xv[8], p[8];
            for (int j = 0; j < 8; j++)
                xv[j] = _mm256_loadu_si256((const __m256i *)(xc + sb * Q4_K_BLOCK + 32 * (size_t)j));
            __m256 dx8 = _mm256_loadu_ps(dx + sb * 8), xs8 = _mm256_loadu_ps(xs + sb * 8);
#pragma GCC unroll 4
            for (int k = 0; k < ROWS; k++) {
                const struct q4_k_block *wb = w0 + (size_t)k * nsb + sb;
                /* the next row group's 144 bytes, one group ahead */
                const char *next = (const char *)(wb + (size_t)ROWS * nsb);
                _mm_prefetch(next, _MM_HINT_T0);
                _mm_prefetch(next + 64, _MM_HINT_T0);
                _mm_prefetch(next + 128, _MM_HINT_T0);
                for (int i = 0; i < 4; i++) {
                    __m256i q = _mm256_loadu_si256((const __m256i *)(wb->qs + 32 * i));
                    p[2 * i] = dot_u8s8(_mm256_and_si256(q, low4), xv[2 * i]);
                    p[2 * i + 1] = dot_u8s8(_mm256_and_si256(_mm256_srli_epi16(q, 4), low4), xv[2 * i + 1]);
                }
                uint32_t u[4];
                q4_k_unpack(wb->scales, u);
                __m256 step = _mm256_mul_ps(_mm256_mul_ps(wq_bytes8(u[0], u[1]), _mm256_set1_ps(_cvtsh_ss(wb->d))), dx8);
                __m256 off = _mm256_mul_ps(wq_bytes8(u[2], u[3]), _mm256_set1_ps(_cvtsh_ss(wb->dmin)));
                acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(wq_sum8(p)), step, acc[k]);
                acc[k] = _mm256_fnmadd_ps(off, xs8, acc[k]);
            }
        }
#pragma GCC unroll 4
        for (int k = 0; k < ROWS; k++)
            a->y[(size_t)t * a->out + r + k] = wq_hsum(acc[k]);
    }
}

static inline void q4k_rows256(const struct cpu_mm *a, const struct q4k_acts *x, int r0, int r1)
{
    int r = r0;
    for (; r + 4 <= r1; r += 4)
        q4k_group(a, x, r, 4);
    for (; r < r1; r++)
        q4k_group(a, x, r, 1);
}

/* Q4_K by rows, the tokens in runs whose activations fit the scratch.  A
 * row too long for even one token's (over 800 K weights, far beyond any
 * model's) takes the scalar loop. */
static void q4k_matmul(const struct cpu_mm *a, int r0, int r1, float *scratch, q4k_rows_fn *rows)
{
    size_t per = q4k_acts_floats(a->in), run = CPU_SCRATCH_FLOATS / per;
    if (!run) {
        cpu_matmul_rows_scalar(a, r0, r1, scratch);
        return;
    }
    size_t nb = (size_t)a->in / Q8_0_BLOCK;
    for (int t = 0; t < a->n; t += (int)run) {
        struct cpu_mm part = *a;
        part.n = a->n - t < (int)run ? a->n - t : (int)run;
        part.y = a->y + (size_t)t * (size_t)a->out;
        part.xq = a->xq + (size_t)t * nb;
        part.xsum = a->xsum + (size_t)t * nb;
        struct q4k_acts x = q4k_acts_fill(&part, scratch);
        rows(&part, &x, r0, r1);
    }
}

/* ---- the entry ---------------------------------------------------------------- */

/* n Q4_K weights to f32, as q4_k_dequantize (the same f32 products:
 * step * q - off, each rounded once). */
static void q4k_to_f32(float *y, const struct q4_k_block *b, size_t n)
{
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    for (size_t i = 0; i < n / Q4_K_BLOCK; i++, y += Q4_K_BLOCK) {
        uint32_t u[4];
        q4_k_unpack(b[i].scales, u);
        float d = _cvtsh_ss(b[i].d), dmin = _cvtsh_ss(b[i].dmin);
        for (int j = 0; j < 8; j++) {
            __m256 step = _mm256_set1_ps(d * (float)((u[j / 4] >> (8 * (j % 4))) & 0xff));
            __m256 off = _mm256_set1_ps(dmin * (float)((u[2 + j / 4] >> (8 * (j % 4))) & 0xff));
            __m256i q = _mm256_loadu_si256((const __m256i *)(b[i].qs + 32 * (j / 2)));
            q = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(q, 4) : q, low4);
            __m128i half[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
            for (int k = 0; k < 4; k++) {
                __m128i q8 = k % 2 ? _mm_srli_si128(half[k / 2], 8) : half[k / 2];
                __m256 v = _mm256_sub_ps(_mm256_mul_ps(step, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q8))), off);
                _mm256_storeu_ps(y + 32 * j + 8 * k, v);
            }
        }
    }
}

/* Blocks to f32 for gemm.c's panels. */
static void wq_to_f32(float *y, const void *x, enum be_dtype dt, size_t n)
{
    if (dt == BE_Q4_K) {
        q4k_to_f32(y, x, n);
        return;
    }
    const struct q8_0_block *b = x;
    for (size_t i = 0; i < n / Q8_0_BLOCK; i++, y += Q8_0_BLOCK) {
        __m256 d = _mm256_set1_ps(_cvtsh_ss(b[i].d));
        for (int j = 0; j < Q8_0_BLOCK; j += 8) {
            __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b[i].qs + j)));
            _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_cvtepi32_ps(q), d));
        }
    }
}

/* Whether wq_matmul takes gemm.c's panels (over a->x) for n tokens of in. */
static inline bool wq_panels(int n, int in)
{
    return n >= CPU_GEMM_MIN_TOKENS && in <= CPU_SCRATCH_FLOATS;
}

/* The matmul of a level whose Q4_K rows are q4k (q4k_rows256 or a wider one). */
static inline void wq_matmul(const struct cpu_mm *a, int r0, int r1, float *scratch, q4k_rows_fn *q4k)
{
    if (wq_panels(a->n, a->in)) {
        cpu_matmul_panels(a, r0, r1, scratch, wq_to_f32);
        return;
    }
    if (a->wt == BE_Q4_K) {
        q4k_matmul(a, r0, r1, scratch, q4k);
        return;
    }
    int r = r0;
    for (; r + 4 <= r1; r += 4)
        q8_rows(a, r, 4);
    for (; r < r1; r++)
        q8_rows(a, r, 1);
}
