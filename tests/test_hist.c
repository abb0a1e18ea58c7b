/* Description: the /metrics duration histograms: which bucket a value on,
 * between and beyond the bounds lands in, the sum, rejected bound tables,
 * and snapshots taken while another thread records (cumulative, +Inf equal
 * to the count, never going back).
 */
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "util/hist.h"

static const double B[] = {0.001, 0.01, 0.1};

static void test_buckets_and_sum(void **state)
{
    (void)state;
    struct hist h;
    assert_true(hist_init(&h, B, 3));
    hist_observe(&h, 0.001);  /* on a bound: counts in it (le) */
    hist_observe(&h, 0.0005);
    hist_observe(&h, 0.005);
    hist_observe(&h, 0.1);
    hist_observe(&h, 2.5);    /* beyond the last bound: +Inf only */
    hist_observe(&h, -1);     /* a clock read out of order: 0 */
    hist_observe(&h, NAN);
    struct hist_snapshot s;
    hist_snapshot(&h, &s);
    assert_int_equal(s.n_bounds, 3);
    assert_int_equal(s.cum[0], 4);
    assert_int_equal(s.cum[1], 5);
    assert_int_equal(s.cum[2], 6);
    assert_int_equal(s.cum[3], 7);
    assert_int_equal(s.count, 7);
    assert_true(fabs(s.sum - (0.001 + 0.0005 + 0.005 + 0.1 + 2.5)) < 1e-9);
}

static void test_bad_bounds(void **state)
{
    (void)state;
    struct hist h;
    static const double down[] = {0.1, 0.01}, zero[] = {0, 1}, dup[] = {1, 1}, inf[] = {1, INFINITY};
    assert_false(hist_init(&h, down, 2));
    assert_false(hist_init(&h, zero, 2));
    assert_false(hist_init(&h, dup, 2));
    assert_false(hist_init(&h, inf, 2));
    assert_false(hist_init(&h, B, 0));
    assert_false(hist_init(&h, B, HIST_MAX_BOUNDS + 1));
    assert_false(hist_init(&h, NULL, 1));
}

#define N_OBS 200000

static void *writer(void *arg)
{
    struct hist *h = arg;
    for (int i = 0; i < N_OBS; i++)
        hist_observe(h, (double)(i % 4) * 0.004); /* 0, 0.004, 0.008, 0.012: buckets 0, 1, 1, 2 */
    return NULL;
}

static void test_snapshots_while_recording(void **state)
{
    (void)state;
    static struct hist h;
    assert_true(hist_init(&h, B, 3));
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, writer, &h), 0);
    uint64_t last = 0;
    for (int k = 0; k < 2000; k++) {
        struct hist_snapshot s;
        hist_snapshot(&h, &s);
        for (int i = 1; i <= s.n_bounds; i++)
            assert_true(s.cum[i] >= s.cum[i - 1]);
        assert_int_equal(s.cum[s.n_bounds], s.count);
        assert_true(s.count >= last);
        last = s.count;
    }
    assert_int_equal(pthread_join(t, NULL), 0);
    struct hist_snapshot s;
    hist_snapshot(&h, &s);
    assert_int_equal(s.count, N_OBS);
    assert_int_equal(s.cum[0], N_OBS / 4);
    assert_int_equal(s.cum[1], N_OBS / 4 * 3);
    assert_int_equal(s.cum[2], N_OBS);
    assert_true(fabs(s.sum - (N_OBS / 4 * (0.004 + 0.008 + 0.012))) < 1e-6);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_buckets_and_sum),
        cmocka_unit_test(test_bad_bounds),
        cmocka_unit_test(test_snapshots_while_recording),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
