/* Description: the prefix cache's blocks as bytes (tiers/prefix.c "On
 * disk") under a real forward pass: blocks evicted from one store,
 * serialized and inserted into a fresh store are found by
 * kv_seq_match_prefix, and the sequence that attaches them continues with
 * the tokens and bit-identical logits of one that computed everything;
 * kv_store_prefix_chain gives the cache's hashes; an insert is refused
 * naming the field for every damaged field and another geometry, and
 * one whose parent is not cached as a state of the cache, leaving the
 * cache as it was; the budget bounds the blocks a lookup reads in; the eviction queue keeps its
 * bound; the export hands out every entry once; another namespace does
 * not see an inserted block.
 * The model is a random one from tools/mkmodel.py (skip without it).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "model/model.h"
#include "tests/rig.h"

#define N_PROMPT 22 /* 5 full blocks of 4, matchable: (22 - 1) / 4 = 5 */
#define N_BLOCKS 5
#define N_AFTER 8
#define BT 4


static const char *const model_args[] = {RIG_LLAMA};

/* The llama with blocks of bt tokens and the prefix cache. */
static void rig_open_bt(struct rig *r, int bt)
{
    struct kv_store_params sp = {.block_tokens = bt, .prefix_cache = true};
    rig_open(r, 0, &sp);
}

static void prompt(int32_t *ids)
{
    for (int i = 0; i < N_PROMPT; i++)
        ids[i] = (int32_t)((i * 37 + 101) % 300 + 4);
}

/* Computes the prompt in r's store under namespace ns, then evicts every
 * block (budget of 1 byte) into the queue and takes them, in chain order
 * (blk[0] has no parent).  Returns how many were taken. */
static int evict_chain(struct rig *r, uint64_t ns, struct kv_prefix_block *blk)
{
    int32_t ids[N_PROMPT];
    prompt(ids);
    float *row = malloc((size_t)r->V * sizeof(float));
    assert_non_null(row);
    kv_seq *q;
    struct kv_seq_params p = {.strategy = KV_DYNAMIC, .prefix_ns = ns};
    assert_int_equal(kv_seq_create(r->store, &p, &q), TIER_OK);
    feed(r, q, ids, N_PROMPT, row);
    kv_seq_free(q);
    free(row);
    kv_store_set_prefix_spill(r->store, 64 << 20);
    kv_store_set_prefix_mem(r->store, 1);
    assert_int_equal(kv_store_stats(r->store).prefix_entries, 0);
    kv_store_set_prefix_mem(r->store, 0);
    /* evicted leaves first: taken tail first, so the chain is reversed */
    struct kv_prefix_block got[2 * N_BLOCKS];
    int n = 0;
    while (n < 2 * N_BLOCKS && kv_store_prefix_take_evicted(r->store, &got[n]))
        n++;
    for (int i = 0; i < n; i++)
        blk[i] = got[n - 1 - i];
    for (int i = 0; i < n; i++) {
        assert_int_equal(blk[i].ns, ns);
        assert_int_equal(blk[i].has_parent, i > 0);
        if (i)
            assert_int_equal(blk[i].parent, blk[i - 1].hash);
    }
    return n;
}

static void free_blocks(struct kv_prefix_block *blk, int n)
{
    for (int i = 0; i < n; i++)
        free(blk[i].buf);
}

