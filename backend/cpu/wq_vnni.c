/* wq_vnni.c - the quantized-weight matmul (Q8_0, Q4_K; wq_rows.h) on
 * AVX-512 VNNI, compiled with the AVX-512 and VNNI flags and only called
 * after dispatch.c found both (levels avx512vnni and avx512bf16).  vpdpbusd multiplies
 * unsigned by signed bytes and adds each four into an int32 lane in one
 * instruction, where AVX2 takes two and an int16 step.
 *
 * Q4_K decode has a 512-bit loop of its own: the 32 bytes of codes that
 * hold sub-blocks 2i (low nibbles) and 2i+1 (high) are broadcast to both
 * halves of a register and shifted apart, so one vpdpbusd takes both
 * sub-blocks against 64 consecutive activation codes (wq_rows.h's
 * q4k_acts: one run of codes per token).
 */
#include <immintrin.h>

static inline __attribute__((always_inline)) __m256i dot_u8s8(__m256i u, __m256i s)
{
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}

#include "backend/cpu/wq_rows.h"

static inline __attribute__((always_inline)) void q4k_group512(const struct cpu_mm *a, const struct q4k_acts *x,
                                                               int r, const int ROWS)
{
    size_t nsb = (size_t)a->in / Q4_K_BLOCK, nb = (size_t)a->in / Q8_0_BLOCK;
    const struct q4_k_block *w0 = (const struct q4_k_block *)a->w + (size_t)r * nsb;
    const __m512i low4 = _mm512_set1_epi8(0x0f), shift = _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4);
    /* lanes 0..7 take sub-block 2i's scale, 8..15 sub-block 2i+1's */
    const __m512i pick[4] = {
        _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
        _mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3),
        _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5),
        _mm512_setr_epi32(6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7),
    };
    for (int t = 0; t < a->n; t++) {
        const int8_t *xc = x->codes + (size_t)t * (size_t)a->in;
        const float *dx = x->dx + (size_t)t * nb, *xs = x->xs + (size_t)t * nb;
        __m512 acc[4];
        __m256 accm[4];
#pragma GCC unroll 4
        for (int k = 0; k < ROWS; k++) {
            acc[k] = _mm512_setzero_ps();
            accm[k] = _mm256_setzero_ps();
        }
        for (size_t sb = 0; sb < nsb; sb++) {
            __m512i xv[4];
            for (int i = 0; i < 4; i++)
                xv[i] = _mm512_loadu_si512(xc + sb * Q4_K_BLOCK + 64 * (size_t)i);
            __m256 dx8 = _mm256_loadu_ps(dx + sb * 8), xs8 = _mm256_loadu_ps(xs + sb * 8);
#pragma GCC unroll 4
            for (int k = 0; k < ROWS; k++) {
                const struct q4_k_block *wb = w0 + (size_t)k * nsb + sb;
                /* the next row group's 144 bytes, one group ahead */
                const char *next = (const char *)(wb + (size_t)ROWS * nsb);
                _mm_prefetch(next, _MM_HINT_T0);
                _mm_prefetch(next + 64, _MM_HINT_T0);
                _mm_prefetch(next + 128, _MM_HINT_T0);
                uint32_t u[4];
                q4_k_unpack(wb->scales, u);
                __m256 step = _mm256_mul_ps(_mm256_mul_ps(wq_bytes8(u[0], u[1]), _mm256_set1_ps(_cvtsh_ss(wb->d))), dx8);
                __m512 step16 = _mm512_castps256_ps512(step);
                for (int i = 0; i < 4; i++) {
                    __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(wb->qs + 32 * i)));
                    q = _mm512_and_si512(_mm512_srlv_epi64(q, shift), low4);
                    __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xv[i]);
                    acc[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(pick[i], step16), acc[k]);
                }
                __m256 off = _mm256_mul_ps(wq_bytes8(u[2], u[3]), _mm256_set1_ps(_cvtsh_ss(wb->dmin)));
                accm[k] = _mm256_fmadd_ps(off, xs8, accm[k]);
            }
        }
#pragma GCC unroll 4
        for (int k = 0; k < ROWS; k++)
            a->y[(size_t)t * a->out + r + k] = _mm512_reduce_add_ps(acc[k]) - wq_hsum(accm[k]);
    }
}

static void q4k_rows512(const struct cpu_mm *a, const struct q4k_acts *x, int r0, int r1)
{
    int r = r0;
    for (; r + 4 <= r1; r += 4)
        q4k_group512(a, x, r, 4);
    for (; r < r1; r++)
        q4k_group512(a, x, r, 1);
}

void cpu_matmul_wq_vnni(const struct cpu_mm *a, int r0, int r1, float *scratch)
{
    wq_matmul(a, r0, r1, scratch, q4k_rows512);
}
