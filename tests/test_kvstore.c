/* Description: the paged KV store (one file over 1,000 lines: every test
 * runs on the store fixture and step helpers below) - block accounting,
 * HF's dynamic and sliding-window layers (storage W-1, seq_length
 * absolute), bounded memory, and transactional reserve under injected
 * device-allocation failures; the tiers - HF's static layers (returned vs
 * stored rows, overflow), no device allocation in a static decode loop,
 * offload residency, the move to the host tier and the host-tier budget;
 * crop, reuse and forks; the host pool's slabs (carving, coalescing, reuse,
 * release, few backend allocations); kept sequences.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "tiers/kvstore.h"
#include "tiers/kvstore_impl.h" /* the host pool and its counters */
#include "tiers/quant.h"

#define HEADS 2
#define HD 4
#define BT 4

struct fixture {
    be_backend *be;
    kv_store *store;
    int windows[2];
};

static be_backend *g_be; /* the fixture's, for put_f and get_f */

static int setup_store(void **state, int window, size_t budget, const struct kv_store_params *sp)
{
    struct fixture *f = calloc(1, sizeof(*f));
    struct be_params p = {.n_threads = 1, .device_mem = budget};
    assert_int_equal(be_open("cpu", &p, &f->be), BE_OK);
    g_be = f->be;
    f->windows[0] = 0;      /* layer 0: full attention */
    f->windows[1] = window; /* layer 1: sliding */
    struct kv_geom g = {.n_layers = 2, .n_kv_heads = HEADS, .head_dim = HD, .layer_window = f->windows};
    assert_int_equal(kv_store_open(f->be, &g, sp, &f->store), TIER_OK);
    *state = f;
    return 0;
}

static int setup_with(void **state, int window, size_t budget)
{
    return setup_store(state, window, budget, &(struct kv_store_params){.block_tokens = BT});
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

/* The blocks are device memory: the test reads and writes them through
 * the seam, as anything above it must (the strict backend faults else). */
static void put_f(void *block, size_t i, float x)
{
    assert_int_equal(be_copy(g_be, (float *)block + i, &x, sizeof(x), BE_H2D), BE_OK);
}

static float get_f(const void *block, size_t i)
{
    float x;
    assert_int_equal(be_copy(g_be, &x, (const float *)block + i, sizeof(x), BE_D2H),
                     BE_OK);
    return x;
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
        put_f(v.blocks[b], (size_t)(s * HD), (float)p);
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
        assert_float_equal(get_f(v.blocks[b], (size_t)(s * HD)), (float)p, 0);
    }
}

/* Appends n tokens to both layers the way the forward pass does; with
 * ids, tells the store their token ids (the prefix cache). */
static enum tier_status step_ids(kv_seq *q, int n, const int32_t *ids)
{
    int64_t len = kv_seq_length(q);
    enum tier_status st = kv_seq_reserve(q, n);
    if (st != TIER_OK)
        return st;
    if (ids)
        kv_seq_tokens(q, ids);
    write_positions(q, 0, len, len + n);
    write_positions(q, 1, len, len + n);
    kv_seq_commit(q);
    return TIER_OK;
}

static enum tier_status step(kv_seq *q, int n)
{
    return step_ids(q, n, NULL);
}

