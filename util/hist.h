/* hist.h - fixed-bucket histograms of durations for /metrics (Prometheus
 * histograms).  Recording is one relaxed atomic add per bucket and one per
 * sum, no lock and no allocation, so it can sit on the per-token path; any
 * thread may read a snapshot at any time.  A snapshot's buckets are
 * cumulated from one read of the per-bucket counts, so they are monotone
 * and the +Inf bucket equals the count even while observations go on; the
 * sum may be a few observations ahead of or behind them. */
#ifndef KVTIER_UTIL_HIST_H
#define KVTIER_UTIL_HIST_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#define HIST_MAX_BOUNDS 24

struct hist {
    const double *bounds; /* upper bounds in seconds, ascending; +Inf is implied */
    int n_bounds;
    _Atomic uint64_t counts[HIST_MAX_BOUNDS + 1]; /* per bucket (not cumulative); the last is (bounds[n-1], +Inf) */
    _Atomic uint64_t sum_ns;
};

/* bounds must outlive h (a static table); n_bounds in [1, HIST_MAX_BOUNDS].
 * False, h untouched, when the bounds are not that or not ascending. */
bool hist_init(struct hist *h, const double *bounds, int n_bounds);

/* Counts one duration in seconds; a negative or NaN one (a clock read
 * out of order) counts as 0, a huge one in +Inf with its sum capped. */
void hist_observe(struct hist *h, double seconds);

struct hist_snapshot {
    int n_bounds;
    const double *bounds;
    uint64_t cum[HIST_MAX_BOUNDS + 1]; /* cum[i]: observations <= bounds[i]; cum[n_bounds]: all */
    uint64_t count;                    /* == cum[n_bounds] */
    double sum;                        /* seconds */
};
void hist_snapshot(const struct hist *h, struct hist_snapshot *out);

#endif
