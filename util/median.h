/* median.h - the median the benchmark tools report over their rounds. */
#ifndef KVTIER_MEDIAN_H
#define KVTIER_MEDIAN_H

#include <stdlib.h>

/* qsort's comparison for doubles, ascending. */
static inline int median_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median of v[0..n), n >= 1: the mean of the middle two when n is
 * even.  Sorts v in place. */
static inline double median_sort(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, median_cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

#endif