static void test_evict_insert_continue(void **state)
{
    (void)state;
    struct rig a, b;
    rig_open_bt(&a, BT);
    struct kv_prefix_block blk[2 * N_BLOCKS];
    /* 22 tokens commit 5 full blocks; all five are published */
    assert_int_equal(evict_chain(&a, 3, blk), N_BLOCKS);
    assert_int_equal(kv_store_stats(a.store).prefix_evictions, N_BLOCKS);
    assert_int_equal(kv_store_stats(a.store).prefix_spill_dropped, 0);
    rig_close(&a);

    rig_open_bt(&b, BT);
    int32_t ids[N_PROMPT], tok;
    prompt(ids);
    uint64_t hashes[N_BLOCKS];
    int64_t n_mem;
    struct kv_seq_params p = {.strategy = KV_DYNAMIC, .prefix_ns = 3};
    assert_int_equal(kv_store_prefix_chain(b.store, &p, ids, N_PROMPT, hashes, &n_mem), N_BLOCKS);
    assert_int_equal(n_mem, 0);
    for (int i = 0; i < N_BLOCKS; i++)
        assert_int_equal(hashes[i], blk[i].hash);
    /* a child before its parent has no parent to hang from: a state of
     * the cache, not a fault of the block */
    assert_int_equal(kv_store_prefix_insert(b.store, blk[1].buf, blk[1].len), TIER_ECONFLICT);
    assert_non_null(strstr(kv_store_errmsg(b.store), "parent"));
    for (int i = 0; i < N_BLOCKS; i++)
        assert_int_equal(kv_store_prefix_insert(b.store, blk[i].buf, blk[i].len), TIER_OK);
    assert_int_equal(kv_store_prefix_insert(b.store, blk[2].buf, blk[2].len), TIER_OK); /* cached already */
    struct kv_store_stats ss = kv_store_stats(b.store);
    assert_int_equal(ss.prefix_entries, N_BLOCKS);
    assert_int_equal(ss.prefix_evictable, N_BLOCKS);
    assert_int_equal(kv_store_prefix_chain(b.store, &p, ids, N_PROMPT, hashes, &n_mem), N_BLOCKS);
    assert_int_equal(n_mem, N_BLOCKS);
    /* not for a sequence that would not take part */
    struct kv_seq_params off = p;
    off.no_prefix_cache = true;
    assert_int_equal(kv_store_prefix_chain(b.store, &off, ids, N_PROMPT, hashes, &n_mem), 0);
    off = p;
    off.strategy = KV_STATIC;
    off.max_cache_len = 64;
    assert_int_equal(kv_store_prefix_chain(b.store, &off, ids, N_PROMPT, hashes, &n_mem), 0);
    /* inserted blocks are not queued again when evicted */
    kv_store_set_prefix_spill(b.store, 64 << 20);

    float *row = malloc((size_t)b.V * sizeof(float)), *ref = malloc((size_t)b.V * sizeof(float));
    assert_true(row && ref);
    kv_seq *q, *rq;
    struct kv_seq_params rp = p;
    rp.no_prefix_cache = true;
    assert_int_equal(kv_seq_create(b.store, &rp, &rq), TIER_OK);
    feed(&b, rq, ids, N_PROMPT, ref);
    assert_int_equal(kv_seq_create(b.store, &p, &q), TIER_OK);
    int64_t cached;
    assert_int_equal(kv_seq_match_prefix(q, ids, N_PROMPT, &cached), TIER_OK);
    assert_int_equal(cached, N_BLOCKS * BT);
    feed(&b, q, ids + cached, N_PROMPT - (int)cached, row);
    if (memcmp(row, ref, (size_t)b.V * sizeof(float)))
        fail_msg("logits of the prompt's last token differ from the reference");
    for (int i = 0; i < N_AFTER; i++) {
        tok = argmax_f32(ref, b.V);
        feed(&b, rq, &tok, 1, ref);
        feed(&b, q, &tok, 1, row);
        if (memcmp(row, ref, (size_t)b.V * sizeof(float)))
            fail_msg("logits differ from the reference %d tokens after the prompt", i + 1);
    }
    kv_seq_free(q);
    kv_seq_free(rq);
    /* q published the blocks its decoding filled (positions 20..27); only
     * those come back when everything is evicted */
    kv_store_set_prefix_mem(b.store, 1);
    struct kv_prefix_block x;
    int n_new = 0;
    while (kv_store_prefix_take_evicted(b.store, &x)) {
        for (int i = 0; i < N_BLOCKS; i++)
            assert_true(x.hash != blk[i].hash);
        n_new++;
        free(x.buf);
    }
    assert_int_equal(n_new, (N_PROMPT + N_AFTER) / BT - N_BLOCKS);
    free(row);
    free(ref);
    free_blocks(blk, N_BLOCKS);
    rig_close(&b);
}

