/* readbw_avx2.c - the AVX2 read kernel (compiled with -mavx2). */
#include <immintrin.h>

#include "util/readbw.h"

/* Eight independent accumulators: one 64-byte line per two of them, enough
 * loads in flight that the adds never limit the stream. */
#define STEP(LOAD, at)                                                                              \
    do {                                                                                            \
        const __m256i *q = (const __m256i *)(at);                                                   \
        a0 = _mm256_add_epi64(a0, LOAD(q + 0));                                                     \
        a1 = _mm256_add_epi64(a1, LOAD(q + 1));                                                     \
        a2 = _mm256_add_epi64(a2, LOAD(q + 2));                                                     \
        a3 = _mm256_add_epi64(a3, LOAD(q + 3));                                                     \
        a4 = _mm256_add_epi64(a4, LOAD(q + 4));                                                     \
        a5 = _mm256_add_epi64(a5, LOAD(q + 5));                                                     \
        a6 = _mm256_add_epi64(a6, LOAD(q + 6));                                                     \
        a7 = _mm256_add_epi64(a7, LOAD(q + 7));                                                     \
    } while (0)

#define STREAM_LOAD(q) _mm256_stream_load_si256((__m256i *)(q))

uint64_t readbw_sum_avx2(const uint64_t *p, size_t n, int streams, enum readbw_load load)
{
    size_t per = n / 32 / (size_t)streams * 32;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    if (load == READBW_STREAM) {
        READBW_WALK(STEP, STREAM_LOAD, p, n, per, streams)
    } else {
        READBW_WALK(STEP, _mm256_load_si256, p, n, per, streams)
    }
    __m256i s = _mm256_add_epi64(_mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)),
                                 _mm256_add_epi64(_mm256_add_epi64(a4, a5), _mm256_add_epi64(a6, a7)));
    uint64_t v[4];
    _mm256_storeu_si256((__m256i *)v, s);
    return v[0] + v[1] + v[2] + v[3];
}
