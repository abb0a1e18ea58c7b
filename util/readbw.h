/* readbw.h - the memory read bandwidth ceiling that decode is judged
 * against: several threads stream a buffer far larger than the last-level
 * cache with the widest loads the CPU has, plain and non-temporal, each
 * thread as one stream or as several side by side (as a matrix-vector
 * product reads several rows at once), and the best pass counts.  A ceiling
 * that decode can beat says nothing, so every choice here leans towards the
 * higher figure.
 */
#ifndef KVTIER_READBW_H
#define KVTIER_READBW_H

#include <stddef.h>
#include <stdint.h>

enum readbw_isa { READBW_SCALAR, READBW_AVX2, READBW_AVX512, READBW_N_ISA };
enum readbw_load { READBW_PLAIN, READBW_STREAM, READBW_N_LOAD };

/* A thread reads its slice as 1 to READBW_MAX_STREAMS equal parts side by
 * side; the ceiling tries the counts in readbw_ceiling_streams. */
#define READBW_MAX_STREAMS 16

/* The read kernels: the 64-bit sum of n words at p (p 64-byte aligned, n a
 * multiple of 32), read as streams equal parts side by side, 256 bytes of
 * each in turn, then the few steps left over; the sum keeps every load
 * alive and lets a test check that all of them happened.  STREAM uses
 * non-temporal loads (vmovntdqa). */
uint64_t readbw_sum_avx2(const uint64_t *p, size_t n, int streams, enum readbw_load load);
uint64_t readbw_sum_avx512(const uint64_t *p, size_t n, int streams, enum readbw_load load);

/* The kernels' walk over p: STEP(LOAD, at) reads the 256 bytes at at;
 * per = n / 32 / streams * 32 words make a part. */
#define READBW_WALK(STEP, LOAD, p, n, per, streams)                                                 \
    for (size_t i_ = 0; i_ < (per); i_ += 32)                                                       \
        for (int s_ = 0; s_ < (streams); s_++)                                                      \
            STEP(LOAD, (p) + (size_t)s_ * (per) + i_);                                              \
    for (size_t i_ = (per) * (size_t)(streams); i_ < (n); i_ += 32)                                 \
        STEP(LOAD, (p) + i_);

typedef struct readbw readbw;

/* A buffer of at least min_bytes, and at least 8x the last-level cache,
 * filled (so every page is resident) and read by threads threads (1-256).
 * NULL when out of memory or threads is out of range. */
readbw *readbw_create(size_t min_bytes, int threads);
void readbw_free(readbw *rb);
size_t readbw_bytes(const readbw *rb);

/* The widest ISA this CPU runs, and whether it runs isa. */
enum readbw_isa readbw_best_isa(void);
int readbw_isa_ok(enum readbw_isa isa);
const char *readbw_isa_name(enum readbw_isa isa);
const char *readbw_load_name(enum readbw_load load);

/* One timed pass of every thread over the buffer with isa and load, each
 * thread reading streams parts side by side, in GB/s; 0 if isa does not run
 * here, streams is not 1-READBW_MAX_STREAMS or a thread could not start.
 * *sum (if not NULL) gets the sum of all words read. */
double readbw_pass(readbw *rb, enum readbw_isa isa, enum readbw_load load, int streams, uint64_t *sum);

/* The stream counts the ceiling tries, and how many there are. */
extern const int readbw_ceiling_streams[];
extern const int readbw_n_ceiling_streams;

/* The ceiling: passes passes of each load kind and each stream count of
 * readbw_ceiling_streams with the best ISA, the fastest pass in GB/s; the
 * load kind and stream count that gave it in *load and *streams if not
 * NULL. */
double readbw_ceiling(readbw *rb, int passes, enum readbw_load *load, int *streams);

#endif