/* Inserting a damaged copy of blk fails with want (TIER_EINVAL: refused
 * as corrupt) naming `what`; the cache keeps its entries. */
static void expect_fails(kv_store *s, const struct kv_prefix_block *blk, size_t off, uint8_t flip, size_t len,
                         enum tier_status want, const char *what)
{
    uint8_t *c = malloc(blk->len);
    assert_non_null(c);
    memcpy(c, blk->buf, blk->len);
    if (off < blk->len)
        c[off] ^= flip;
    uint64_t before = kv_store_stats(s).prefix_entries;
    enum tier_status st = kv_store_prefix_insert(s, c, len);
    if (st != want)
        fail_msg("a block damaged at %zu (len %zu): %s, not %s", off, len, tier_strerror(st), tier_strerror(want));
    if (!strstr(kv_store_errmsg(s), what))
        fail_msg("damage at %zu: \"%s\" does not name %s", off, kv_store_errmsg(s), what);
    assert_int_equal(kv_store_stats(s).prefix_entries, before);
    free(c);
}

/* A chain read in under a small budget: the lookup asks for no more
 * blocks than the budget keeps unreferenced, and a block whose parent the
 * budget evicted is a state of the cache (TIER_ECONFLICT), not a corrupt
 * block (TIER_EINVAL, which the daemon counts and deletes). */
static void test_budget_bounds_chain(void **state)
{
    (void)state;
    struct rig a, b;
    rig_open_bt(&a, BT);
    struct kv_prefix_block blk[2 * N_BLOCKS];
    assert_int_equal(evict_chain(&a, 3, blk), N_BLOCKS);
    rig_close(&a);

    rig_open_bt(&b, BT);
    int32_t ids[N_PROMPT];
    prompt(ids);
    uint64_t hashes[N_BLOCKS];
    int64_t n_mem;
    struct kv_seq_params p = {.strategy = KV_DYNAMIC, .prefix_ns = 3};
    assert_int_equal(kv_store_prefix_insert(b.store, blk[0].buf, blk[0].len), TIER_OK);
    size_t entry = kv_store_stats(b.store).prefix_unref_bytes;
    assert_true(entry > 0);
    kv_store_set_prefix_mem(b.store, 2 * entry + entry / 2);
    /* one block cached and unreferenced: one more fits the budget */
    assert_int_equal(kv_store_prefix_chain(b.store, &p, ids, N_PROMPT, hashes, &n_mem), 2);
    assert_int_equal(n_mem, 1);
    assert_int_equal(kv_store_prefix_insert(b.store, blk[1].buf, blk[1].len), TIER_OK);
    /* a third is evicted as it goes in, newest first */
    assert_int_equal(kv_store_prefix_insert(b.store, blk[2].buf, blk[2].len), TIER_OK);
    assert_int_equal(kv_store_stats(b.store).prefix_entries, 2);
    assert_int_equal(kv_store_prefix_insert(b.store, blk[3].buf, blk[3].len), TIER_ECONFLICT);
    assert_non_null(strstr(kv_store_errmsg(b.store), "parent"));
    assert_int_equal(kv_store_stats(b.store).prefix_entries, 2);
    assert_int_equal(kv_store_prefix_chain(b.store, &p, ids, N_PROMPT, hashes, &n_mem), 2);
    assert_int_equal(n_mem, 2);
    /* held by a sequence, cached blocks leave the budget to those read in */
    kv_seq *q;
    int64_t cached;
    assert_int_equal(kv_seq_create(b.store, &p, &q), TIER_OK);
    assert_int_equal(kv_seq_match_prefix(q, ids, N_PROMPT, &cached), TIER_OK);
    assert_int_equal(cached, 2 * BT);
    assert_int_equal(kv_store_prefix_chain(b.store, &p, ids, N_PROMPT, hashes, &n_mem), 4);
    assert_int_equal(n_mem, 2);
    kv_seq_free(q);
    /* no budget, no bound */
    kv_store_set_prefix_mem(b.store, 0);
    assert_int_equal(kv_store_prefix_chain(b.store, &p, ids, N_PROMPT, hashes, &n_mem), N_BLOCKS);
    rig_close(&b);
    free_blocks(blk, N_BLOCKS);
}

