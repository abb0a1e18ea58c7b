/* wq_vnni.c - the quantized-weight matmul (Q8_0, Q4_K; wq_rows.h) on
 * AVX-512 VNNI, compiled with the AVX-512 and VNNI flags and only called
 * after dispatch.c found both (level avx512vnni).  vpdpbusd multiplies
 * unsigned by signed bytes and adds each four into an int32 lane in one
 * instruction, where AVX2 takes two and an int16 step.
 */
#include <immintrin.h>

static inline __attribute__((always_inline)) __m256i dot_u8s8(__m256i u, __m256i s)
{
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}

#include "backend/cpu/wq_rows.h"

void cpu_matmul_wq_vnni(const struct cpu_mm *a, int r0, int r1, float *scratch)
{
    wq_matmul(a, r0, r1, scratch);
}
