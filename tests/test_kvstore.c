/* Description: the paged KV store - block accounting, the HF sliding-window
 * vectors of cache-semantics.md §10.1/§10.3 (storage W-1, seq_length
 * absolute), bounded memory, and transactional reserve under injected
 * device-allocation failures.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <cmocka.h>

#include "tiers/kvstore.h"

#define HEADS 2
#define HD 4
#define BT 4

struct fixture {
    be_backend *be;
    kv_store *store;
    int windows[2];
};

static int setup_with(void **state, int window, size_t budget)
{
    struct fixture *f = calloc(1, sizeof(*f));
    struct be_params p = {.n_threads = 1, .device_mem = budget};
    assert_int_equal(be_open("cpu", &p, &f->be), BE_OK);
    f->windows[0] = 0;      /* layer 0: full attention */
    f->windows[1] = window; /* layer 1: sliding */
    struct kv_geom g = {.n_layers = 2, .n_kv_heads = HEADS, .head_dim = HD, .layer_window = f->windows};
    assert_int_equal(kv_store_create(f->be, &g, BT, &f->store), TIER_OK);
    *state = f;
    return 0;
}

static int setup_w4(void **state)
{
    return setup_with(state, 4, 1 << 20);
}

static int teardown(void **state)
{
    struct fixture *f = *state;
    kv_store_free(f->store);
    be_free(f->be);
    free(f);
    return 0;
}

/* Stores each token's position as the first K element of head 0, so the
 * test can read back which positions a view really holds. */
static void write_positions(kv_seq *q, int layer, int64_t from, int64_t to)
{
    struct be_kv_view v;
    kv_seq_view(q, layer, &v);
    for (int64_t p = from; p < to; p++) {
        int64_t b = (p - v.base) / v.block_tokens, s = (p - v.base) % v.block_tokens;
        assert_true(b >= 0 && b < v.n_blocks);
        ((float *)v.blocks[b])[s * HD] = (float)p;
    }
}

static void check_positions(kv_seq *q, int layer, int64_t lo, int64_t hi)
{
    struct be_kv_view v;
    kv_seq_view(q, layer, &v);
    assert_int_equal(v.lo, lo);
    assert_int_equal(v.hi, hi);
    for (int64_t p = lo; p < hi; p++) {
        int64_t b = (p - v.base) / v.block_tokens, s = (p - v.base) % v.block_tokens;
        assert_float_equal(((float *)v.blocks[b])[s * HD], (float)p, 0);
    }
}

/* Appends n tokens to both layers the way the forward pass does. */
static enum tier_status step(kv_seq *q, int n)
{
    int64_t len = kv_seq_length(q);
    enum tier_status st = kv_seq_reserve(q, n);
    if (st != TIER_OK)
        return st;
    write_positions(q, 0, len, len + n);
    write_positions(q, 1, len, len + n);
    kv_seq_commit(q);
    return TIER_OK;
}

static void test_dynamic_append(void **state)
{
    struct fixture *f = *state;
    kv_seq *q;
    assert_int_equal(kv_seq_create(f->store, NULL, &q), TIER_OK);
    assert_int_equal(kv_seq_length(q), 0);
    assert_int_equal(step(q, 2), TIER_OK);
    assert_int_equal(step(q, 1), TIER_OK);
    assert_int_equal(kv_seq_length(q), 3); /* §10.1: [1,2] then [3] -> seq 3 */
    check_positions(q, 0, 0, 3);
    /* during the next step the view covers the 3 cached + 1 new: mask size (4, 0) */
    assert_int_equal(kv_seq_reserve(q, 1), TIER_OK);
    struct be_kv_view v;
    kv_seq_view(q, 0, &v);
    assert_int_equal(v.hi - v.lo, 4);
    assert_int_equal(v.lo, 0);
    kv_seq_abort(q);
    assert_int_equal(kv_seq_length(q), 3);
    kv_seq_free(q);
    assert_int_equal(kv_store_stats(f->store).blocks_used, 0);
}

