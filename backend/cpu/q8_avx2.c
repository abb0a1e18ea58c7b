/* q8_avx2.c - the Q8_0 weight matmul for AVX2 (and the AVX-512 level,
 * which has no variant of its own yet), compiled with the AVX2 flags and
 * only called after dispatch.c checked the CPU.
 *
 * Decode (few tokens) multiplies in integers as llama.cpp does: the driver
 * rounded each activation block of 32 to int8 with an f32 scale, and a
 * weight block and an activation block make one _mm256_maddubs_epi16 (the
 * sign trick: |w| unsigned times x with w's sign) and one
 * _mm256_madd_epi16, whose eight int32 sums are scaled by both blocks'
 * scales into an f32 accumulator.  Four weight rows share each activation
 * load.  Batches of CPU_GEMM_MIN_TOKENS and more take gemm.c's panels
 * instead, with the blocks dequantized to f32: sgemm then does the
 * multiplying, of the same rounded activations (the driver's a->x).
 */
#include <immintrin.h>
#include <math.h>

#include "backend/cpu/cpu.h"
#include "util/q8.h"

static inline float hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The 32 products of a weight block w and an activation block x, as eight
 * f32 partial sums.  maddubs cannot saturate: the quantizers write codes
 * in [-127, 127], so a pair sums to at most 2 * 127 * 127 < 32767. */
static inline __attribute__((always_inline)) __m256 dot_block(__m256i w, __m256i x)
{
    __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
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
                acc[k] = _mm256_fmadd_ps(d, dot_block(_mm256_loadu_si256((const __m256i *)wb->qs), xv), acc[k]);
            }
        }
#pragma GCC unroll 4
        for (int k = 0; k < ROWS; k++)
            a->y[(size_t)t * a->out + r + k] = hsum(acc[k]);
    }
}

static void q8_0_to_f32(float *y, const void *x, enum be_dtype dt, size_t n)
{
    (void)dt;
    const struct q8_0_block *b = x;
    for (size_t i = 0; i < n / Q8_0_BLOCK; i++, y += Q8_0_BLOCK) {
        __m256 d = _mm256_set1_ps(_cvtsh_ss(b[i].d));
        for (int j = 0; j < Q8_0_BLOCK; j += 8) {
            __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b[i].qs + j)));
            _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_cvtepi32_ps(q), d));
        }
    }
}

void cpu_matmul_q8_0_avx2(const struct cpu_mm *a, int r0, int r1, float *scratch)
{
    if (a->n >= CPU_GEMM_MIN_TOKENS && a->in <= CPU_SCRATCH_FLOATS) {
        cpu_matmul_panels(a, r0, r1, scratch, q8_0_to_f32);
        return;
    }
    int r = r0;
    for (; r + 4 <= r1; r += 4)
        q8_rows(a, r, 4);
    for (; r < r1; r++)
        q8_rows(a, r, 1);
}

/* As cpu_q8_act_scalar, byte for byte: the same max, the same f32 scale and
 * its reciprocal, and the same round-to-nearest-even. */
void cpu_q8_act_avx2(struct cpu_q8_act *y, const float *x, size_t n)
{
    const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
    for (size_t b = 0; b < n / 32; b++, x += 32) {
        __m256 v[4], m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(x + 8 * j);
            __m256 av = _mm256_andnot_ps(sign, v[j]);
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(av, inf, _CMP_NLT_UQ));
            m = _mm256_max_ps(m, av);
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float amax = _mm_cvtss_f32(m4);
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        if (_mm256_movemask_ps(bad)) {
            y[b].d = NAN;
            _mm256_storeu_si256((__m256i *)y[b].qs, _mm256_setzero_si256());
            continue;
        }
        y[b].d = d;
        __m256 idv = _mm256_set1_ps(id);
        __m256i q[4];
        for (int j = 0; j < 4; j++)
            q[j] = _mm256_cvtps_epi32(
                _mm256_round_ps(_mm256_mul_ps(v[j], idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        /* the packs interleave 128-bit lanes; the permute puts the 32 codes back in order */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)y[b].qs, p);
    }
}