static void test_insert_refusals(void **state)
{
    (void)state;
    struct rig a, b;
    rig_open_bt(&a, BT);
    struct kv_prefix_block blk[2 * N_BLOCKS];
    assert_int_equal(evict_chain(&a, 0, blk), N_BLOCKS);
    rig_close(&a);
    rig_open_bt(&b, BT);
    assert_int_equal(kv_store_prefix_insert(b.store, blk[0].buf, blk[0].len), TIER_OK);
    const struct kv_prefix_block *k = &blk[1]; /* a child of the cached block */
    expect_fails(b.store, k, 0, 1, k->len, TIER_EINVAL, "magic");
    expect_fails(b.store, k, 8, 1, k->len, TIER_EINVAL, "version");
    expect_fails(b.store, k, 12, 1, k->len, TIER_EINVAL, "n_layers");
    expect_fails(b.store, k, 16, 1, k->len, TIER_EINVAL, "n_kv_heads");
    expect_fails(b.store, k, 20, 1, k->len, TIER_EINVAL, "head_dim");
    expect_fails(b.store, k, 24, 1, k->len, TIER_EINVAL, "dtype");
    expect_fails(b.store, k, 28, 1, k->len, TIER_EINVAL, "block_tokens");
    expect_fails(b.store, k, 32, 2, k->len, TIER_EINVAL, "flags");
    expect_fails(b.store, k, 36, 1, k->len, TIER_EINVAL, "flags");
    expect_fails(b.store, k, 80, 1, k->len, TIER_EINVAL, "size");
    expect_fails(b.store, k, k->len, 0, k->len - 1, TIER_EINVAL, "size");
    /* a damaged parent hash no longer seeds the block's own hashes */
    expect_fails(b.store, k, 64, 1, k->len, TIER_EINVAL, "parent"); /* parent hash */
    expect_fails(b.store, k, 72, 1, k->len, TIER_EINVAL, "parent"); /* parent check */
    expect_fails(b.store, k, 48, 1, k->len, TIER_EINVAL, "hash");
    expect_fails(b.store, k, 56, 1, k->len, TIER_EINVAL, "check hash");
    expect_fails(b.store, k, 88, 1, k->len, TIER_EINVAL, "hash"); /* a token id */
    expect_fails(b.store, k, 40, 1, k->len, TIER_ECONFLICT, "parent"); /* another namespace: its parent is not there */
    /* a first block that claims no parent but carries parent hashes */
    expect_fails(b.store, &blk[0], 64, 1, blk[0].len, TIER_EINVAL, "parent hashes");
    /* the KV itself is not hashed: a flipped KV byte still inserts (the
     * disk tier's checksums guard those bytes) */
    ((uint8_t *)k->buf)[k->len - 1] ^= 1;
    assert_int_equal(kv_store_prefix_insert(b.store, k->buf, k->len), TIER_OK);
    assert_int_equal(kv_store_stats(b.store).prefix_entries, 2);
    rig_close(&b);

    struct rig c; /* another block size */
    rig_open_bt(&c, 2 * BT);
    expect_fails(c.store, &blk[0], blk[0].len, 0, blk[0].len, TIER_EINVAL, "block_tokens");
    rig_close(&c);
    free_blocks(blk, N_BLOCKS);
}

