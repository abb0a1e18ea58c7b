/* q8_avx2.c - the quantized-weight matmul (Q8_0, Q4_K; wq_rows.h) and the
 * activation quantizer for AVX2, compiled with the AVX2 flags and only
 * called after dispatch.c checked the CPU.  The AVX-512 level without
 * VNNI runs these too.
 */
#include <immintrin.h>
#include <math.h>

/* AVX2 has no u8 x s8 dot into int32: maddubs makes int16 pair sums, madd
 * adds the pairs.  maddubs cannot saturate here: a pair is at most
 * 2 * 128 * 127 (Q8_0's |w| against an activation) < 32767. */
static inline __attribute__((always_inline)) __m256i dot_u8s8(__m256i u, __m256i s)
{
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

#include "backend/cpu/wq_rows.h"

void cpu_matmul_wq_avx2(const struct cpu_mm *a, int r0, int r1, float *scratch)
{
    wq_matmul(a, r0, r1, scratch, q4k_rows256);
}

bool cpu_wq_f32_avx2(int n, int in)
{
    return wq_panels(n, in);
}

/* As cpu_q8_act_scalar, byte for byte: the same max, the same f32 scale and
 * its reciprocal, and the same round-to-nearest-even. */
void cpu_q8_act_avx2(struct cpu_q8_act *y, int32_t *sum, const float *x, size_t n)
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
        if (isinf(id)) /* max|x| too small for its reciprocal: zero, as the scalar level */
            d = id = 0.0f;
        if (_mm256_movemask_ps(bad)) {
            y[b].d = NAN;
            _mm256_storeu_si256((__m256i *)y[b].qs, _mm256_setzero_si256());
            sum[b] = 0;
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
        /* the codes are within [-127, 127]: the packs saturated none */
        __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
        h = _mm_add_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1)));
        sum[b] = _mm_cvtsi128_si32(h);
    }
}
