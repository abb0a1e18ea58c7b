/* clock.h - the one monotonic clock every timing in kvtier reads, and the
 * process's CPU time, which benchmarks report beside it: on a shared
 * machine it counts the work done, not the time other processes took. */
#ifndef KVTIER_CLOCK_H
#define KVTIER_CLOCK_H

#include <time.h>

static inline double clock_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline double clock_ms(void)
{
    return clock_s() * 1e3;
}

/* CPU seconds of every thread of the process */
static inline double clock_cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#endif