static void test_queue_bound_and_export(void **state)
{
    (void)state;
    struct rig a;
    rig_open_bt(&a, BT);
    int32_t ids[N_PROMPT];
    prompt(ids);
    float *row = malloc((size_t)a.V * sizeof(float));
    assert_non_null(row);
    kv_seq *q;
    struct kv_seq_params p = {.strategy = KV_DYNAMIC, .prefix_ns = 9};
    assert_int_equal(kv_seq_create(a.store, &p, &q), TIER_OK);
    feed(&a, q, ids, N_PROMPT, row);
    /* every entry once, referenced ones included */
    struct kv_prefix_block x[N_BLOCKS + 1];
    bool got;
    int n = 0;
    while (n <= N_BLOCKS) {
        assert_int_equal(kv_store_prefix_export(a.store, &x[n], &got), TIER_OK);
        if (!got)
            break;
        n++;
    }
    assert_int_equal(n, N_BLOCKS);
    assert_int_equal(kv_store_prefix_export(a.store, &x[n], &got), TIER_OK);
    assert_false(got);
    for (int i = 0; i < n; i++)
        assert_int_equal(x[i].ns, 9);
    /* exported entries are not queued again at eviction */
    kv_seq_free(q);
    kv_store_set_prefix_spill(a.store, 64 << 20);
    kv_store_set_prefix_mem(a.store, 1);
    struct kv_prefix_block y;
    assert_false(kv_store_prefix_take_evicted(a.store, &y));
    kv_store_set_prefix_mem(a.store, 0);
    /* a bound of one block keeps the newest evicted one */
    assert_int_equal(kv_seq_create(a.store, &p, &q), TIER_OK);
    feed(&a, q, ids, N_PROMPT, row);
    kv_seq_free(q);
    kv_store_set_prefix_spill(a.store, x[0].len);
    kv_store_set_prefix_mem(a.store, 1);
    assert_true(kv_store_prefix_take_evicted(a.store, &y));
    assert_false(y.has_parent); /* the root goes last */
    struct kv_prefix_block z;
    assert_false(kv_store_prefix_take_evicted(a.store, &z));
    assert_int_equal(kv_store_stats(a.store).prefix_spill_dropped, N_BLOCKS - 1);
    free(y.buf);
    free_blocks(x, n);
    free(row);
    rig_close(&a);
}

static void test_namespaces(void **state)
{
    (void)state;
    struct rig a, b;
    rig_open_bt(&a, BT);
    struct kv_prefix_block blk[2 * N_BLOCKS];
    assert_int_equal(evict_chain(&a, 1001, blk), N_BLOCKS);
    rig_close(&a);
    rig_open_bt(&b, BT);
    for (int i = 0; i < N_BLOCKS; i++)
        assert_int_equal(kv_store_prefix_insert(b.store, blk[i].buf, blk[i].len), TIER_OK);
    int32_t ids[N_PROMPT];
    prompt(ids);
    uint64_t hashes[N_BLOCKS];
    int64_t n_mem, cached;
    struct kv_seq_params p = {.strategy = KV_DYNAMIC, .prefix_ns = 1002};
    assert_int_equal(kv_store_prefix_chain(b.store, &p, ids, N_PROMPT, hashes, &n_mem), N_BLOCKS);
    assert_int_equal(n_mem, 0);
    assert_true(hashes[0] != blk[0].hash);
    kv_seq *q;
    assert_int_equal(kv_seq_create(b.store, &p, &q), TIER_OK);
    assert_int_equal(kv_seq_match_prefix(q, ids, N_PROMPT, &cached), TIER_OK);
    assert_int_equal(cached, 0);
    kv_seq_free(q);
    p.prefix_ns = 1001;
    assert_int_equal(kv_seq_create(b.store, &p, &q), TIER_OK);
    assert_int_equal(kv_seq_match_prefix(q, ids, N_PROMPT, &cached), TIER_OK);
    assert_int_equal(cached, N_BLOCKS * BT);
    kv_seq_free(q);
    free_blocks(blk, N_BLOCKS);
    rig_close(&b);
}


int main(void)
{
    if (make_models(model_args, 1) != 0) {
        fprintf(stderr, "test_prefix_disk: tools/mkmodel.py failed (no torch?): skipping\n");
        cleanup();
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_evict_insert_continue),
        cmocka_unit_test(test_budget_bounds_chain),
        cmocka_unit_test(test_insert_refusals),
        cmocka_unit_test(test_queue_bound_and_export),
        cmocka_unit_test(test_namespaces),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    cleanup();
    return rc;
}