static void test_dynamic_append(void **state)
{
    struct fixture *f = *state;
    kv_seq *q;
    assert_int_equal(kv_seq_create(f->store, NULL, &q), TIER_OK);
    assert_int_equal(kv_seq_length(q), 0);
    assert_int_equal(step(q, 2), TIER_OK);
    assert_int_equal(step(q, 1), TIER_OK);
    assert_int_equal(kv_seq_length(q), 3); /* [1,2] then [3] -> seq 3 */
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
    /* W=4: prefill [1..6] attends over all 6 rows, stores [4,5,6], seq 6 */
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

/* kv_store_pool_warm grows the pool as far as the budget allows, in the
 * pool's own chunk sizes, without an error; sequences then take exactly
 * those blocks. */
static void test_pool_warm(void **state)
{
    (void)state;
    void *st;
    setup_with(&st, 0, 10 * 256); /* blocks of 256 bytes (above) */
    struct fixture *f = st;
    /* 64, 32 and 16 blocks do not fit the budget: a chunk of 8 does */
    assert_int_equal(kv_store_pool_warm(f->store, 256), 8 * 256);
    assert_int_equal(kv_store_pool_warm(f->store, 1 << 20), 2 * 256); /* the rest: a chunk of 2 */
    assert_int_equal(kv_store_pool_warm(f->store, 1 << 20), 0);
    assert_string_equal(kv_store_errmsg(f->store), "");
    assert_int_equal(be_mem_stats(f->be).dev_used, 10 * 256);
    kv_seq *q;
    assert_int_equal(kv_seq_create(f->store, NULL, &q), TIER_OK);
    for (int i = 0; i < 5; i++) /* 5 blocks per layer: the 10 warmed */
        assert_int_equal(step(q, 4), TIER_OK);
    assert_int_equal(kv_seq_reserve(q, 4), TIER_ENOMEM_DEV);
    check_positions(q, 0, 0, 20);
    kv_seq_free(q);
    teardown(&st);
}

static kv_seq *seq_new(struct fixture *f, enum kv_strategy st, int64_t max_cache_len)
{
    kv_seq *q;
    struct kv_seq_params p = {.strategy = st, .max_cache_len = max_cache_len};
    assert_int_equal(kv_seq_create(f->store, &p, &q), TIER_OK);
    return q;
}

/* Reserves n tokens, writes them and checks what attention is given for
 * the sliding layer (HF's "returned" rows) before committing. */
static void step_returning(kv_seq *q, int n, int64_t ret_lo)
{
    int64_t len = kv_seq_length(q);
    assert_int_equal(kv_seq_reserve(q, n), TIER_OK);
    write_positions(q, 0, len, len + n);
    write_positions(q, 1, len, len + n);
    check_positions(q, 1, ret_lo, len + n);
    kv_seq_commit(q);
}

/* StaticLayer, max_cache_len 4: [1,2] +3 -> [1,2,3,0],
 * +4 -> [1,2,3,4], +5 -> the reference's IndexError, here TIER_EFULL. */
static void test_static_full_layer(void **state)
{
    struct fixture *f = *state;
    kv_seq *q = seq_new(f, KV_STATIC, 4);
    assert_int_equal(step(q, 2), TIER_OK);
    assert_int_equal(step(q, 1), TIER_OK);
    check_positions(q, 0, 0, 3);
    assert_int_equal(step(q, 1), TIER_OK);
    check_positions(q, 0, 0, 4);
    assert_int_equal(kv_seq_reserve(q, 1), TIER_EFULL);
    assert_non_null(strstr(kv_store_errmsg(f->store), "max_cache_len 4"));
    assert_int_equal(kv_seq_length(q), 4);
    check_positions(q, 0, 0, 4);
    kv_seq_free(q);
}

/* StaticSlidingWindowLayer, W=4: the sliding layer stores W rows (not
 * W-1) and returns the last W-1 stored plus the new ones. */
static void test_static_sliding_vectors(void **state)
{
    struct fixture *f = *state;
    kv_seq *q = seq_new(f, KV_STATIC, 16);
    step_returning(q, 2, 0);
    step_returning(q, 1, 0);
    check_positions(q, 1, 0, 3); /* prefill [1,2] +3: stored [1,2,3,0] */
    step_returning(q, 1, 0);
    check_positions(q, 1, 0, 4); /* [1,2,3,4] */
    step_returning(q, 1, 1);     /* +5 returns [2,3,4,5] ... */
    check_positions(q, 1, 1, 5); /* ... and stores [2,3,4,5] */
    kv_seq_free(q);

    q = seq_new(f, KV_STATIC, 16);
    step_returning(q, 6, 0);     /* prefill [1..6] returns all six ... */
    check_positions(q, 1, 2, 6); /* ... stores [3,4,5,6] */
    step_returning(q, 3, 3);     /* n>1 when full: W-1 stored + 3 new */
    check_positions(q, 1, 5, 9);
    kv_seq_free(q);
}

/* Static hybrid, layer_types [full, sliding], W=2, max_cache_len 4. */
static void test_static_hybrid_vectors(void **state)
{
    (void)state;
    void *st;
    setup_with(&st, 2, 1 << 20);
    struct fixture *f = st;
    kv_seq *q = seq_new(f, KV_STATIC, 4);
    step_returning(q, 3, 0);     /* sliding returns [10,20,30] */
    check_positions(q, 0, 0, 3); /* full: [1,2,3,0] */
    check_positions(q, 1, 1, 3); /* sliding stores [20,30] */
    step_returning(q, 1, 2);     /* +1: sliding returns [30,50] */
    check_positions(q, 0, 0, 4); /* full: [1,2,3,5] */
    check_positions(q, 1, 2, 4); /* sliding stores [30,50] */
    assert_int_equal(kv_seq_reserve(q, 1), TIER_EFULL);
    check_positions(q, 1, 2, 4);
    kv_seq_free(q);
    teardown(&st);
}

/* Static: everything the decode loop needs exists after creation. */
static void test_static_decode_never_allocates(void **state)
{
    struct fixture *f = *state;
    kv_seq *q = seq_new(f, KV_STATIC, 200);
    uint64_t allocs = be_mem_stats(f->be).dev_allocs;
    assert_int_equal(step(q, 1), TIER_OK);
    for (int i = 0; i < 150; i++)
        assert_int_equal(step(q, 1), TIER_OK);
    assert_int_equal(be_mem_stats(f->be).dev_allocs, allocs);
    check_positions(q, 0, 0, 151);
    check_positions(q, 1, 151 - 4, 151);
    kv_seq_free(q);
    assert_int_equal(kv_store_stats(f->store).dev_bytes, 0);
}

static struct kv_seq_stats residency(struct fixture *f, enum kv_strategy st, enum kv_offload_sliding o)
{
    kv_seq *q;
    struct kv_seq_params p = {.strategy = st, .max_cache_len = 64, .offload_sliding = o};
    assert_int_equal(kv_seq_create(f->store, &p, &q), TIER_OK);
    for (int i = 0; i < 10; i++)
        assert_int_equal(step(q, 3), TIER_OK);
    check_positions(q, 0, 0, 30);
    check_positions(q, 1, 30 - (st == KV_OFFLOADED ? 3 : 4), 30);
    struct kv_seq_stats s = kv_seq_stats(q);
    kv_seq_free(q);
    return s;
}

/* Offloaded streams every layer (offload_only_non_sliding
 * False), offloaded_static keeps the sliding layer on the device (True);
 * both defaults can be overridden. */
static void test_offload_residency(void **state)
{
    struct fixture *f = *state;
    struct kv_seq_stats s = residency(f, KV_OFFLOADED, KV_OFFLOAD_SLIDING_DEFAULT);
    assert_int_equal(s.streamed_layers, 2);
    assert_int_equal(s.dev_bytes, 0);
    assert_true(s.host_bytes > 0);
    s = residency(f, KV_OFFLOADED_STATIC, KV_OFFLOAD_SLIDING_DEFAULT);
    assert_int_equal(s.streamed_layers, 1);
    assert_int_equal(s.resident_layers, 1);
    s = residency(f, KV_OFFLOADED_STATIC, KV_OFFLOAD_SLIDING_YES);
    assert_int_equal(s.streamed_layers, 2);
    s = residency(f, KV_OFFLOADED, KV_OFFLOAD_SLIDING_NO);
    assert_int_equal(s.streamed_layers, 1);
    assert_int_equal(kv_store_stats(f->store).host_bytes, 0);
}

/* Moving a dynamic sequence to the host tier keeps every position, frees
 * its device blocks and is reported. */
static void test_offload_moves_everything(void **state)
{
    struct fixture *f = *state;
    kv_seq *q = seq_new(f, KV_DYNAMIC, 0);
    assert_int_equal(step(q, 9), TIER_OK);
    assert_int_equal(step(q, 2), TIER_OK);
    assert_int_equal(kv_seq_offload(q, KV_FALLBACK_OOM), TIER_OK);
    struct kv_seq_stats s = kv_seq_stats(q);
    assert_int_equal(s.strategy, KV_OFFLOADED);
    assert_int_equal(s.requested, KV_DYNAMIC);
    assert_int_equal(s.fallback, KV_FALLBACK_OOM);
    assert_int_equal(s.dev_bytes, 0);
    assert_int_equal(kv_store_stats(f->store).blocks_used, 0);
    assert_int_equal(kv_store_stats(f->store).fallbacks, 1);
    assert_int_equal(kv_store_stats(f->store).fallbacks_oom, 1);
    check_positions(q, 0, 0, 11);
    check_positions(q, 1, 8, 11);
    for (int i = 0; i < 20; i++)
        assert_int_equal(step(q, 1 + i % 3), TIER_OK);
    assert_int_equal(kv_seq_length(q), 50);
    check_positions(q, 0, 0, 50);
    check_positions(q, 1, 47, 50);
    kv_seq_free(q);
}

/* kv_seq_reserve(q, 0): a sequence in the host tier that the step only
 * reads (an encoder-decoder model's cross-attention cache) streams through
 * the device slots with the writer's layers, its view there holding its
 * positions; nothing of it goes back, and its commit leaves it as it was.
 * Once per step; dense sequences only. */
static void test_reserve_read(void **state)
{
    struct fixture *f = *state;
    kv_seq *r = seq_new(f, KV_DYNAMIC, 0), *w = seq_new(f, KV_OFFLOADED, 0);
    assert_int_equal(step(r, 9), TIER_OK);
    assert_int_equal(kv_seq_offload(r, KV_FALLBACK_NONE), TIER_OK);
    assert_int_equal(step(w, 3), TIER_OK);
    struct kv_xfer_stats x0 = kv_store_stats(f->store).xfer;
    assert_int_equal(kv_seq_reserve(w, 2), TIER_OK);
    assert_int_equal(kv_seq_reserve(r, 0), TIER_OK);
    assert_int_equal(kv_seq_reserve(r, 0), TIER_EINVAL);
    assert_int_equal(kv_seq_reserve(r, -1), TIER_EINVAL);
    assert_int_equal(kv_store_step_begin(f->store), TIER_OK);
    for (int l = 0; l < 2; l++) {
        assert_int_equal(kv_store_layer_begin(f->store, l), BE_OK);
        struct be_kv_view v;
        kv_seq_view(r, l, &v);
        const char *slot = be_buffer_data(f->store->slot[f->store->slot_of[l]]);
        assert_true((const char *)v.blocks[0] >= slot && (const char *)v.blocks[0] < slot + f->store->slot_cap);
        check_positions(r, l, l ? 9 - 3 : 0, 9); /* the sliding layer keeps W - 1 */
        write_positions(w, l, 3, 5);
        assert_int_equal(kv_store_layer_end(f->store, l), BE_OK);
    }
    assert_int_equal(kv_store_step_end(f->store), BE_OK);
    assert_int_equal(kv_seq_commit(w), TIER_OK);
    assert_int_equal(kv_seq_commit(r), TIER_OK);
    struct kv_xfer_stats x = kv_store_stats(f->store).xfer;
    size_t bb = f->store->block_bytes;
    assert_int_equal(x.bytes_d2h - x0.bytes_d2h, 2 * 2 * bb); /* w's blocks 0 and 1 of each layer, none of r's */
    assert_true(x.bytes_h2d - x0.bytes_h2d >= (3 + 2) * bb);  /* r's blocks among them */
    assert_int_equal(kv_seq_stats(r).xfer.steps, 1);
    assert_int_equal(kv_seq_length(r), 9);
    check_positions(r, 0, 0, 9);
    check_positions(r, 1, 6, 9);
    check_positions(w, 0, 0, 5);
    /* a quantized sequence is not read this way (its kernel needs head_dim 8) */
    kv_store *qs;
    kv_seq *qz;
    struct kv_geom g = {.n_layers = 1, .n_kv_heads = 1, .head_dim = 8};
    struct kv_seq_params qp = {.strategy = KV_QUANTIZED, .quant = kv_quant_defaults(KVQ_QUANTO)};
    qp.quant.q_group_size = 8;
    assert_int_equal(kv_store_open(f->be, &g, &(struct kv_store_params){.block_tokens = BT}, &qs), TIER_OK);
    assert_int_equal(kv_seq_create(qs, &qp, &qz), TIER_OK);
    assert_int_equal(kv_seq_reserve(qz, 0), TIER_ENOTSUP);
    kv_seq_free(qz);
    kv_store_free(qs);
    kv_seq_free(r);
    kv_seq_free(w);
}

/* The host tier's budget: a refusal names it and changes nothing, and the
 * same call succeeds once memory is returned. */
static void test_host_budget(void **state)
{
    struct fixture *f = *state;
    size_t block = 2 * HEADS * BT * HD * sizeof(float);
    kv_store *s;
    struct kv_geom g = {.n_layers = 2, .n_kv_heads = HEADS, .head_dim = HD, .layer_window = f->windows};
    struct kv_store_params sp = {.block_tokens = BT, .host_mem = 8 * block};
    assert_int_equal(kv_store_open(f->be, &g, &sp, &s), TIER_OK);
    kv_seq *a, *b;
    struct kv_seq_params p = {.strategy = KV_OFFLOADED};
    assert_int_equal(kv_seq_create(s, &p, &a), TIER_OK);
    assert_int_equal(kv_seq_create(s, &p, &b), TIER_OK);
    assert_int_equal(step(a, 12), TIER_OK);
    assert_int_equal(step(b, 3), TIER_OK);
    assert_int_equal(kv_seq_reserve(b, 12), TIER_ENOMEM_HOST);
    char want[64];
    snprintf(want, sizeof(want), "host tier budget of %zu bytes exhausted: ", 8 * block);
    assert_non_null(strstr(kv_store_errmsg(s), want));
    assert_int_equal(kv_seq_length(b), 3);
    check_positions(b, 0, 0, 3);
    assert_true(kv_store_stats(s).host_bytes <= 8 * block);
    kv_seq_free(a);
    /* growing copies, so an extent briefly exists twice: 3 + 3 blocks */
    assert_int_equal(step(b, 8), TIER_OK);
    check_positions(b, 0, 0, 11);
    kv_seq_free(b);
    assert_int_equal(kv_store_stats(s).host_bytes, 0);
    kv_store_free(s);
}

/* ---- the host pool ---- */

#define HP_PIECE 1024

/* One slab of budget bytes (the budget caps it) carved into pieces. */
static void hp_carve(struct kv_hostpool *p, char **piece, int n)
{
    for (int i = 0; i < n; i++) {
        void *ptr;
        assert_int_equal(hp_alloc(p, HP_PIECE, (size_t)n * HP_PIECE, &ptr), BE_OK);
        assert_int_equal((uintptr_t)ptr % 64, 0);
        piece[i] = ptr;
    }
}

static void check_one_free_slab(const struct kv_hostpool *p, size_t size)
{
    assert_int_equal(p->n_slabs, 1);
    assert_int_equal(p->slabs[0].n_live, 0);
    assert_int_equal(p->slabs[0].n_free, 1);
    assert_int_equal(p->slabs[0].free[0].off, 0);
    assert_int_equal(p->slabs[0].free[0].len, size);
}

/* Four neighbouring extents freed in each of the 24 orders always merge
 * back into one free range, and the warm slab serves every round. */
static void test_hostpool_coalesce(void **state)
{
    struct fixture *f = *state;
    struct kv_hostpool p;
    hp_init(&p, f->be);
    for (int perm = 0; perm < 24; perm++) {
        char *piece[4];
        hp_carve(&p, piece, 4);
        for (int i = 1; i < 4; i++)
            assert_ptr_equal(piece[i], piece[i - 1] + HP_PIECE);
        int left[4] = {0, 1, 2, 3}, n = 4;
        for (int code = perm, base = 24; n > 0; n--) { /* perm in the factorial number system */
            base /= n;
            int k = code / base;
            code %= base;
            hp_free(&p, piece[left[k]], HP_PIECE);
            memmove(&left[k], &left[k + 1], (size_t)(n - k - 1) * sizeof(int));
        }
        check_one_free_slab(&p, 4 * HP_PIECE);
    }
    assert_int_equal(p.slab_allocs, 1);
    hp_release(&p);
}

/* A freed middle extent is where the next extent of its size goes. */
static void test_hostpool_reuse(void **state)
{
    struct fixture *f = *state;
    struct kv_hostpool p;
    hp_init(&p, f->be);
    char *piece[3];
    hp_carve(&p, piece, 3);
    hp_free(&p, piece[1], HP_PIECE);
    void *again;
    assert_int_equal(hp_alloc(&p, HP_PIECE, 3 * HP_PIECE, &again), BE_OK);
    assert_ptr_equal(again, piece[1]);
    assert_int_equal(p.slab_allocs, 1);
    for (int i = 0; i < 3; i++)
        hp_free(&p, piece[i], HP_PIECE);
    check_one_free_slab(&p, 3 * HP_PIECE);
    hp_release(&p);
}

/* A slab goes back to the backend when it empties, except the last one,
 * which the next extent that fits reuses; release returns it too. */
static void test_hostpool_slab_release(void **state)
{
    struct fixture *f = *state;
    size_t base = be_mem_stats(f->be).host_used;
    struct kv_hostpool p;
    hp_init(&p, f->be);
    void *a, *b, *c;
    assert_int_equal(hp_alloc(&p, 4 * HP_PIECE, 4 * HP_PIECE, &a), BE_OK);
    assert_int_equal(hp_alloc(&p, HP_PIECE, 4 * HP_PIECE, &b), BE_OK); /* the budget's slab is full */
    assert_int_equal(p.n_slabs, 2);
    size_t two = be_mem_stats(f->be).host_used;
    hp_free(&p, b, HP_PIECE);
    assert_int_equal(p.n_slabs, 1);
    size_t one = be_mem_stats(f->be).host_used;
    assert_true(one < two && one > base);
    hp_free(&p, a, 4 * HP_PIECE);
    check_one_free_slab(&p, 4 * HP_PIECE);
    assert_int_equal(be_mem_stats(f->be).host_used, one);
    assert_int_equal(hp_alloc(&p, 2 * HP_PIECE, 4 * HP_PIECE, &c), BE_OK);
    assert_ptr_equal(c, a);
    assert_int_equal(p.slab_allocs, 2);
    hp_free(&p, c, 2 * HP_PIECE);
    hp_release(&p);
    assert_int_equal(be_mem_stats(f->be).host_used, base);
}

/* Many offloaded sequences growing by doubling, in turns so that their
 * extents interleave: hundreds of extents, a handful of backend
 * allocations (one slab holds them all), and the contents survive. */
static void test_host_slabs_few(void **state)
{
    struct fixture *f = *state;
    enum { N_SEQ = 32, STEPS = 128 };
    kv_seq *q[N_SEQ];
    for (int i = 0; i < N_SEQ; i++)
        q[i] = seq_new(f, KV_OFFLOADED, 0);
    size_t base = be_mem_stats(f->be).host_used;
    for (int t = 0; t < STEPS; t++)
        for (int i = 0; i < N_SEQ; i++)
            assert_int_equal(step(q[i], 1), TIER_OK);
    /* the full layer doubles 1, 2, ..., STEPS/BT blocks: log2(32)+1 extents */
    int extents = N_SEQ * 6;
    int log2_extents = 0;
    while (1 << (log2_extents + 1) <= extents)
        log2_extents++;
    const struct kv_hostpool *p = &f->store->hp;
    assert_true(p->slab_allocs >= 1 && p->slab_allocs <= (uint64_t)log2_extents);
    assert_int_equal(be_mem_stats(f->be).host_used - base, p->slab_bytes);
    for (int i = 0; i < N_SEQ; i++) {
        check_positions(q[i], 0, 0, STEPS);
        kv_seq_free(q[i]);
    }
    assert_int_equal(kv_store_stats(f->store).host_bytes, 0);
    assert_int_equal(p->n_slabs, 1);
    assert_int_equal(p->slabs[0].n_free, 1);
}

static void test_bad_params(void **state)
{
    struct fixture *f = *state;
    kv_seq *q;
    struct kv_seq_params p = {.strategy = KV_STATIC};
    assert_int_equal(kv_seq_create(f->store, &p, &q), TIER_EINVAL);
    assert_non_null(strstr(kv_store_errmsg(f->store), "max_cache_len"));
    p = (struct kv_seq_params){.strategy = KV_OFFLOADED, .adaptive = true};
    assert_int_equal(kv_seq_create(f->store, &p, &q), TIER_EINVAL);
    p = (struct kv_seq_params){.strategy = KV_DYNAMIC, .adaptive = true, .max_cache_len = 8};
    assert_int_equal(kv_seq_create(f->store, &p, &q), TIER_EINVAL);
    assert_null(q);
}

/* Crop on the full layer (the sliding one is below its window, where it
 * behaves the same): v5.15+ crop(tokens_to_remove). */
static void test_crop_dynamic(void **state)
{
    struct fixture *f = *state;
    kv_seq *q;
    assert_int_equal(kv_seq_create(f->store, NULL, &q), TIER_OK);
    assert_int_equal(step(q, 3), TIER_OK);
    assert_int_equal(kv_seq_crop(q, -1), TIER_OK); /* [1,2,3] -> [1,2] */
    assert_int_equal(kv_seq_length(q), 2);
    check_positions(q, 0, 0, 2);
    check_positions(q, 1, 0, 2);
    assert_int_equal(kv_seq_crop(q, 0), TIER_OK); /* no-op */
    assert_int_equal(kv_seq_length(q), 2);
    assert_int_equal(step(q, 1), TIER_OK);
    assert_int_equal(kv_seq_crop(q, 2), TIER_OK); /* deprecated absolute length: keeps [1,2] */
    assert_int_equal(kv_seq_length(q), 2);
    assert_int_equal(kv_seq_crop(q, 5), TIER_OK); /* absolute length beyond: no-op */
    assert_int_equal(kv_seq_length(q), 2);
    assert_int_equal(kv_seq_crop(q, -5), TIER_OK); /* over-crop empties (no stale remainder) */
    assert_int_equal(kv_seq_length(q), 0);
    assert_int_equal(kv_store_stats(f->store).blocks_used, 0);
    /* the emptied sequence is as good as new */
    assert_int_equal(step(q, 3), TIER_OK);
    check_positions(q, 0, 0, 3);
    kv_seq_free(q);
}

/* Once the sliding layer has seen W tokens without recording, any
 * crop is refused with the reference's explanation and changes nothing. */
static void test_crop_sliding_unrecorded(void **state)
{
    struct fixture *f = *state;
    kv_seq *q;
    assert_int_equal(kv_seq_create(f->store, NULL, &q), TIER_OK);
    assert_int_equal(step(q, 6), TIER_OK);
    int64_t crops[] = {-1, 0, 2, -6};
    for (size_t i = 0; i < sizeof(crops) / sizeof(crops[0]); i++) {
        assert_int_equal(kv_seq_crop(q, crops[i]), TIER_ECONFLICT);
        assert_non_null(strstr(kv_store_errmsg(f->store), "Call `activate_past_recording` before `crop`"));
        assert_int_equal(kv_seq_length(q), 6);
        check_positions(q, 0, 0, 6);
        check_positions(q, 1, 3, 6);
    }
    kv_seq_free(q);
}

/* With past recording the sliding layer keeps every state until the
 * next crop; crop(0) shrinks to W-1, crop(-2) of 6 keeps [2,3,4], crop(+1)
 * is refused, and a crop deeper than what was recorded since the last one
 * is refused (the reference would lose states silently). */
static void test_crop_sliding_recorded(void **state)
{
    struct fixture *f = *state;
    kv_seq *q;
    assert_int_equal(kv_seq_create(f->store, NULL, &q), TIER_OK);
    assert_int_equal(kv_seq_activate_past_recording(q), TIER_OK);
    assert_int_equal(step(q, 6), TIER_OK);
    check_positions(q, 1, 0, 6); /* all 6 stored */
    assert_int_equal(kv_seq_crop(q, 1), TIER_EINVAL);
    assert_non_null(strstr(kv_store_errmsg(f->store), "negative int"));
    assert_int_equal(kv_seq_crop(q, 0), TIER_OK);
    assert_int_equal(kv_seq_length(q), 6);
    check_positions(q, 1, 3, 6); /* [4,5,6] */
    assert_int_equal(kv_seq_crop(q, -1), TIER_ECONFLICT); /* needs position 2, recorded from 3 */
    assert_int_equal(kv_seq_length(q), 6);
    check_positions(q, 1, 3, 6);
    kv_seq_free(q);

    assert_int_equal(kv_seq_create(f->store, NULL, &q), TIER_OK);
    assert_int_equal(kv_seq_activate_past_recording(q), TIER_OK);
    assert_int_equal(step(q, 6), TIER_OK);
    assert_int_equal(kv_seq_crop(q, -2), TIER_OK);
    assert_int_equal(kv_seq_length(q), 4);
    check_positions(q, 1, 1, 4); /* keys[-5:-2] = tokens [2,3,4] */
    check_positions(q, 0, 0, 4);
    /* decoding on after the rollback: recording goes on until the next crop */
    assert_int_equal(step(q, 3), TIER_OK);
    check_positions(q, 1, 1, 7);
    assert_int_equal(kv_seq_crop(q, -3), TIER_OK);
    check_positions(q, 1, 1, 4);
    kv_seq_free(q);
    assert_int_equal(kv_store_stats(f->store).blocks_used, 0);
}

/* Static strategies: crop works on full layers (the reference has no crop
 * there); past recording is refused where sliding layers have a fixed size. */
static void test_crop_static(void **state)
{
    struct fixture *f = *state;
    kv_seq *q = seq_new(f, KV_STATIC, 8);
    assert_int_equal(kv_seq_activate_past_recording(q), TIER_ENOTSUP);
    assert_int_equal(step(q, 3), TIER_OK);
    assert_int_equal(kv_seq_crop(q, -2), TIER_OK);
    check_positions(q, 0, 0, 1);
    assert_int_equal(step(q, 2), TIER_OK);
    check_positions(q, 0, 0, 3);
    kv_seq_free(q);
}

/* Out-of-range crop arguments are refused before anything changes: -n of
 * INT64_MIN overflowed into a negative length (a crash in the static ring,
 * the prefix chain and the paged tables). */
static void test_crop_out_of_range(void **state)
{
    struct fixture *f = *state;
    kv_seq *q[2] = {seq_new(f, KV_DYNAMIC, 0), seq_new(f, KV_STATIC, 8)};
    int64_t bad[] = {INT64_MIN, INT64_MIN + 1, -KV_SEQ_MAX_LEN - 1, KV_SEQ_MAX_LEN + 1, INT64_MAX};
    for (int i = 0; i < 2; i++) {
        assert_int_equal(step(q[i], 3), TIER_OK);
        for (size_t k = 0; k < sizeof(bad) / sizeof(bad[0]); k++) {
            assert_int_equal(kv_seq_crop(q[i], bad[k]), TIER_EINVAL);
            assert_non_null(strstr(kv_store_errmsg(f->store), "n must be between"));
            assert_int_equal(kv_seq_length(q[i]), 3);
            check_positions(q[i], 0, 0, 3);
        }
        assert_int_equal(kv_seq_crop(q[i], -KV_SEQ_MAX_LEN), TIER_OK); /* the bound itself: empties */
        assert_int_equal(kv_seq_length(q[i]), 0);
        assert_int_equal(step(q[i], 2), TIER_OK);
        check_positions(q[i], 0, 0, 2);
        kv_seq_free(q[i]);
    }
}

/* A session's next input: the KV is kept as far as its ids are a prefix
 * of the input, and a cache holding the whole input is cropped to n - 1 so
 * that the last token is fed again and gives logits. */
static void test_reuse(void **state)
{
    struct fixture *f = *state;
    const int32_t held[] = {7, 8, 9}, longer[] = {7, 8, 9, 10, 11}, edited[] = {7, 5, 9, 10};
    kv_seq *q;
    int64_t keep;
    assert_int_equal(kv_seq_create(f->store, NULL, &q), TIER_OK);
    assert_int_equal(step(q, 3), TIER_OK);
    assert_int_equal(kv_seq_reuse(q, held, longer, 5, &keep), TIER_OK);
    assert_int_equal(keep, 3);
    assert_int_equal(kv_seq_length(q), 3);
    assert_int_equal(kv_seq_reuse(q, held, held, 3, &keep), TIER_OK);
    assert_int_equal(keep, 2);
    assert_int_equal(kv_seq_length(q), 2);
    assert_int_equal(kv_seq_reuse(q, held, edited, 4, &keep), TIER_OK);
    assert_int_equal(keep, 1);
    check_positions(q, 0, 0, 1);
    assert_int_equal(kv_seq_reuse(q, held, held, 0, &keep), TIER_EINVAL);
    assert_int_equal(kv_seq_length(q), 1);
    kv_seq_free(q);
}

/* A sliding layer past its window without past recording cannot rewind:
 * the reuse fails as the crop does and leaves the sequence as it was. */
static void test_reuse_sliding_unrecorded(void **state)
{
    struct fixture *f = *state;
    const int32_t held[] = {1, 2, 3, 4, 5, 6}, edited[] = {1, 2, 3, 9, 9, 9, 9};
    kv_seq *q;
    int64_t keep = -1;
    assert_int_equal(kv_seq_create(f->store, NULL, &q), TIER_OK);
    assert_int_equal(step(q, 6), TIER_OK);
    assert_int_equal(kv_seq_reuse(q, held, edited, 7, &keep), TIER_ECONFLICT);
    assert_int_equal(keep, 0);
    assert_int_equal(kv_seq_length(q), 6);
    check_positions(q, 1, 3, 6);
    kv_seq_free(q);
}

/* A fork shares every block; the partly filled last block is copied by
 * whichever side writes first, the other keeps its contents; freeing in
 * either order returns everything. */
static void test_fork_cow(void **state)
{
    struct fixture *f = *state;
    for (int order = 0; order < 2; order++) {
        kv_seq *a, *b;
        assert_int_equal(kv_seq_create(f->store, NULL, &a), TIER_OK);
        assert_int_equal(step(a, 10), TIER_OK); /* layer 0: 3 blocks; layer 1: [7,10) in 1 block */
        uint64_t used = kv_store_stats(f->store).blocks_used;
        assert_int_equal(kv_seq_fork(a, &b), TIER_OK);
        assert_int_equal(kv_store_stats(f->store).blocks_used, used); /* nothing copied */
        assert_int_equal(kv_seq_length(b), 10);
        check_positions(b, 0, 0, 10);
        check_positions(b, 1, 7, 10);
        /* b writes position 10 into the shared last block: one copy per layer */
        assert_int_equal(kv_seq_reserve(b, 1), TIER_OK);
        assert_int_equal(kv_store_stats(f->store).blocks_used, used + 2);
        struct be_kv_view v;
        kv_seq_view(b, 0, &v);
        put_f(v.blocks[2], 2 * HD, 1000.0f); /* position 10 of b */
        put_f(v.blocks[2], 1 * HD, 1000.0f); /* scribble on b's copy of position 9 */
        kv_seq_commit(b);
        check_positions(a, 0, 0, 10); /* a is untouched */
        /* a writes its own position 10 in place: its block is private now;
         * its sliding layer lets go of [4,8), which b already dropped */
        assert_int_equal(step(a, 1), TIER_OK);
        assert_int_equal(kv_store_stats(f->store).blocks_used, used + 1);
        check_positions(a, 0, 0, 11);
        kv_seq_free(order ? b : a);
        kv_seq_free(order ? a : b);
        assert_int_equal(kv_store_stats(f->store).blocks_used, 0);
    }
}

/* A re-fork rebuilds an unwanted sequence as a fork in place: its blocks
 * go back, its block tables stay (nothing allocated), and it then reads
 * and writes as kv_seq_fork's child would.  A sequence with extents, or
 * none, gets a plain fork. */
static void test_refork(void **state)
{
    struct fixture *f = *state;
    kv_seq *a, *c;
    assert_int_equal(kv_seq_create(f->store, NULL, &a), TIER_OK);
    assert_int_equal(step(a, 10), TIER_OK);
    uint64_t used = kv_store_stats(f->store).blocks_used;
    assert_int_equal(kv_seq_create(f->store, NULL, &c), TIER_OK);
    assert_int_equal(step(c, 30), TIER_OK); /* a longer table than a's */
    kv_seq *was = c;
    struct kv_block **table = c->layers[0].pb;
    assert_int_equal(kv_seq_refork(a, &c), TIER_OK);
    assert_ptr_equal(c, was);
    assert_ptr_equal(c->layers[0].pb, table);
    assert_int_equal(kv_store_stats(f->store).blocks_used, used); /* c's own blocks went back, a's are shared */
    assert_int_equal(kv_seq_length(c), 10);
    check_positions(c, 0, 0, 10);
    check_positions(c, 1, 7, 10);
    /* copy on write, as a fork's: c's position 10 goes into its own block */
    assert_int_equal(kv_seq_reserve(c, 1), TIER_OK);
    struct be_kv_view v;
    kv_seq_view(c, 0, &v);
    put_f(v.blocks[2], 1 * HD, 1000.0f);
    kv_seq_commit(c);
    check_positions(a, 0, 0, 10);
    /* an offloaded sequence (extents) and no sequence get a fork of their own */
    kv_seq *o = seq_new(f, KV_OFFLOADED, 0), *none = NULL;
    assert_int_equal(step(o, 5), TIER_OK);
    assert_int_equal(kv_seq_refork(a, &o), TIER_OK);
    assert_int_equal(kv_store_stats(f->store).host_bytes, 0);
    check_positions(o, 0, 0, 10);
    kv_seq *self = a;
    assert_int_equal(kv_seq_refork(a, &self), TIER_EINVAL); /* a fork of itself: refused, a untouched */
    check_positions(a, 0, 0, 10);
    assert_int_equal(kv_seq_refork(a, &none), TIER_OK);
    check_positions(none, 1, 7, 10);
    kv_seq_free(a);
    kv_seq_free(c);
    kv_seq_free(o);
    kv_seq_free(none);
    assert_int_equal(kv_store_stats(f->store).blocks_used, 0);
}

/* A fork of an offloaded sequence copies its host extents. */
static void test_fork_offloaded(void **state)
{
    struct fixture *f = *state;
    kv_seq *a = seq_new(f, KV_OFFLOADED, 0), *b;
    assert_int_equal(step(a, 9), TIER_OK);
    size_t host = kv_store_stats(f->store).host_bytes;
    assert_int_equal(kv_seq_fork(a, &b), TIER_OK);
    assert_int_equal(kv_store_stats(f->store).host_bytes, 2 * host);
    check_positions(b, 0, 0, 9);
    check_positions(b, 1, 6, 9);
    assert_int_equal(step(b, 2), TIER_OK);
    check_positions(b, 0, 0, 11);
    check_positions(a, 0, 0, 9);
    kv_seq_free(a);
    check_positions(b, 1, 8, 11);
    kv_seq_free(b);
    assert_int_equal(kv_store_stats(f->store).host_bytes, 0);
}

/* A fork that keeps a prefix fits while the device has room for the
 * blocks it writes beside all of its parent's; a fork that would copy
 * extents never fits, nor an impossible prefix. */
static void test_fork_fits(void **state)
{
    struct fixture *f = *state;
    kv_seq *a, *big, *o = seq_new(f, KV_OFFLOADED, 0);
    assert_int_equal(kv_seq_create(f->store, NULL, &a), TIER_OK);
    assert_int_equal(step(a, 10), TIER_OK);
    assert_true(kv_seq_fork_fits(a, 10, 1));
    assert_true(kv_seq_fork_fits(a, 4, 6 * BT));
    assert_false(kv_seq_fork_fits(a, 4, (int64_t)1 << 40)); /* past any budget */
    assert_false(kv_seq_fork_fits(a, 11, 0));
    assert_false(kv_seq_fork_fits(a, -1, 0));
    assert_false(kv_seq_fork_fits(a, 4, -1));
    /* a device filled by another sequence leaves no room for the fork's blocks */
    assert_int_equal(kv_seq_create(f->store, NULL, &big), TIER_OK);
    while (step(big, BT) == TIER_OK)
        ;
    assert_false(kv_seq_fork_fits(a, 4, 6 * BT));
    kv_seq_free(big);
    assert_true(kv_seq_fork_fits(a, 4, 6 * BT));
    assert_int_equal(step(o, 9), TIER_OK);
    assert_false(kv_seq_fork_fits(o, 4, 1)); /* its fork copies the host extents */
    kv_seq_free(o);
    kv_seq_free(a);
    assert_int_equal(kv_store_stats(f->store).blocks_used, 0);
}

static int setup_prefix(void **state)
{
    return setup_store(state, 0, 1 << 20, &(struct kv_store_params){.block_tokens = BT, .prefix_cache = true});
}

static void ids_of(int32_t *ids, int n, int salt)
{
    for (int i = 0; i < n; i++)
        ids[i] = i * 7 + salt;
}

/* Full blocks are published at commit and found again by token ids: a
 * second sequence with the same prefix attaches them (never the last
 * token), equal blocks computed twice are deduplicated, the entries become
 * evictable once no sequence holds them, and a different chain (or a
 * different parent) never matches. */
static void test_prefix_match(void **state)
{
    struct fixture *f = *state;
    int32_t ids[16], other[16];
    ids_of(ids, 16, 1);
    memcpy(other, ids, sizeof(ids));
    other[5] = 999; /* differs in block 1 */
    kv_seq *a, *b, *c;
    assert_int_equal(kv_seq_create(f->store, NULL, &a), TIER_OK);
    assert_int_equal(step_ids(a, 10, ids), TIER_OK);
    assert_int_equal(kv_store_stats(f->store).prefix_entries, 2);
    assert_int_equal(step_ids(a, 2, ids + 10), TIER_OK); /* block 2 fills */
    assert_int_equal(kv_store_stats(f->store).prefix_entries, 3);
    int64_t n;
    assert_int_equal(kv_seq_create(f->store, NULL, &b), TIER_OK);
    assert_int_equal(kv_seq_match_prefix(b, ids, 12, &n), TIER_OK);
    assert_int_equal(n, 8); /* 12 would leave nothing to feed */
    assert_int_equal(kv_seq_length(b), 8);
    check_positions(b, 0, 0, 8);
    check_positions(b, 1, 0, 8);
    assert_int_equal(kv_seq_match_prefix(b, ids, 12, &n), TIER_EINVAL); /* not empty */
    uint64_t used = kv_store_stats(f->store).blocks_used;
    assert_int_equal(step_ids(b, 4, ids + 8), TIER_OK); /* recomputes block 2: deduplicated */
    assert_int_equal(kv_store_stats(f->store).blocks_used, used);
    assert_int_equal(kv_store_stats(f->store).prefix_entries, 3);
    assert_int_equal(kv_seq_create(f->store, NULL, &c), TIER_OK);
    assert_int_equal(kv_seq_match_prefix(c, other, 16, &n), TIER_OK);
    assert_int_equal(n, 4); /* block 0 only */
    kv_seq_free(c);
    assert_int_equal(kv_seq_create(f->store, NULL, &c), TIER_OK);
    assert_int_equal(kv_seq_match_prefix(c, ids + 4, 12, &n), TIER_OK);
    assert_int_equal(n, 0); /* block 1's ids at block 0: another chain */
    kv_seq_free(c);
    kv_seq_free(a);
    assert_int_equal(kv_store_stats(f->store).prefix_evictable, 0);
    kv_seq_free(b);
    assert_int_equal(kv_store_stats(f->store).prefix_evictable, 3);
    assert_int_equal(kv_store_stats(f->store).blocks_used, 6); /* 3 entries x 2 layers, cached */
    /* a crop back into published blocks republishes consistently */
    assert_int_equal(kv_seq_create(f->store, NULL, &a), TIER_OK);
    assert_int_equal(kv_seq_match_prefix(a, ids, 16, &n), TIER_OK);
    assert_int_equal(n, 12);
    assert_int_equal(kv_seq_crop(a, -6), TIER_OK);
    int32_t fresh[9];
    memcpy(fresh, ids, 6 * sizeof(int32_t));
    fresh[6] = 77;
    fresh[7] = 78;
    fresh[8] = 79;
    assert_int_equal(step_ids(a, 2, fresh + 6), TIER_OK); /* block 1 takes new ids: copied, published */
    assert_int_equal(kv_store_stats(f->store).prefix_entries, 4);
    check_positions(a, 0, 0, 8);
    kv_seq_free(a);
    assert_int_equal(kv_seq_create(f->store, NULL, &c), TIER_OK);
    assert_int_equal(kv_seq_match_prefix(c, fresh, 9, &n), TIER_OK);
    assert_int_equal(n, 8);
    check_positions(c, 0, 0, 8);
    kv_seq_free(c);
    assert_int_equal(kv_seq_create(f->store, NULL, &c), TIER_OK);
    assert_int_equal(kv_seq_match_prefix(c, ids, 9, &n), TIER_OK); /* the old block 1 is still cached */
    assert_int_equal(n, 8);
    kv_seq_free(c);
}

/* With a 1-bit hash every entry collides; lookups still compare ids and
 * parents, so only the true chains match. */
static void test_prefix_collisions(void **state)
{
    (void)state;
    void *st;
    setup_store(&st, 0, 1 << 20,
                &(struct kv_store_params){.block_tokens = BT, .prefix_cache = true, .prefix_hash_mask = 1});
    struct fixture *f = st;
    int32_t ids[4][13];
    kv_seq *q[4];
    for (int i = 0; i < 4; i++) {
        ids_of(ids[i], 13, i);
        ids[i][0] = 5; /* the same first token, different blocks */
        assert_int_equal(kv_seq_create(f->store, NULL, &q[i]), TIER_OK);
        assert_int_equal(step_ids(q[i], 13, ids[i]), TIER_OK);
        /* marks the sequence in its KV: position 0 of layer 1 holds i */
        struct be_kv_view v;
        kv_seq_view(q[i], 1, &v);
        assert_float_equal(get_f(v.blocks[0], 0), 0.0f, 0);
    }
    assert_int_equal(kv_store_stats(f->store).prefix_entries, 12);
    for (int i = 0; i < 4; i++) {
        kv_seq *c;
        int64_t n;
        assert_int_equal(kv_seq_create(f->store, NULL, &c), TIER_OK);
        assert_int_equal(kv_seq_match_prefix(c, ids[i], 13, &n), TIER_OK);
        assert_int_equal(n, 12);
        for (int l = 0; l < 2; l++) {
            struct be_kv_view mine, theirs;
            kv_seq_view(c, l, &mine);
            kv_seq_view(q[i], l, &theirs);
            for (int b = 0; b < 3; b++)
                assert_ptr_equal(mine.blocks[b], theirs.blocks[b]);
        }
        kv_seq_free(c);
    }
    for (int i = 0; i < 4; i++)
        kv_seq_free(q[i]);
    teardown(&st);
}

/* Under a tight device budget the unreferenced cached blocks are what the
 * pool gives up first, oldest chain first, tail block first. */
static void test_prefix_eviction(void **state)
{
    (void)state;
    void *st;
    /* room for 8 blocks of 256 bytes: 4 token blocks of 2 layers */
    setup_store(&st, 0, 8 * 256, &(struct kv_store_params){.block_tokens = BT, .prefix_cache = true});
    struct fixture *f = st;
    int32_t a_ids[9], b_ids[9];
    ids_of(a_ids, 9, 1);
    ids_of(b_ids, 9, 2);
    kv_seq *q;
    int64_t n;
    assert_int_equal(kv_seq_create(f->store, NULL, &q), TIER_OK);
    assert_int_equal(step_ids(q, 8, a_ids), TIER_OK); /* 2 entries */
    kv_seq_free(q);
    assert_int_equal(kv_seq_create(f->store, NULL, &q), TIER_OK);
    assert_int_equal(step_ids(q, 8, b_ids), TIER_OK); /* 2 more: the pool is full */
    kv_seq_free(q);
    assert_int_equal(kv_store_stats(f->store).prefix_entries, 4);
    assert_int_equal(kv_store_stats(f->store).prefix_evictable, 4);
    /* a new sequence needing 2 token blocks evicts a's chain (the oldest) */
    assert_int_equal(kv_seq_create(f->store, NULL, &q), TIER_OK);
    assert_int_equal(step(q, 5), TIER_OK);
    assert_int_equal(kv_store_stats(f->store).prefix_evictions, 2);
    kv_seq_free(q);
    assert_int_equal(kv_seq_create(f->store, NULL, &q), TIER_OK);
    assert_int_equal(kv_seq_match_prefix(q, a_ids, 9, &n), TIER_OK);
    assert_int_equal(n, 0);
    assert_int_equal(kv_seq_match_prefix(q, b_ids, 9, &n), TIER_OK);
    assert_int_equal(n, 8);
    /* referenced entries are never evicted: the budget error is real */
    kv_seq *r;
    assert_int_equal(kv_seq_create(f->store, NULL, &r), TIER_OK);
    assert_int_equal(kv_seq_reserve(r, 12), TIER_ENOMEM_DEV);
    assert_int_equal(kv_seq_length(q), 8);
    check_positions(q, 0, 0, 8);
    kv_seq_free(r);
    kv_seq_free(q);
    teardown(&st);
}

/* The prefix cache's own budget: unreferenced entries beyond it go least
 * recently used first as soon as they are unreferenced, referenced ones
 * never; and namespaces never see each other's blocks. */
static void test_prefix_budget_and_namespaces(void **state)
{
    struct fixture *f = *state;
    int32_t ids[4][9];
    kv_seq *q;
    int64_t n;
    for (int i = 0; i < 4; i++)
        ids_of(ids[i], 9, 10 + i);
    assert_int_equal(kv_seq_create(f->store, NULL, &q), TIER_OK);
    assert_int_equal(step_ids(q, 8, ids[0]), TIER_OK); /* 2 entries */
    kv_seq_free(q);
    size_t entry = kv_store_stats(f->store).prefix_unref_bytes / 2;
    assert_true(entry > 0);
    kv_store_set_prefix_mem(f->store, 3 * entry); /* at once down to the budget: nothing to do */
    assert_int_equal(kv_store_stats(f->store).prefix_entries, 2);
    for (int i = 1; i < 3; i++) {
        assert_int_equal(kv_seq_create(f->store, NULL, &q), TIER_OK);
        assert_int_equal(step_ids(q, 8, ids[i]), TIER_OK);
        kv_seq_free(q);
        assert_true(kv_store_stats(f->store).prefix_unref_bytes <= 3 * entry);
    }
    /* 6 entries were published, 3 fit: ids[0]'s chain went first, then
     * ids[1]'s tail (leaves first) */
    assert_int_equal(kv_store_stats(f->store).prefix_entries, 3);
    assert_int_equal(kv_store_stats(f->store).prefix_evictions, 3);
    assert_int_equal(kv_seq_create(f->store, NULL, &q), TIER_OK);
    assert_int_equal(kv_seq_match_prefix(q, ids[0], 9, &n), TIER_OK);
    assert_int_equal(n, 0);
    kv_seq_free(q);
    assert_int_equal(kv_seq_create(f->store, NULL, &q), TIER_OK);
    assert_int_equal(kv_seq_match_prefix(q, ids[2], 9, &n), TIER_OK);
    assert_int_equal(n, 8);
    /* referenced entries stay whatever the budget */
    kv_store_set_prefix_mem(f->store, 1);
    assert_int_equal(kv_store_stats(f->store).prefix_entries, 2);
    kv_seq_free(q);
    assert_int_equal(kv_store_stats(f->store).prefix_entries, 0);

    /* namespaces: a chain published in one is found only there */
    kv_store_set_prefix_mem(f->store, 0);
    struct kv_seq_params p1 = {.prefix_ns = 1}, p2 = {.prefix_ns = 2};
    assert_int_equal(kv_seq_create(f->store, &p1, &q), TIER_OK);
    assert_int_equal(step_ids(q, 8, ids[3]), TIER_OK);
    kv_seq_free(q);
    assert_int_equal(kv_seq_create(f->store, &p2, &q), TIER_OK);
    assert_int_equal(kv_seq_match_prefix(q, ids[3], 9, &n), TIER_OK);
    assert_int_equal(n, 0);
    assert_int_equal(step_ids(q, 8, ids[3]), TIER_OK); /* publishes its own copy: no dedupe across */
    assert_int_equal(kv_store_stats(f->store).prefix_entries, 4);
    kv_seq_free(q);
    assert_int_equal(kv_seq_create(f->store, &p1, &q), TIER_OK);
    assert_int_equal(kv_seq_match_prefix(q, ids[3], 9, &n), TIER_OK);
    assert_int_equal(n, 8);
    kv_seq_free(q);
}


/* ---- state-space models (tiers/state.c) ---------------------------------- */

/* A state store's sequence: its device bytes do not grow from 1k to 16k
 * tokens (only its host-tier checkpoints do), the strategies that act on
 * single tokens are refused naming why, checkpoints are taken where chunks
 * end on a multiple of the interval (and dropped with an aborted step), a
 * crop goes back to the last one at or below its target and a fork starts
 * where its parent is. */
static void test_state_store(void **state)
{
    (void)state;
    be_backend *be;
    struct be_params bp = {.n_threads = 1, .device_mem = 1 << 20};
    assert_int_equal(be_open("cpu", &bp, &be), BE_OK);
    size_t sb = be_ssm_state_bytes(32, 16, 4);
    assert_int_equal(sb, (3 + 16) * 32 * sizeof(float));
    struct kv_geom g = {.n_layers = 2, .state_bytes = sb};
    kv_store *s;
    assert_int_equal(kv_store_open(be, &g, &(struct kv_store_params){.checkpoint_interval = 256}, &s), TIER_OK);
    assert_int_equal(kv_store_state_bytes(s), 2 * 2 * sb);

    const struct kv_seq_params refused[] = {{.sink = true, .num_sink_tokens = 4, .window_length = 64},
                                            {.window_length = 64}, {.strategy = KV_QUANTIZED}};
    const char *why[] = {"sink", "sliding_window", "quantized"};
    for (int i = 0; i < 3; i++) {
        kv_seq *q = NULL;
        assert_int_equal(kv_seq_create(s, &refused[i], &q), TIER_ENOTSUP);
        assert_null(q);
        assert_non_null(strstr(kv_store_errmsg(s), why[i]));
    }

    kv_seq *q;
    assert_int_equal(kv_seq_create(s, NULL, &q), TIER_OK);
    size_t dev_1k = 0;
    /* steps of 128 tokens as the forward pass drives them: one chunk each,
     * every other one ending on a multiple of 256 */
    for (int64_t n = 0; n < 16384; n += 128) {
        assert_int_equal(kv_seq_reserve(q, 128), TIER_OK);
        kv_seq_chunk(q, n, n + 128);
        assert_int_equal(kv_store_layer_end(s, 1), BE_OK);
        assert_int_equal(kv_seq_commit(q), TIER_OK);
        if (kv_seq_length(q) == 1024)
            dev_1k = kv_seq_stats(q).dev_bytes;
    }
    assert_int_equal(kv_seq_length(q), 16384);
    assert_int_equal(dev_1k, 2 * 2 * sb);
    assert_int_equal(kv_seq_stats(q).dev_bytes, dev_1k);
    assert_int_equal(kv_seq_stats(q).host_bytes, 64 * 2 * sb); /* one checkpoint per multiple of 256 */
    /* an aborted step's checkpoint goes with it */
    assert_int_equal(kv_seq_reserve(q, 256), TIER_OK);
    kv_seq_chunk(q, 16384, 16640);
    assert_int_equal(kv_store_layer_end(s, 1), BE_OK);
    assert_int_equal(kv_seq_stats(q).host_bytes, 65 * 2 * sb);
    kv_seq_abort(q);
    assert_int_equal(kv_seq_stats(q).host_bytes, 64 * 2 * sb);

    kv_seq *c;
    assert_int_equal(kv_seq_fork(q, &c), TIER_OK);
    assert_int_equal(kv_seq_length(c), 16384);
    assert_int_equal(kv_seq_crop(c, -100), TIER_OK); /* 16284: back to 16128 */
    assert_int_equal(kv_seq_length(c), 16128);
    assert_int_equal(kv_seq_stats(c).host_bytes, 63 * 2 * sb);
    assert_int_equal(kv_seq_crop(c, 300), TIER_OK);
    assert_int_equal(kv_seq_length(c), 256);
    assert_int_equal(kv_seq_crop(c, 200), TIER_OK);
    assert_int_equal(kv_seq_length(c), 0);
    assert_int_equal(kv_seq_length(q), 16384);
    kv_seq_free(c);
    kv_seq_free(q);
    kv_store_free(s);
    be_free(be);
}

/* A fork of a state the device has no room to copy starts in the host
 * tier, counted as a fallback as kv_seq_create's is. */
static void test_state_fork_fallback(void **state)
{
    (void)state;
    size_t sb = be_ssm_state_bytes(32, 16, 4);
    be_backend *be;
    kv_store *s;
    kv_seq *q, *c;
    struct be_params bp = {.n_threads = 1, .device_mem = 6 * sb}; /* one sequence's 2 x 2 states, not two */
    assert_int_equal(be_open("cpu", &bp, &be), BE_OK);
    assert_int_equal(kv_store_open(be, &(struct kv_geom){.n_layers = 2, .state_bytes = sb},
                                   &(struct kv_store_params){0}, &s), TIER_OK);
    assert_int_equal(kv_seq_create(s, NULL, &q), TIER_OK);
    assert_int_equal(kv_seq_stats(q).fallback, KV_FALLBACK_NONE);
    assert_int_equal(kv_seq_fork(q, &c), TIER_OK);
    struct kv_seq_stats cs = kv_seq_stats(c);
    assert_int_equal(cs.strategy, KV_OFFLOADED);
    assert_int_equal(cs.fallback, KV_FALLBACK_SIZED);
    assert_int_equal(cs.dev_bytes, 0);
    assert_int_equal(kv_store_stats(s).fallbacks, 1);
    assert_int_equal(kv_store_stats(s).fallbacks_oom, 0);
    kv_seq_free(c);
    kv_seq_free(q);
    kv_store_free(s);
    be_free(be);
}

/* One step of n tokens ids[len, len + n) whose state is every byte `mark`
 * (both layers), as the forward pass would write it. */
static void prefix_step(kv_store *s, kv_seq *q, const int32_t *ids, int n, int mark)
{
    int64_t len = kv_seq_length(q);
    assert_int_equal(kv_seq_reserve(q, n), TIER_OK);
    if (ids)
        kv_seq_tokens(q, ids + len);
    kv_seq_chunk(q, len, len + n);
    for (int l = 0; l < 2; l++) {
        struct be_ssm_view v;
        kv_seq_state_view(q, l, &v);
        size_t n_state = be_ssm_state_bytes(32, 16, 4);
        unsigned char *h = malloc(n_state);
        assert_non_null(h);
        memset(h, mark, n_state);
        assert_int_equal(be_copy(g_be, v.out, h, n_state, BE_H2D), BE_OK); /* device memory: not the host's to touch */
        free(h);
    }
    assert_int_equal(kv_store_layer_end(s, 1), BE_OK);
    assert_int_equal(kv_seq_commit(q), TIER_OK);
}

/* The mark of a sequence's committed state (its next step's input). */
static int prefix_mark(kv_seq *q)
{
    struct be_ssm_view v;
    assert_int_equal(kv_seq_reserve(q, 1), TIER_OK);
    kv_seq_state_view(q, 1, &v);
    unsigned char m;
    assert_int_equal(be_copy(g_be, &m, v.in, 1, BE_D2H), BE_OK);
    kv_seq_abort(q);
    return m;
}

/* A fresh sequence matched against ids[0, n) in namespace ns: the tokens
 * it starts from and, when any, its state's mark. */
static int64_t prefix_state_match(kv_store *s, uint64_t ns, const int32_t *ids, int64_t n, int *mark)
{
    kv_seq *q;
    int64_t got = -1;
    assert_int_equal(kv_seq_create(s, &(struct kv_seq_params){.prefix_ns = ns}, &q), TIER_OK);
    assert_int_equal(kv_seq_match_prefix(q, ids, n, &got), TIER_OK);
    assert_int_equal(kv_seq_length(q), got);
    *mark = got ? prefix_mark(q) : 0;
    kv_seq_free(q);
    return got;
}

/* A 2-layer state store with checkpoints every 16 tokens on a fresh
 * CPU backend of 1 MiB (g_be, which prefix_step and prefix_mark copy
 * through); p adds to those settings. */
static kv_store *open_state_store(struct kv_store_params p, be_backend **be)
{
    assert_int_equal(be_open("cpu", &(struct be_params){.n_threads = 1, .device_mem = 1 << 20}, be), BE_OK);
    g_be = *be;
    p.checkpoint_interval = 16;
    kv_store *s;
    assert_int_equal(kv_store_open(*be, &(struct kv_geom){.n_layers = 2, .state_bytes = be_ssm_state_bytes(32, 16, 4)},
                                   &p, &s),
                     TIER_OK);
    return s;
}

/* Shared checkpoints of a state store: a fresh sequence starts from the
 * deepest one whose namespace and ids equal its prompt's (the hash masked
 * to one bit: every lookup collides, the ids decide), never at its last
 * token; a crop and new ids publish another chain; a step without ids
 * stops publishing; the LRU one goes first within the budget. */
static void test_state_prefix(void **state)
{
    (void)state;
    be_backend *be;
    size_t seq = 2 * be_ssm_state_bytes(32, 16, 4);
    kv_store *s = open_state_store((struct kv_store_params){.prefix_cache = true, .prefix_hash_mask = 1}, &be);
    int32_t a[64], b[64];
    for (int i = 0; i < 64; i++)
        a[i] = b[i] = 100 + i;
    for (int i = 20; i < 64; i++)
        b[i] = 900 + i; /* b shares a's first 20 tokens */
    kv_seq *q;
    assert_int_equal(kv_seq_create(s, &(struct kv_seq_params){.prefix_ns = 7}, &q), TIER_OK);
    for (int k = 1; k <= 3; k++) /* checkpoints at 16, 32, 48 marked 1, 2, 3 */
        prefix_step(s, q, a, 16, k);
    int mark;
    int32_t a2[64];
    memcpy(a2, a, sizeof a2);
    a2[40] = 5;
    assert_int_equal(prefix_state_match(s, 7, a2, 45, &mark), 32); /* 40 shared: the checkpoint at 32 */
    assert_int_equal(mark, 2);
    assert_int_equal(prefix_state_match(s, 7, a, 48, &mark), 32); /* never the last token */
    assert_int_equal(prefix_state_match(s, 7, a, 49, &mark), 48);
    assert_int_equal(mark, 3);
    assert_int_equal(prefix_state_match(s, 8, a, 49, &mark), 0); /* another namespace */
    a2[3] = 5;
    assert_int_equal(prefix_state_match(s, 7, a2, 49, &mark), 0);
    assert_int_equal(kv_store_stats(s).prefix_hit_tokens, 32 + 32 + 48);

    /* a fork cropped to 20 (back to 16) goes on with b's ids: a second chain */
    kv_seq *c;
    assert_int_equal(kv_seq_fork(q, &c), TIER_OK);
    assert_int_equal(kv_seq_crop(c, 20), TIER_OK);
    assert_int_equal(kv_seq_length(c), 16);
    prefix_step(s, c, b, 16, 9);
    assert_int_equal(prefix_state_match(s, 7, b, 40, &mark), 32);
    assert_int_equal(mark, 9);
    assert_int_equal(prefix_state_match(s, 7, a, 40, &mark), 32);
    assert_int_equal(mark, 2);
    /* a step without ids: nothing published from here */
    prefix_step(s, c, NULL, 16, 10);
    assert_int_equal(prefix_state_match(s, 7, b, 60, &mark), 32);
    kv_seq_free(c);
    kv_seq_free(q);

    /* oldest first: 16, 48, 32 (a), 32 (b, just used); a budget of two
     * evicts 16 and 48 */
    uint64_t ev = kv_store_stats(s).prefix_evictions;
    assert_int_equal(kv_store_stats(s).prefix_entries, 4);
    kv_store_set_prefix_mem(s, 2 * seq);
    assert_int_equal(kv_store_stats(s).prefix_evictions, ev + 2);
    assert_int_equal(kv_store_stats(s).prefix_entries, 2);
    assert_int_equal(kv_store_stats(s).prefix_unref_bytes, 2 * seq);
    assert_int_equal(prefix_state_match(s, 7, a, 20, &mark), 0);
    assert_int_equal(prefix_state_match(s, 7, a, 60, &mark), 32); /* the deepest left, past a missing shallower one */
    assert_int_equal(mark, 2);
    assert_int_equal(prefix_state_match(s, 7, b, 60, &mark), 32);
    assert_int_equal(mark, 9);
    kv_store_free(s);
    be_free(be);
}

/* A full host tier evicts shared checkpoints, least recently used first,
 * for a sequence's own memory; a match with no room for the sequence's
 * own checkpoint still starts from the shared one. */
static void test_state_prefix_host(void **state)
{
    (void)state;
    be_backend *be;
    size_t seq = 2 * be_ssm_state_bytes(32, 16, 4);
    kv_store *s = open_state_store((struct kv_store_params){.prefix_cache = true, .host_mem = 4 * seq}, &be);
    int32_t a[40];
    for (int i = 0; i < 40; i++)
        a[i] = 100 + i;
    kv_seq *q, *o;
    assert_int_equal(kv_seq_create(s, NULL, &q), TIER_OK);
    prefix_step(s, q, a, 16, 1);
    prefix_step(s, q, a, 16, 2); /* its checkpoints and the shared ones fill the host tier */
    assert_int_equal(kv_store_stats(s).prefix_entries, 2);
    assert_int_equal(kv_store_stats(s).host_bytes, 4 * seq);
    assert_int_equal(kv_seq_create(s, &(struct kv_seq_params){.strategy = KV_OFFLOADED}, &o), TIER_OK);
    assert_int_equal(kv_store_stats(s).prefix_entries, 1);
    int mark;
    assert_int_equal(prefix_state_match(s, 0, a, 20, &mark), 0); /* the one at 16 went */
    assert_int_equal(prefix_state_match(s, 0, a, 40, &mark), 32);
    assert_int_equal(mark, 2);
    kv_seq_free(o);
    kv_seq_free(q);
    kv_store_free(s);
    be_free(be);
}

/* One chunk [at, at + n) of a step, as the forward pass drives it: each of
 * the n_layers layers' state, read after kv_store_layer_begin, must hold
 * `in` + layer in every float (in < 0: not checked); the chunk writes
 * v + layer into it (through the backend: the strict one faults on host
 * access). */
static void state_chunk(be_backend *be, kv_store *s, kv_seq *q, int n_layers, int64_t at, int64_t n, float in,
                        float v, size_t sb)
{
    kv_seq_chunk(q, at, at + n);
    float *h = malloc(sb);
    assert_non_null(h);
    for (int l = 0; l < n_layers; l++) {
        struct be_ssm_view w;
        assert_int_equal(kv_store_layer_begin(s, l), BE_OK);
        kv_seq_state_view(q, l, &w);
        assert_int_equal(be_copy(be, h, w.in, sb, BE_D2H), BE_OK);
        if (in >= 0)
            for (size_t i = 0; i < sb / sizeof(float); i++)
                assert_true(h[i] == in + (float)l);
        for (size_t i = 0; i < sb / sizeof(float); i++)
            h[i] = v + (float)l;
        assert_int_equal(be_copy(be, w.out, h, sb, BE_H2D), BE_OK);
        assert_int_equal(kv_store_layer_end(s, l), BE_OK);
    }
    free(h);
}

/* A step of n tokens (one chunk) that writes v + layer into every float
 * of the 2-layer state. */
static void state_step(be_backend *be, kv_store *s, kv_seq *q, int64_t n, float v, size_t sb)
{
    int64_t at = kv_seq_length(q);
    assert_int_equal(kv_seq_reserve(q, n), TIER_OK);
    assert_int_equal(kv_store_step_begin(s), TIER_OK);
    state_chunk(be, s, q, 2, at, n, -1, v, sb);
    assert_int_equal(kv_store_step_end(s), BE_OK);
    assert_int_equal(kv_seq_commit(q), TIER_OK);
}

/* The host tier of a state: an offloaded sequence starts there; with the
 * device full, a new one falls back there.  Its steps stream it layer by
 * layer through the two device slots, one layer's state each (the step
 * fails while another state leaves no room for them, until kv_seq_offload
 * moves that one out): each layer is copied in as the committed state in
 * a step's first chunk and as the chunk before left it in a later one,
 * written back to a second host copy, checkpointed where a chunk ends on
 * a multiple of the interval, and the commit makes it the state while an
 * abort leaves the old one. */
static void test_state_host_tier(void **state)
{
    (void)state;
    enum { L = 4 };
    size_t sb = be_ssm_state_bytes(32, 16, 4), seq = L * sb;
    be_backend *be;
    /* one sequence's two device copies and one more layer's state: the
     * two slots of a streamed one fit only once it has gone */
    struct be_params bp = {.n_threads = 1, .device_mem = 2 * seq + sb};
    assert_int_equal(be_open("cpu", &bp, &be), BE_OK);
    kv_store *s;
    assert_int_equal(kv_store_open(be, &(struct kv_geom){.n_layers = L, .state_bytes = sb},
                                   &(struct kv_store_params){.checkpoint_interval = 16}, &s),
                     TIER_OK);

    kv_seq *off;
    assert_int_equal(kv_seq_create(s, &(struct kv_seq_params){.strategy = KV_OFFLOADED}, &off), TIER_OK);
    struct kv_seq_stats st = kv_seq_stats(off);
    assert_int_equal(st.dev_bytes, 0);
    assert_int_equal(st.host_bytes, seq);
    assert_int_equal(st.streamed_layers, L);
    kv_seq_free(off);

    kv_seq *a, *b;
    assert_int_equal(kv_seq_create(s, NULL, &a), TIER_OK);
    assert_int_equal(kv_seq_stats(a).dev_bytes, 2 * seq);
    assert_int_equal(kv_seq_create(s, NULL, &b), TIER_OK); /* the device is full */
    st = kv_seq_stats(b);
    assert_int_equal(st.fallback, KV_FALLBACK_SIZED);
    assert_int_equal(st.strategy, KV_OFFLOADED);
    assert_int_equal(st.resident_layers, 0);
    assert_int_equal(st.host_bytes, seq);
    assert_int_equal(kv_seq_reserve(b, 4), TIER_OK);
    assert_int_equal(kv_store_step_begin(s), TIER_ENOMEM_DEV); /* a holds the device */
    kv_seq_abort(b);
    assert_int_equal(kv_seq_stats(b).host_bytes, seq);
    assert_int_equal(kv_seq_offload(a, KV_FALLBACK_OOM), TIER_OK);
    st = kv_seq_stats(a);
    assert_int_equal(st.fallback, KV_FALLBACK_OOM);
    assert_int_equal(st.dev_bytes, 0);
    assert_int_equal(st.host_bytes, seq);

    /* 24 tokens in chunks [0, 16) and [16, 24): the second reads the first's */
    assert_int_equal(kv_seq_reserve(b, 24), TIER_OK);
    assert_int_equal(kv_seq_stats(b).dev_bytes, 0);
    assert_int_equal(kv_seq_stats(b).host_bytes, 2 * seq); /* the state and the step's copy */
    assert_int_equal(kv_store_step_begin(s), TIER_OK);
    state_chunk(be, s, b, L, 0, 16, -1, 1, sb); /* from the zero state */
    state_chunk(be, s, b, L, 16, 8, 1, 2, sb);
    assert_int_equal(kv_store_step_end(s), BE_OK);
    assert_true(be_mem_stats(be).dev_used <= 2 * seq + sb);
    assert_int_equal(kv_seq_commit(b), TIER_OK);
    st = kv_seq_stats(b);
    assert_int_equal(kv_seq_length(b), 24);
    assert_int_equal(st.dev_bytes, 0);
    assert_int_equal(st.host_bytes, 2 * seq); /* the state and the checkpoint at 16 */
    assert_int_equal(st.xfer.bytes_h2d, 2 * seq); /* each layer in once per chunk, */
    assert_int_equal(st.xfer.bytes_d2h, 2 * seq); /* and back */
    /* an aborted step leaves the state as it was */
    assert_int_equal(kv_seq_reserve(b, 4), TIER_OK);
    assert_int_equal(kv_store_step_begin(s), TIER_OK);
    state_chunk(be, s, b, L, 24, 4, 2, 7, sb);
    assert_int_equal(kv_store_step_end(s), BE_OK);
    kv_seq_abort(b);
    assert_int_equal(kv_seq_stats(b).host_bytes, 2 * seq);
    assert_int_equal(kv_seq_reserve(b, 4), TIER_OK);
    assert_int_equal(kv_store_step_begin(s), TIER_OK);
    state_chunk(be, s, b, L, 24, 4, 2, 3, sb);
    assert_int_equal(kv_store_step_end(s), BE_OK);
    assert_int_equal(kv_seq_commit(b), TIER_OK);
    /* back to the checkpoint at 16: what the first chunk wrote */
    assert_int_equal(kv_seq_crop(b, 20), TIER_OK);
    assert_int_equal(kv_seq_length(b), 16);
    assert_int_equal(kv_seq_reserve(b, 1), TIER_OK);
    assert_int_equal(kv_store_step_begin(s), TIER_OK);
    state_chunk(be, s, b, L, 16, 1, 1, 4, sb);
    assert_int_equal(kv_store_step_end(s), BE_OK);
    assert_int_equal(kv_seq_commit(b), TIER_OK);
    kv_seq *c;
    assert_int_equal(kv_seq_fork(b, &c), TIER_OK);
    assert_int_equal(kv_seq_length(c), 17);
    kv_seq_free(c);
    kv_seq_free(b);
    kv_seq_free(a);
    kv_store_free(s);
    assert_int_equal(be_mem_stats(be).dev_used, 0);
    be_free(be);
}

static uint8_t *state_image(kv_seq *q, size_t *n)
{
    *n = kv_seq_image_size(q);
    uint8_t *img = malloc(*n);
    assert_non_null(img);
    assert_int_equal(kv_seq_save(q, img, *n), TIER_OK);
    return img;
}

/* A state sequence's image: the state and its checkpoints; a load is the
 * same sequence (its image byte for byte, on the device or in the host
 * tier as saved) whose crops go back to the same checkpoints with the
 * same state; images whose state size, body size or checkpoint positions
 * do not fit are refused naming the field. */
static void test_state_image(void **state)
{
    (void)state;
    be_backend *be;
    size_t sb = be_ssm_state_bytes(32, 16, 4);
    kv_store *s = open_state_store((struct kv_store_params){0}, &be);
    for (int off = 0; off < 2; off++) {
        kv_seq *q, *r;
        assert_int_equal(kv_seq_create(s, &(struct kv_seq_params){.strategy = off ? KV_OFFLOADED : KV_DYNAMIC}, &q),
                         TIER_OK);
        for (int i = 0; i < 5; i++) /* 8 tokens a step: checkpoints at 16 and 32 */
            state_step(be, s, q, 8, (float)(i + 1), sb);
        size_t n, n2;
        uint8_t *img = state_image(q, &n);
        assert_int_equal(n, kv_image_head_size(s) + 2 * sb + 2 * (8 + 2 * sb));
        assert_int_equal(kv_seq_load(s, img, n, &r), TIER_OK);
        assert_int_equal(kv_seq_length(r), 40);
        assert_int_equal(kv_seq_stats(r).strategy, kv_seq_stats(q).strategy);
        assert_int_equal(kv_seq_stats(r).host_bytes, kv_seq_stats(q).host_bytes);
        uint8_t *img2 = state_image(r, &n2);
        assert_int_equal(n2, n);
        assert_memory_equal(img2, img, n);
        free(img2);
        /* both go back to 32, whose state step 4 wrote */
        assert_int_equal(kv_seq_crop(q, 35), TIER_OK);
        assert_int_equal(kv_seq_crop(r, 35), TIER_OK);
        assert_int_equal(kv_seq_length(r), 32);
        uint8_t *a = state_image(q, &n), *b = state_image(r, &n2);
        assert_int_equal(n2, n);
        assert_memory_equal(a, b, n);
        float first;
        memcpy(&first, b + kv_image_head_size(s), sizeof first);
        assert_true(first == 4.0f);
        free(a);
        free(b);
        kv_seq_free(r);
        kv_seq_free(q);
        if (off) {
            free(img);
            break;
        }
        /* refusals: a body one byte short, a checkpoint past len, another state size */
        kv_seq *bad = NULL;
        uint8_t *c = malloc(n);
        assert_non_null(c);
        memcpy(c, img, n);
        c[112] = (uint8_t)(n - 1); /* the size field agrees, the body does not split */
        c[113] = (uint8_t)((n - 1) >> 8);
        assert_int_equal(kv_seq_load(s, c, n - 1, &bad), TIER_EINVAL);
        assert_non_null(strstr(kv_store_errmsg(s), "field size"));
        memcpy(c, img, n);
        size_t ck = kv_image_head_size(s) + 2 * sb + 8 + 2 * sb; /* the second checkpoint's pos */
        c[ck] = 41;
        assert_int_equal(kv_seq_load(s, c, n, &bad), TIER_EINVAL);
        assert_non_null(strstr(kv_store_errmsg(s), "pos"));
        memcpy(c, img, n);
        c[120 + 4 * 2] ^= 4; /* layer 0's state_bytes */
        assert_int_equal(kv_seq_load(s, c, n, &bad), TIER_EINVAL);
        assert_non_null(strstr(kv_store_errmsg(s), "state_bytes"));
        assert_null(bad);
        free(c);
        free(img);
    }
    assert_int_equal(be_mem_stats(be).dev_used, 0);
    kv_store_free(s);
    be_free(be);
}

/* The state as values (the session export and import): a sequence's state
 * and checkpoints read out and loaded into a new one give the same image,
 * on the device and in the host tier, and both crop back to the same
 * checkpoint; fewer checkpoints load too, a wrong size, more checkpoints
 * than held and positions out of order are refused. */
static void test_state_values(void **state)
{
    (void)state;
    be_backend *be;
    size_t sb = be_ssm_state_bytes(32, 16, 4), one = 2 * sb;
    kv_store *s = open_state_store((struct kv_store_params){0}, &be);
    for (int off = 0; off < 2; off++) {
        struct kv_seq_params p = {.strategy = off ? KV_OFFLOADED : KV_DYNAMIC};
        kv_seq *q, *r = NULL;
        assert_int_equal(kv_seq_create(s, &p, &q), TIER_OK);
        for (int i = 0; i < 5; i++) /* 8 tokens a step: checkpoints at 16 and 32 */
            state_step(be, s, q, 8, (float)(i + 1), sb);
        int nc = -1;
        assert_int_equal(kv_seq_state_checkpoints(q, &nc), TIER_OK);
        assert_int_equal(nc, 2);
        uint8_t *v = malloc(3 * one);
        int64_t pos[3] = {0};
        assert_non_null(v);
        assert_int_equal(kv_seq_state_read(q, v, 2 * one, pos, 2), TIER_EINVAL);
        assert_int_equal(kv_seq_state_read(q, v, 4 * one, pos, 3), TIER_EINVAL);
        assert_int_equal(kv_seq_state_read(q, v, 3 * one, pos, 2), TIER_OK);
        assert_true(pos[0] == 16 && pos[1] == 32);
        assert_int_equal(kv_seq_load_state(s, &p, 40, v, pos, 2, &r), TIER_OK);
        size_t n, n2;
        uint8_t *a = state_image(q, &n), *b = state_image(r, &n2);
        assert_int_equal(n2, n);
        assert_memory_equal(a, b, n);
        free(a);
        free(b);
        assert_int_equal(kv_seq_crop(q, 35), TIER_OK);
        assert_int_equal(kv_seq_crop(r, 35), TIER_OK);
        assert_int_equal(kv_seq_length(r), 32);
        a = state_image(q, &n);
        b = state_image(r, &n2);
        assert_int_equal(n2, n);
        assert_memory_equal(a, b, n);
        free(a);
        free(b);
        kv_seq_free(r);
        /* the first checkpoint only: a crop to 35 goes back to 16 */
        assert_int_equal(kv_seq_load_state(s, &p, 40, v, pos, 1, &r), TIER_OK);
        assert_int_equal(kv_seq_crop(r, 35), TIER_OK);
        assert_int_equal(kv_seq_length(r), 16);
        kv_seq_free(r);
        r = NULL;
        pos[0] = 32, pos[1] = 16;
        assert_int_equal(kv_seq_load_state(s, &p, 40, v, pos, 2, &r), TIER_EINVAL);
        assert_non_null(strstr(kv_store_errmsg(s), "pos"));
        assert_null(r);
        free(v);
        kv_seq_free(q);
    }
    assert_int_equal(be_mem_stats(be).dev_used, 0);
    kv_store_free(s);
    be_free(be);
}

/* An image arriving: the most bytes a load waited for so far. */
struct state_arrival {
    const uint8_t *img;
    size_t asked;
};

static const void *state_arrive(void *arg, size_t n)
{
    struct state_arrival *a = arg;
    if (n > a->asked)
        a->asked = n;
    return a->img;
}

/* A state image loads layer by layer: its head allocates, a step reads
 * each layer's state as it reaches it without waiting for the
 * checkpoints, and these load last, before the step's own: the sequence
 * is then the saved one after the same step (the same image), on the
 * device and in the host tier (streamed). */
static void test_state_load_by_layer(void **state)
{
    (void)state;
    be_backend *be;
    size_t sb = be_ssm_state_bytes(32, 16, 4);
    kv_store *s = open_state_store((struct kv_store_params){0}, &be);
    size_t head = kv_image_head_size(s);
    for (int off = 0; off < 2; off++) {
        kv_seq *q, *r;
        assert_int_equal(kv_seq_create(s, &(struct kv_seq_params){.strategy = off ? KV_OFFLOADED : KV_DYNAMIC}, &q),
                         TIER_OK);
        for (int i = 0; i < 5; i++) /* 40 tokens: checkpoints at 16 and 32, the state 5 + layer */
            state_step(be, s, q, 8, (float)(i + 1), sb);
        size_t n, n2;
        uint8_t *img = state_image(q, &n);
        struct state_arrival a = {.img = img};
        assert_int_equal(kv_seq_load_begin(s, img, n, &(struct kv_image_src){state_arrive, &a}, &r), TIER_OK);
        assert_int_equal(a.asked, 0);
        assert_true(kv_seq_loading(r));
        /* 40..48 ends on a checkpoint: the step's own comes after the image's */
        assert_int_equal(kv_seq_reserve(r, 8), TIER_OK);
        assert_int_equal(kv_store_step_begin(s), TIER_OK);
        state_chunk(be, s, r, 2, 40, 8, 5, 6, sb);
        assert_int_equal(kv_store_step_end(s), BE_OK);
        assert_int_equal(kv_seq_commit(r), TIER_OK);
        assert_int_equal(a.asked, head + 2 * sb); /* the state, not the checkpoints */
        assert_true(kv_seq_loading(r));
        state_step(be, s, q, 8, 6, sb);
        assert_int_equal(kv_seq_load_finish(r), TIER_OK);
        assert_int_equal(a.asked, n);
        assert_false(kv_seq_loading(r));
        uint8_t *want = state_image(q, &n), *got = state_image(r, &n2);
        assert_int_equal(n2, n);
        assert_memory_equal(got, want, n);
        free(want);
        free(got);
        free(img);
        kv_seq_free(r);
        kv_seq_free(q);
    }
    kv_store_free(s);
    assert_int_equal(be_mem_stats(be).dev_used, 0);
    be_free(be);
}

/* Kept sequences (keep.c): found again only by their namespace and every
 * id (not a prefix, not a longer input, not one id off), shared without a
 * copy; once unreferenced they go least recently used first within the
 * prefix budget, or when the device needs room, never while referenced. */
static void test_kept(void **state)
{
    (void)state;
    void *st;
    /* room for 8 blocks of 256 bytes: a sequence of 8 tokens holds 4 */
    setup_store(&st, 0, 8 * 256, &(struct kv_store_params){.block_tokens = BT});
    struct fixture *f = st;
    int32_t a[21], b[20];
    ids_of(a, 21, 1);
    ids_of(b, 20, 2);
    kv_seq *q, *r;
    kv_kept *ka, *kb, *k;
    assert_int_equal(kv_seq_create(f->store, NULL, &q), TIER_OK);
    assert_int_equal(step_ids(q, 8, NULL), TIER_OK);
    assert_int_equal(kv_store_keep(f->store, 1, a, 20, q, &ka), TIER_OK);
    assert_ptr_equal(kv_kept_seq(ka), q);
    assert_ptr_equal(kv_store_kept_find(f->store, 1, a, 20), ka);
    kv_kept_unref(ka);
    assert_null(kv_store_kept_find(f->store, 1, a, 19)); /* a prefix */
    assert_null(kv_store_kept_find(f->store, 1, a, 21)); /* longer */
    assert_null(kv_store_kept_find(f->store, 2, a, 20)); /* another namespace */
    int32_t last[20];
    memcpy(last, a, sizeof(last));
    last[19]++;
    assert_null(kv_store_kept_find(f->store, 1, last, 20));
    kv_kept_unref(ka);
    struct kv_store_stats ss = kv_store_stats(f->store);
    assert_int_equal(ss.prefix_entries, 1);
    assert_int_equal(ss.prefix_evictable, 1);
    assert_int_equal(ss.prefix_unref_bytes, 4 * 256);
    /* unreferenced, it stays, and a find gives it back as it was */
    assert_non_null(k = kv_store_kept_find(f->store, 1, a, 20));
    check_positions(kv_kept_seq(k), 0, 0, 8);
    assert_int_equal(kv_store_stats(f->store).prefix_evictable, 0);
    kv_kept_unref(k);

    /* the device needs room: the unreferenced one goes */
    assert_int_equal(kv_seq_create(f->store, NULL, &r), TIER_OK);
    assert_int_equal(kv_seq_reserve(r, 12), TIER_OK); /* 6 blocks of 8, 4 held by the kept one */
    kv_seq_abort(r);
    assert_int_equal(kv_store_stats(f->store).prefix_evictions, 1);
    assert_null(kv_store_kept_find(f->store, 1, a, 20));
    kv_seq_free(r);

    /* the budget: of two unreferenced, the least recently used goes */
    assert_int_equal(kv_seq_create(f->store, NULL, &q), TIER_OK);
    assert_int_equal(step_ids(q, 8, NULL), TIER_OK);
    assert_int_equal(kv_store_keep(f->store, 1, a, 20, q, &ka), TIER_OK);
    assert_int_equal(kv_seq_create(f->store, NULL, &q), TIER_OK);
    assert_int_equal(step_ids(q, 8, NULL), TIER_OK);
    assert_int_equal(kv_store_keep(f->store, 1, b, 20, q, &kb), TIER_OK);
    kv_store_set_prefix_mem(f->store, 6 * 256);
    kv_kept_unref(ka);
    kv_kept_unref(kb);
    assert_int_equal(kv_store_stats(f->store).prefix_entries, 1);
    assert_null(kv_store_kept_find(f->store, 1, a, 20));
    assert_ptr_equal(k = kv_store_kept_find(f->store, 1, b, 20), kb);
    /* referenced, it stays whatever the budget, and so does the device's refusal */
    kv_store_set_prefix_mem(f->store, 1);
    assert_int_equal(kv_seq_create(f->store, NULL, &r), TIER_OK);
    assert_int_equal(kv_seq_reserve(r, 20), TIER_ENOMEM_DEV);
    kv_seq_free(r);
    assert_ptr_equal(kv_store_kept_find(f->store, 1, b, 20), kb);
    kv_kept_unref(kb);
    kv_kept_unref(k); /* the last reference: over the budget, it goes at once */
    assert_int_equal(kv_store_stats(f->store).prefix_entries, 0);
    /* an unreferenced kept sequence goes with the store */
    assert_int_equal(kv_seq_create(f->store, NULL, &q), TIER_OK);
    assert_int_equal(kv_store_keep(f->store, 3, b, 20, q, &kb), TIER_OK);
    kv_kept_unref(kb);
    teardown(&st);
}

/* Kept sequences elsewhere (keep.c "FORMAT"): one the store evicts is
 * queued as its image (unless it came from the caller's disk), and the
 * image loads back only for its own namespace and ids, and only whole;
 * the exit's export hands out the rest, referenced or not, once. */
static void test_kept_images(void **state)
{
    (void)state;
    void *st;
    setup_store(&st, 0, 8 * 256, &(struct kv_store_params){.block_tokens = BT});
    struct fixture *f = st;
    int32_t a[8], last[8];
    ids_of(a, 8, 1);
    memcpy(last, a, sizeof(last));
    last[7]++;
    kv_seq *q;
    kv_kept *k;
    struct kv_prefix_block b, none;
    bool got;
    kv_store_set_prefix_spill(f->store, 1 << 20);
    kv_store_set_prefix_mem(f->store, 1); /* an unreferenced one goes at once */
    assert_int_equal(kv_seq_create(f->store, NULL, &q), TIER_OK);
    assert_int_equal(step_ids(q, 8, NULL), TIER_OK);
    assert_int_equal(kv_store_keep(f->store, 1, a, 8, q, &k), TIER_OK);
    assert_false(kv_store_prefix_take_evicted(f->store, &b));
    kv_kept_unref(k);
    assert_false(kv_store_kept_held(f->store, 1, a, 8));
    assert_true(kv_store_prefix_take_evicted(f->store, &b));
    assert_true(b.kept);
    assert_int_equal(b.ns, 1);
    assert_int_equal(b.hash, kv_store_kept_hash(1, a, 8));

    /* refused: another input, namespace or length, a damaged header, a
     * short buffer; nothing is kept */
    assert_int_equal(kv_store_kept_insert(f->store, b.buf, b.len, 1, last, 8, true, &k), TIER_EINVAL);
    assert_null(k);
    assert_int_equal(kv_store_kept_insert(f->store, b.buf, b.len, 2, a, 8, true, &k), TIER_EINVAL);
    assert_int_equal(kv_store_kept_insert(f->store, b.buf, b.len, 1, a, 7, true, &k), TIER_EINVAL);
    assert_int_equal(kv_store_kept_insert(f->store, b.buf, 40, 1, a, 8, true, &k), TIER_EINVAL);
    assert_int_equal(kv_store_kept_insert(f->store, b.buf, b.len - 1, 1, a, 8, true, &k), TIER_EINVAL);
    ((uint8_t *)b.buf)[0] ^= 1;
    assert_int_equal(kv_store_kept_insert(f->store, b.buf, b.len, 1, a, 8, true, &k), TIER_EINVAL);
    ((uint8_t *)b.buf)[0] ^= 1;
    assert_non_null(strstr(kv_store_errmsg(f->store), "kept sequence"));
    assert_int_equal(kv_store_stats(f->store).prefix_entries, 0);
    assert_int_equal(kv_store_stats(f->store).blocks_used, 0);

    /* its own key: the same positions, kept; from the disk, its eviction
     * queues nothing */
    assert_int_equal(kv_store_kept_insert(f->store, b.buf, b.len, 1, a, 8, true, &k), TIER_OK);
    assert_true(kv_store_kept_held(f->store, 1, a, 8));
    check_positions(kv_kept_seq(k), 0, 0, 8);
    kv_kept_unref(k);
    assert_false(kv_store_kept_held(f->store, 1, a, 8));
    assert_false(kv_store_prefix_take_evicted(f->store, &none));
    /* from elsewhere (the remote tier), it is queued */
    assert_int_equal(kv_store_kept_insert(f->store, b.buf, b.len, 1, a, 8, false, &k), TIER_OK);
    kv_kept_unref(k);
    assert_true(kv_store_prefix_take_evicted(f->store, &none));
    assert_int_equal(none.len, b.len);
    assert_memory_equal(none.buf, b.buf, b.len);
    free(none.buf);

    /* the export: a referenced one and one from the disk (not handed out), once */
    kv_store_set_prefix_mem(f->store, 1 << 20);
    assert_int_equal(kv_store_kept_insert(f->store, b.buf, b.len, 1, a, 8, true, &k), TIER_OK);
    kv_kept *k2;
    assert_int_equal(kv_store_kept_insert(f->store, b.buf, b.len, 1, a, 8, false, &k2), TIER_OK);
    assert_int_equal(kv_store_prefix_export(f->store, &none, &got), TIER_OK);
    assert_true(got && none.kept && none.len == b.len);
    free(none.buf);
    assert_int_equal(kv_store_prefix_export(f->store, &none, &got), TIER_OK);
    assert_false(got);
    kv_kept_unref(k);
    kv_kept_unref(k2);
    free(b.buf);
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
        cmocka_unit_test(test_pool_warm),
        cmocka_unit_test_setup_teardown(test_static_full_layer, setup_w4, teardown),
        cmocka_unit_test_setup_teardown(test_static_sliding_vectors, setup_w4, teardown),
        cmocka_unit_test(test_static_hybrid_vectors),
        cmocka_unit_test_setup_teardown(test_static_decode_never_allocates, setup_w4, teardown),
        cmocka_unit_test_setup_teardown(test_offload_residency, setup_w4, teardown),
        cmocka_unit_test_setup_teardown(test_offload_moves_everything, setup_w4, teardown),
        cmocka_unit_test_setup_teardown(test_reserve_read, setup_w4, teardown),
        cmocka_unit_test_setup_teardown(test_host_budget, setup_w4, teardown),
        cmocka_unit_test_setup_teardown(test_hostpool_coalesce, setup_w4, teardown),
        cmocka_unit_test_setup_teardown(test_hostpool_reuse, setup_w4, teardown),
        cmocka_unit_test_setup_teardown(test_hostpool_slab_release, setup_w4, teardown),
        cmocka_unit_test_setup_teardown(test_host_slabs_few, setup_w4, teardown),
        cmocka_unit_test_setup_teardown(test_bad_params, setup_w4, teardown),
        cmocka_unit_test_setup_teardown(test_crop_dynamic, setup_w4, teardown),
        cmocka_unit_test(test_state_store),
        cmocka_unit_test(test_state_fork_fallback),
        cmocka_unit_test(test_state_load_by_layer),
        cmocka_unit_test(test_state_prefix),
        cmocka_unit_test(test_state_prefix_host),
        cmocka_unit_test(test_state_image),
        cmocka_unit_test(test_state_values),
        cmocka_unit_test(test_state_host_tier),
        cmocka_unit_test_setup_teardown(test_crop_sliding_unrecorded, setup_w4, teardown),
        cmocka_unit_test_setup_teardown(test_crop_sliding_recorded, setup_w4, teardown),
        cmocka_unit_test_setup_teardown(test_crop_static, setup_w4, teardown),
        cmocka_unit_test_setup_teardown(test_crop_out_of_range, setup_w4, teardown),
        cmocka_unit_test_setup_teardown(test_prefix_budget_and_namespaces, setup_prefix, teardown),
        cmocka_unit_test_setup_teardown(test_reuse, setup_w4, teardown),
        cmocka_unit_test_setup_teardown(test_reuse_sliding_unrecorded, setup_w4, teardown),
        cmocka_unit_test_setup_teardown(test_fork_cow, setup_w4, teardown),
        cmocka_unit_test_setup_teardown(test_refork, setup_w4, teardown),
        cmocka_unit_test_setup_teardown(test_fork_offloaded, setup_w4, teardown),
        cmocka_unit_test_setup_teardown(test_fork_fits, setup_w4, teardown),
        cmocka_unit_test_setup_teardown(test_prefix_match, setup_prefix, teardown),
        cmocka_unit_test(test_prefix_collisions),
        cmocka_unit_test(test_prefix_eviction),
        cmocka_unit_test(test_kept),
        cmocka_unit_test(test_kept_images),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
