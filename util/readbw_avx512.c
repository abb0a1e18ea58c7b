/* readbw_avx512.c - the AVX-512 read kernel (compiled with -mavx512f). */
#include <immintrin.h>

#include "util/readbw.h"

/* Four accumulators, one 64-byte line each: enough loads in flight that the
 * adds never limit the stream. */
#define STEP(LOAD, at)                                                                              \
    do {                                                                                            \
        const __m512i *q = (const __m512i *)(at);                                                   \
        a0 = _mm512_add_epi64(a0, LOAD(q + 0));                                                     \
        a1 = _mm512_add_epi64(a1, LOAD(q + 1));                                                     \
        a2 = _mm512_add_epi64(a2, LOAD(q + 2));                                                     \
        a3 = _mm512_add_epi64(a3, LOAD(q + 3));                                                     \
    } while (0)

#define STREAM_LOAD(q) _mm512_stream_load_si512((void *)(q))

uint64_t readbw_sum_avx512(const uint64_t *p, size_t n, int streams, enum readbw_load load)
{
    size_t per = n / 32 / (size_t)streams * 32;
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    if (load == READBW_STREAM) {
        READBW_WALK(STEP, STREAM_LOAD, p, n, per, streams)
    } else {
        READBW_WALK(STEP, _mm512_load_si512, p, n, per, streams)
    }
    return (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
}
