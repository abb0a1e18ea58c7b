/* hist.c - lock-free duration histograms (hist.h). */
#include <math.h>
#include <stdbool.h>

#include "util/hist.h"

/* A sum in nanoseconds overflows uint64 after 584 years in all; one
 * observation is capped at a day so no single bad clock read gets near. */
#define HIST_CAP_S 86400.0

bool hist_init(struct hist *h, const double *bounds, int n_bounds)
{
    if (!bounds || n_bounds < 1 || n_bounds > HIST_MAX_BOUNDS)
        return false;
    for (int i = 0; i < n_bounds; i++)
        if (!(bounds[i] > 0) || !isfinite(bounds[i]) || (i && !(bounds[i] > bounds[i - 1])))
            return false;
    h->bounds = bounds;
    h->n_bounds = n_bounds;
    for (int i = 0; i <= HIST_MAX_BOUNDS; i++)
        atomic_init(&h->counts[i], 0);
    atomic_init(&h->sum_ns, 0);
    return true;
}

void hist_observe(struct hist *h, double seconds)
{
    if (!(seconds > 0)) /* negative, zero and NaN */
        seconds = 0;
    int b = 0;
    while (b < h->n_bounds && seconds > h->bounds[b]) /* Prometheus' le: a value on a bound counts in it */
        b++;
    if (seconds > HIST_CAP_S)
        seconds = HIST_CAP_S;
    atomic_fetch_add_explicit(&h->counts[b], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&h->sum_ns, (uint64_t)llround(seconds * 1e9), memory_order_relaxed);
}

void hist_snapshot(const struct hist *h, struct hist_snapshot *out)
{
    out->n_bounds = h->n_bounds;
    out->bounds = h->bounds;
    uint64_t c = 0;
    for (int i = 0; i <= h->n_bounds; i++) {
        c += atomic_load_explicit(&h->counts[i], memory_order_relaxed);
        out->cum[i] = c;
    }
    out->count = c;
    out->sum = (double)atomic_load_explicit(&h->sum_ns, memory_order_relaxed) * 1e-9;
}
