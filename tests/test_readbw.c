/* Description: the read bandwidth ceiling reads every word of its buffer
 * with every ISA this CPU runs, both load kinds and one, several or the
 * most streams per thread (the sums prove it), sizes its buffer past the
 * last-level cache, and refuses bad arguments.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <unistd.h>
#include <cmocka.h>

#include "util/readbw.h"

/* 0 + 1 + ... + (n-1), the buffer's contents, modulo 2^64 like the kernels */
static uint64_t triangle(uint64_t n)
{
    return n % 2 ? (n - 1) / 2 * n : n / 2 * (n - 1);
}

static void test_every_word_read(void **state)
{
    (void)state;
    /* 3 threads: slices that do not start on a power of two */
    readbw *rb = readbw_create(1 << 20, 3);
    assert_non_null(rb);
    size_t words = readbw_bytes(rb) / 8;
    assert_true(words % (3 * 32) == 0);
    /* each load kind with one stream and with several (3 and the most:
     * parts that leave steps over); every pass reads 8x the last-level
     * cache, so not every pairing */
    static const struct {
        enum readbw_load load;
        int streams;
    } kinds[] = {{READBW_PLAIN, 1}, {READBW_STREAM, 3}, {READBW_PLAIN, READBW_MAX_STREAMS}};
    int ran = 0;
    for (int isa = 0; isa < READBW_N_ISA; isa++)
        for (int k = 0; k < 3; k++) {
            uint64_t sum = 0;
            double g = readbw_pass(rb, (enum readbw_isa)isa, kinds[k].load, kinds[k].streams, &sum);
            if (!readbw_isa_ok((enum readbw_isa)isa)) {
                assert_true(g == 0);
                continue;
            }
            assert_true(g > 0);
            assert_int_equal(sum, triangle(words));
            ran++;
        }
    assert_true(ran >= 3); /* scalar, every kind, at least */
    assert_true(readbw_pass(rb, READBW_SCALAR, READBW_PLAIN, 0, NULL) == 0);
    assert_true(readbw_pass(rb, READBW_SCALAR, READBW_PLAIN, READBW_MAX_STREAMS + 1, NULL) == 0);
    assert_true(readbw_pass(rb, READBW_SCALAR, READBW_N_LOAD, 1, NULL) == 0);
    enum readbw_load load = READBW_N_LOAD;
    int best_streams = 0;
    assert_true(readbw_ceiling(rb, 1, &load, &best_streams) > 0);
    assert_true(load == READBW_PLAIN || load == READBW_STREAM);
    int listed = 0;
    for (int s = 0; s < readbw_n_ceiling_streams; s++)
        listed |= readbw_ceiling_streams[s] == best_streams;
    assert_true(listed);
    readbw_free(rb);
}

static void test_buffer_past_llc(void **state)
{
    (void)state;
    long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    readbw *rb = readbw_create(4096, 1);
    assert_non_null(rb);
    if (l3 > 0)
        assert_true(readbw_bytes(rb) >= 8 * (size_t)l3);
    else
        assert_true(readbw_bytes(rb) >= 4096);
    readbw_free(rb);
}

static void test_bad_arguments(void **state)
{
    (void)state;
    assert_null(readbw_create(1 << 20, 0));
    assert_null(readbw_create(1 << 20, 257));
    assert_null(readbw_create((size_t)1 << 41, 1));
    readbw_free(NULL);
    assert_int_equal(readbw_best_isa() >= READBW_SCALAR && readbw_best_isa() < READBW_N_ISA, 1);
    assert_true(readbw_isa_ok(readbw_best_isa()));
    assert_false(readbw_isa_ok(READBW_N_ISA));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_word_read),
        cmocka_unit_test(test_buffer_past_llc),
        cmocka_unit_test(test_bad_arguments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
