/* clock.h - the one monotonic clock every timing in kvtier reads. */
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

#endif