static void test_sliding_vectors(void **state)
{
    struct fixture *f = *state;
    kv_seq *q;
    assert_int_equal(kv_seq_create(f->store, NULL, &q), TIER_OK);
    /* §10.3, W=4: prefill [1..6] attends over all 6 rows, stores [4,5,6], seq 6 */
    assert_int_equal(kv_seq_reserve(q, 6), TIER_OK);
    write_positions(q, 0, 0, 6);
    write_positions(q, 1, 0, 6);
    struct be_kv_view v;
    kv_seq_view(q, 1, &v);
    assert_int_equal(v.lo, 0);
    assert_int_equal(v.hi, 6);
    kv_seq_commit(q);
    assert_int_equal(kv_seq_length(q), 6);
    check_positions(q, 1, 3, 6);           /* positions 3..5 = tokens 4,5,6; mask offset 3 */
    check_positions(q, 0, 0, 6);           /* the full layer keeps everything */
    /* update([7]): attention sees [4,5,6,7], then stores [5,6,7] */
    assert_int_equal(kv_seq_reserve(q, 1), TIER_OK);
    write_positions(q, 1, 6, 7);
    write_positions(q, 0, 6, 7);
    check_positions(q, 1, 3, 7);
    kv_seq_commit(q);
    check_positions(q, 1, 4, 7);
    kv_seq_free(q);
}

static void test_sliding_memory_bounded(void **state)
{
    struct fixture *f = *state;
    kv_seq *q;
    assert_int_equal(kv_seq_create(f->store, NULL, &q), TIER_OK);
    size_t block_bytes = 2 * HEADS * BT * HD * sizeof(float);
    for (int i = 0; i < 200; i++) {
        assert_int_equal(step(q, 1 + i % 3), TIER_OK);
        struct be_kv_view v;
        kv_seq_view(q, 1, &v);
        /* W-1 = 3 live tokens span at most 2 blocks of 4 */
        assert_true(v.n_blocks <= 2);
        int64_t len = kv_seq_length(q);
        check_positions(q, 1, len > 3 ? len - 3 : 0, len);
    }
    struct be_kv_view full, slide;
    kv_seq_view(q, 0, &full);
    kv_seq_view(q, 1, &slide);
    assert_int_equal(kv_seq_bytes(q), (size_t)(full.n_blocks + slide.n_blocks) * block_bytes);
    kv_seq_free(q);
}

/* Every reserve that hits an injected failure leaves the sequence and the
 * store exactly as they were, and the same reserve succeeds afterwards. */
static void test_reserve_transactional(void **state)
{
    struct fixture *f = *state;
    for (uint64_t n = 1;; n++) {
        kv_seq *q;
        assert_int_equal(kv_seq_create(f->store, NULL, &q), TIER_OK);
        assert_int_equal(step(q, 5), TIER_OK);
        uint64_t used = kv_store_stats(f->store).blocks_used;
        size_t bytes = kv_seq_bytes(q);
        be_fault_dev_alloc(f->be, n, true);
        enum tier_status st = kv_seq_reserve(q, 300);
        be_fault_dev_alloc(f->be, 0, false);
        if (st == TIER_OK) {
            kv_seq_abort(q);
            kv_seq_free(q);
            assert_true(n > 1); /* the first fault point was reached */
            break;
        }
        assert_int_equal(st, TIER_ENOMEM_DEV);
        assert_int_equal(kv_seq_length(q), 5);
        assert_int_equal(kv_seq_bytes(q), bytes);
        assert_int_equal(kv_store_stats(f->store).blocks_used, used);
        check_positions(q, 0, 0, 5);
        assert_int_equal(kv_seq_reserve(q, 300), TIER_OK);
        kv_seq_commit(q);
        assert_int_equal(kv_seq_length(q), 305);
        kv_seq_free(q);
    }
}

static void test_budget_exhausted(void **state)
{
    (void)state;
    void *st;
    /* room for 3 blocks of 2*2*4*4*4 = 256 bytes */
    setup_with(&st, 0, 3 * 256);
    struct fixture *f = st;
    kv_seq *q;
    assert_int_equal(kv_seq_create(f->store, NULL, &q), TIER_OK);
    assert_int_equal(step(q, 4), TIER_OK);            /* one block per layer */
    assert_int_equal(kv_seq_reserve(q, 4), TIER_ENOMEM_DEV); /* needs 4 blocks in all */
    assert_int_equal(kv_seq_length(q), 4);
    check_positions(q, 0, 0, 4);
    kv_seq_free(q);
    teardown(&st);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_dynamic_append, setup_w4, teardown),
        cmocka_unit_test_setup_teardown(test_sliding_vectors, setup_w4, teardown),
        cmocka_unit_test_setup_teardown(test_sliding_memory_bounded, setup_w4, teardown),
        cmocka_unit_test_setup_teardown(test_reserve_transactional, setup_w4, teardown),
        cmocka_unit_test(test_budget_exhausted),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
