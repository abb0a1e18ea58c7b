/* Description: sequence images (tiers/image.c) under a real forward pass:
 * for every strategy and state (dynamic, static, offloaded,
 * offloaded_static, adaptive, sliding and hybrid models, the
 * sliding_window and sink strategies in both phases, quantized with each
 * backend and offloaded, past recording, after a fallback, a fork sharing
 * its parent's blocks, a prefix-cache match) a sequence saved, freed and
 * loaded continues with the tokens and bit-identical logits of one never
 * saved, and re-saving a loaded image gives the same bytes; truncated and
 * corrupted images and another store's geometry are refused naming the
 * field, leaving the store as it was, and so is a block whose rows the
 * layer does not store are not zero; a load over the device budget falls
 * back to the host tier unless the image says no_fallback.  A load layer
 * by layer reads only the head before it allocates, fills each layer
 * as the forward pass reaches it, from bytes that arrive in order, with
 * the same logits; a source that fails part-way fails the step and
 * every later fill, and the freed sequence leaves the store as it was.
 * The models are random ones from tools/mkmodel.py (skip without it).
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
#include "tiers/quant.h"

#define N_PROMPT 20
#define K_BEFORE 6 /* decoded before the save */
#define N_AFTER 10 /* decoded after the load */
#define BT 4       /* small blocks: sinks apart, windows across blocks */


enum { M_LLAMA, M_MISTRAL, M_QWEN2, N_MODELS };
static const char *const model_args[N_MODELS] = {[M_LLAMA] = RIG_LLAMA, [M_MISTRAL] = RIG_MISTRAL, [M_QWEN2] = RIG_QWEN2};

/* Model which with blocks of bt tokens, with or without the prefix cache. */
static void rig_open_bt(struct rig *r, int which, int bt, bool prefix)
{
    struct kv_store_params sp = {.block_tokens = bt, .prefix_cache = prefix};
    rig_open(r, which, &sp);
}

static void prompt(int32_t *ids)
{
    for (int i = 0; i < N_PROMPT; i++)
        ids[i] = (int32_t)((i * 37 + 101) % 300 + 4);
}

/* q's image, checked for the fixed point: loading it and saving again
 * gives the same bytes. */
static uint8_t *save(kv_store *s, kv_seq *q, size_t *size)
{
    *size = kv_seq_image_size(q);
    uint8_t *img = malloc(*size), *again = malloc(*size);
    assert_true(img && again);
    assert_int_equal(kv_seq_save(q, img, *size - 1), TIER_EINVAL);
    assert_int_equal(kv_seq_save(q, img, *size), TIER_OK);
    kv_seq *l;
    enum tier_status st = kv_seq_load(s, img, *size, &l);
    if (st != TIER_OK)
        fail_msg("kv_seq_load of a fresh image: %s: %s", tier_strerror(st), kv_store_errmsg(s));
    assert_int_equal(kv_seq_image_size(l), *size);
    assert_int_equal(kv_seq_save(l, again, *size), TIER_OK);
    assert_memory_equal(img, again, *size);
    kv_seq_free(l);
    free(again);
    return img;
}

/* With KVTIER_IMAGE_SEEDS=dir, the images of the two-layer models go to
 * dir as seeds of tests/fuzz/fuzz_image.c: its store selector byte (odd:
 * sliding layers), then the image; a full-attention one also as a kept
 * sequence's image (selector 4) under the ids the harness looks up. */
static void write_seed(int which, kv_seq *q, const uint8_t *img, size_t size)
{
    static int n;
    const char *dir = getenv("KVTIER_IMAGE_SEEDS");
    if (!dir || which == M_QWEN2)
        return;
    char path[512];
    snprintf(path, sizeof(path), "%s/image-%02d", dir, n);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    uint8_t sel = which == M_MISTRAL;
    assert_int_equal(fwrite(&sel, 1, 1, f), 1);
    assert_int_equal(fwrite(img, 1, size, f), size);
    assert_int_equal(fclose(f), 0);
    int64_t len = kv_seq_length(q);
    if (!sel && len > 0) {
        int32_t *ids = malloc((size_t)len * sizeof(*ids));
        assert_non_null(ids);
        for (int64_t i = 0; i < len; i++)
            ids[i] = (int32_t)i + 1;
        struct kv_prefix_block b;
        assert_int_equal(kv_store_kept_image(q, 1, ids, len, &b), TIER_OK);
        snprintf(path, sizeof(path), "%s/kept-%02d", dir, n);
        assert_non_null(f = fopen(path, "wb"));
        sel = 4;
        assert_int_equal(fwrite(&sel, 1, 1, f), 1);
        assert_int_equal(fwrite(b.buf, 1, b.len, f), b.len);
        assert_int_equal(fclose(f), 0);
        free(b.buf);
        free(ids);
    }
    n++;
}

enum action { A_NONE, A_RECORD, A_OFFLOAD, A_FORK, A_PREFIX, A_PARTS };

struct variant {
    const char *name;
    int model;
    struct kv_seq_params p;
    enum action act;
};

/* The first part of the prompt, in one forward call that says the whole
 * prompt is N_PROMPT tokens (a quantized cache waits for the rest). */
static void feed_part(struct rig *r, kv_seq *q, const int32_t *ids, float *row)
{
    struct fw_seq fs = {.kv = q, .tokens = ids, .n_tokens = N_PROMPT / 2, .logits = row, .call_len = N_PROMPT};
    assert_int_equal(model_forward(r->m, &fs, 1), MODEL_OK);
}

/* Prefill + K_BEFORE tokens on q and a reference, save q, free it, load,
 * then N_AFTER tokens on both: the same logits, bit for bit.  A_PARTS
 * saves between the two parts of the prompt instead, then feeds the
 * second part to both. */
static void run_variant(const struct variant *v)
{
    struct rig r;
    rig_open_bt(&r, v->model, BT, v->act == A_PREFIX);
    float *row = malloc((size_t)r.V * sizeof(float)), *ref = malloc((size_t)r.V * sizeof(float));
    assert_true(row && ref);
    int32_t ids[N_PROMPT], tok;
    prompt(ids);
    kv_seq *q, *rq, *parent = NULL, *first = NULL;
    struct kv_seq_params rp = v->p;
    rp.no_prefix_cache = true; /* the reference leaves the prefix cache alone */
    assert_int_equal(kv_seq_create(r.store, &rp, &rq), TIER_OK);
    if (v->act == A_PREFIX) { /* q attaches the blocks `first` published */
        int64_t cached;
        assert_int_equal(kv_seq_create(r.store, &v->p, &first), TIER_OK);
        feed(&r, first, ids, N_PROMPT, row);
        assert_int_equal(kv_seq_create(r.store, &v->p, &q), TIER_OK);
        assert_int_equal(kv_seq_match_prefix(q, ids, N_PROMPT, &cached), TIER_OK);
        assert_true(cached > 0);
        feed(&r, q, ids + cached, N_PROMPT - (int)cached, row);
    } else if (v->act == A_FORK) { /* q shares its parent's blocks */
        assert_int_equal(kv_seq_create(r.store, &v->p, &parent), TIER_OK);
        feed(&r, parent, ids, N_PROMPT, row);
        assert_int_equal(kv_seq_fork(parent, &q), TIER_OK);
    } else {
        assert_int_equal(kv_seq_create(r.store, &v->p, &q), TIER_OK);
        if (v->act == A_RECORD)
            assert_int_equal(kv_seq_activate_past_recording(q), TIER_OK);
        if (v->act == A_PARTS)
            feed_part(&r, q, ids, row);
        else
            feed(&r, q, ids, N_PROMPT, row);
    }
    if (v->act == A_PARTS)
        feed_part(&r, rq, ids, ref);
    else
        feed(&r, rq, ids, N_PROMPT, ref);
    if (v->act == A_OFFLOAD)
        assert_int_equal(kv_seq_offload(q, KV_FALLBACK_OOM), TIER_OK);
    for (int i = 0; i < K_BEFORE && v->act != A_PARTS; i++) {
        tok = argmax_f32(ref, r.V);
        feed(&r, rq, &tok, 1, ref);
        feed(&r, q, &tok, 1, row);
    }
    struct kv_seq_stats before = kv_seq_stats(q);
    size_t size;
    uint8_t *img = save(r.store, q, &size);
    write_seed(v->model, q, img, size);
    kv_seq_free(q);
    kv_seq_free(parent);
    struct kv_store_stats ss = kv_store_stats(r.store);
    assert_int_equal(kv_seq_load(r.store, img, size, &q), TIER_OK);
    struct kv_seq_stats after = kv_seq_stats(q);
    assert_int_equal(after.strategy, before.strategy);
    assert_int_equal(after.requested, before.requested);
    assert_int_equal(after.fallback, before.fallback);
    assert_int_equal(after.streamed_layers, before.streamed_layers);
    assert_int_equal(kv_seq_length(q), v->act == A_PARTS ? N_PROMPT / 2 : N_PROMPT + K_BEFORE);
    if (v->act == A_PARTS) {
        feed(&r, rq, ids + N_PROMPT / 2, N_PROMPT - N_PROMPT / 2, ref);
        feed(&r, q, ids + N_PROMPT / 2, N_PROMPT - N_PROMPT / 2, row);
    }
    /* a loaded sequence does not publish: the prefix cache is as it was */
    assert_int_equal(kv_store_stats(r.store).prefix_entries, ss.prefix_entries);
    for (int i = 0; i < N_AFTER; i++) {
        tok = argmax_f32(ref, r.V);
        feed(&r, rq, &tok, 1, ref);
        feed(&r, q, &tok, 1, row);
        if (memcmp(row, ref, (size_t)r.V * sizeof(float)))
            fail_msg("%s: logits differ from the reference %d tokens after the load", v->name, i + 1);
    }
    assert_int_equal(kv_store_stats(r.store).prefix_entries, ss.prefix_entries);
    kv_seq_free(q);
    kv_seq_free(rq);
    kv_seq_free(first);
    free(img);
    free(row);
    free(ref);
    rig_close(&r);
}

static struct kv_quant_params quanto(void)
{
    struct kv_quant_params qp = kv_quant_defaults(KVQ_QUANTO);
    qp.residual_length = 8; /* flushes during the test */
    return qp;
}

static struct kv_quant_params hqq_channel(void)
{
    struct kv_quant_params qp = kv_quant_defaults(KVQ_HQQ);
    qp.axis_key = 0; /* per-channel keys: quantized blocks of 8 tokens, twice the store's */
    qp.q_group_size = 8;
    qp.residual_length = 5;
    return qp;
}

static const struct variant *variants(size_t *n)
{
    static struct variant v[32];
    size_t k = 0;
    v[k++] = (struct variant){"dynamic", M_LLAMA, {.strategy = KV_DYNAMIC}, A_NONE};
    v[k++] = (struct variant){"static", M_LLAMA, {.strategy = KV_STATIC, .max_cache_len = 64}, A_NONE};
    v[k++] = (struct variant){"offloaded", M_LLAMA, {.strategy = KV_OFFLOADED}, A_NONE};
    v[k++] = (struct variant){"offloaded_static", M_LLAMA, {.strategy = KV_OFFLOADED_STATIC, .max_cache_len = 64},
                              A_NONE};
    v[k++] = (struct variant){"adaptive", M_QWEN2,
                              {.strategy = KV_OFFLOADED, .adaptive = true, .max_cache_len = 64}, A_NONE};
    v[k++] = (struct variant){"sliding dynamic", M_MISTRAL, {.strategy = KV_DYNAMIC}, A_NONE};
    v[k++] = (struct variant){"sliding static", M_MISTRAL, {.strategy = KV_STATIC, .max_cache_len = 64}, A_NONE};
    v[k++] = (struct variant){"hybrid dynamic", M_QWEN2, {.strategy = KV_DYNAMIC}, A_NONE};
    v[k++] = (struct variant){"hybrid offloaded_static", M_QWEN2,
                              {.strategy = KV_OFFLOADED_STATIC, .max_cache_len = 64}, A_NONE};
    v[k++] = (struct variant){"hybrid offloaded, sliding on the device", M_QWEN2,
                              {.strategy = KV_OFFLOADED, .offload_sliding = KV_OFFLOAD_SLIDING_NO}, A_NONE};
    v[k++] = (struct variant){"sliding_window", M_LLAMA, {.window_length = 8}, A_NONE};
    v[k++] = (struct variant){"sink evicting", M_LLAMA, {.sink = true, .window_length = 16, .num_sink_tokens = 2},
                              A_NONE};
    v[k++] = (struct variant){"sink growing", M_LLAMA, {.sink = true, .window_length = 64, .num_sink_tokens = 3},
                              A_NONE};
    v[k++] = (struct variant){"past recording", M_MISTRAL, {.strategy = KV_DYNAMIC}, A_RECORD};
    v[k++] = (struct variant){"dynamic after fallback", M_QWEN2, {.strategy = KV_DYNAMIC}, A_OFFLOAD};
    v[k++] = (struct variant){"static after fallback", M_LLAMA, {.strategy = KV_STATIC, .max_cache_len = 64},
                              A_OFFLOAD};
    v[k++] = (struct variant){"fork", M_LLAMA, {.strategy = KV_DYNAMIC}, A_FORK};
    v[k++] = (struct variant){"prefix match", M_LLAMA, {.strategy = KV_DYNAMIC}, A_PREFIX};
    v[k++] = (struct variant){"quantized quanto", M_LLAMA, {.strategy = KV_QUANTIZED, .quant = quanto()}, A_NONE};
    v[k++] = (struct variant){"quantized hqq per channel", M_LLAMA,
                              {.strategy = KV_QUANTIZED, .quant = hqq_channel()}, A_NONE};
    v[k++] = (struct variant){"quantized fp8", M_LLAMA,
                              {.strategy = KV_QUANTIZED, .quant = kv_quant_defaults(KVQ_FP8)}, A_NONE};
    v[k++] = (struct variant){"quantized, saved between its prompt's parts", M_LLAMA,
                              {.strategy = KV_QUANTIZED, .quant = quanto()}, A_PARTS};
    v[k++] = (struct variant){"quantized fp8, saved between its prompt's parts", M_LLAMA,
                              {.strategy = KV_QUANTIZED, .quant = kv_quant_defaults(KVQ_FP8)}, A_PARTS};
    v[k++] = (struct variant){"quantized offload", M_LLAMA,
                              {.strategy = KV_QUANTIZED, .quant = quanto(), .offload = true}, A_NONE};
    v[k++] = (struct variant){"quantized after fallback", M_LLAMA, {.strategy = KV_QUANTIZED, .quant = quanto()},
                              A_OFFLOAD};
    v[k++] = (struct variant){"quantized sliding", M_MISTRAL, {.strategy = KV_QUANTIZED, .quant = hqq_channel()},
                              A_NONE};
    v[k++] = (struct variant){"quantized sink", M_LLAMA,
                              {.strategy = KV_QUANTIZED, .quant = quanto(), .sink = true, .window_length = 16,
                               .num_sink_tokens = 2},
                              A_NONE};
    *n = k;
    return v;
}

static void test_roundtrip_every_state(void **state)
{
    (void)state;
    size_t n;
    const struct variant *v = variants(&n);
    for (size_t i = 0; i < n; i++)
        run_variant(&v[i]);
}

/* One image of model `which` with params p after the prompt. */
static uint8_t *image_of(struct rig *r, const struct kv_seq_params *p, size_t *size)
{
    float *row = malloc((size_t)r->V * sizeof(float));
    assert_non_null(row);
    int32_t ids[N_PROMPT];
    prompt(ids);
    kv_seq *q;
    assert_int_equal(kv_seq_create(r->store, p, &q), TIER_OK);
    feed(r, q, ids, N_PROMPT, row);
    uint8_t *img = save(r->store, q, size);
    kv_seq_free(q);
    free(row);
    return img;
}

static void expect_refused(kv_store *s, const uint8_t *img, size_t size, const char *field)
{
    struct kv_store_stats before = kv_store_stats(s);
    kv_seq *q = (kv_seq *)1;
    assert_int_equal(kv_seq_load(s, img, size, &q), TIER_EINVAL);
    assert_null(q);
    if (field && !strstr(kv_store_errmsg(s), field))
        fail_msg("the refusal names no %s: %s", field, kv_store_errmsg(s));
    struct kv_store_stats after = kv_store_stats(s);
    assert_int_equal(after.blocks_used, before.blocks_used);
    assert_int_equal(after.host_bytes, before.host_bytes);
}

/* A header field, where it is and a value that is wrong for it. */
struct corruption {
    const char *field;
    size_t off;
    int width; /* 4 or 8 */
    uint64_t value;
};

static void put_le(uint8_t *p, int width, uint64_t v)
{
    for (int i = 0; i < width; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void corrupt_each(kv_store *s, const uint8_t *img, size_t size, const struct corruption *c, size_t n)
{
    uint8_t *bad = malloc(size);
    assert_non_null(bad);
    for (size_t i = 0; i < n; i++) {
        memcpy(bad, img, size);
        put_le(bad + c[i].off, c[i].width, c[i].value);
        expect_refused(s, bad, size, c[i].field);
    }
    free(bad);
}

static void test_refusals(void **state)
{
    (void)state;
    struct rig r;
    rig_open_bt(&r, M_MISTRAL, BT, false);
    size_t size;
    uint8_t *img = image_of(&r, &(struct kv_seq_params){.strategy = KV_DYNAMIC}, &size);
    for (size_t n = 0; n < size; n++)
        expect_refused(r.store, img, n, NULL);
    static const struct corruption dense[] = {
        {"magic", 0, 4, 0x21212121},
        {"version", 8, 4, 1}, /* the format before the layer table */
        {"n_layers", 12, 4, 3},
        {"n_kv_heads", 16, 4, 1},
        {"head_dim", 20, 4, 32},
        {"dtype", 24, 4, BE_BF16},
        {"block_tokens", 28, 4, 16},
        {"strategy", 32, 4, 9},
        {"offload_sliding", 36, 4, 7},
        {"max_cache_len", 40, 8, UINT64_MAX},
        {"window_length", 48, 4, UINT32_MAX},
        {"param_flags", 64, 4, 1u << 7},
        {"quant.backend", 68, 4, 5},
        {"state.strategy", 92, 4, KV_OFFLOADED_STATIC},
        {"fallback", 96, 4, 3},
        {"state_flags", 100, 4, 1u << 5},
        {"len", 104, 8, (uint64_t)1 << 41},
        {"lo", 104, 8, N_PROMPT + 1}, /* a longer sequence would have dropped more */
        {"size", 112, 8, 12345},
        {"layer_window[1]", 124, 4, 9},
        {"lo", 128, 8, 3},
        {"nq", 136, 8, 1}, /* a dense layer's quantized fields are 0 */
        {"home", 152, 4, 2}, /* the host tier, for a dynamic sequence */
        {"reserved", 164, 4, 1},
    };
    corrupt_each(r.store, img, size, dense, sizeof(dense) / sizeof(dense[0]));
    uint8_t *extra = malloc(size + 1);
    assert_non_null(extra);
    memcpy(extra, img, size);
    put_le(extra + 112, 8, size + 1);
    expect_refused(r.store, extra, size + 1, "size");
    free(extra);
    /* another store's geometry: a full-attention model, other blocks */
    struct rig o;
    rig_open_bt(&o, M_LLAMA, BT, false);
    expect_refused(o.store, img, size, "layer_window[0]");
    kv_store_free(o.store);
    struct kv_geom g = model_kv_geom(r.m);
    assert_int_equal(kv_store_open(o.be, &g, &(struct kv_store_params){.block_tokens = 2 * BT}, &o.store), TIER_OK);
    expect_refused(o.store, img, size, "block_tokens");
    rig_close(&o);
    free(img);

    /* quantized fields */
    struct kv_seq_params qp = {.strategy = KV_QUANTIZED, .quant = quanto()};
    img = image_of(&r, &qp, &size);
    for (size_t n = 0; n < size; n++)
        expect_refused(r.store, img, n, NULL);
    size_t sec = 120 + 4 * 2;
    static const struct corruption quant[] = {
        {"cache.nbits", 72, 4, 5},
        {"cache.q_group_size", 84, 4, 0},
        {"cache.residual_length", 88, 4, UINT32_MAX},
    };
    corrupt_each(r.store, img, size, quant, sizeof(quant) / sizeof(quant[0]));
    struct corruption q2[] = {{"nq", sec + 8, 8, N_PROMPT + 1}, {"qoff", sec + 16, 8, 1}, {"lo", sec, 8, 1}};
    corrupt_each(r.store, img, size, q2, 3);
    free(img);
    rig_close(&r);
}

/* A load the device budget cannot hold continues in the host tier
 * (KV_FALLBACK_OOM) with the same logits; with no_fallback it fails. */
static void test_load_falls_back(void **state)
{
    (void)state;
    for (int nf = 0; nf < 2; nf++) {
        struct rig r;
        rig_open_bt(&r, M_LLAMA, BT, false);
        size_t bytes = (size_t)r.V * sizeof(float);
        float *row = malloc(bytes), *ref = malloc(N_AFTER * bytes);
        assert_true(row && ref);
        int32_t ids[N_PROMPT], toks[N_AFTER];
        prompt(ids);
        struct kv_seq_params p = {.strategy = KV_DYNAMIC, .no_fallback = nf};
        kv_seq *q;
        assert_int_equal(kv_seq_create(r.store, &p, &q), TIER_OK);
        feed(&r, q, ids, N_PROMPT, row);
        size_t size;
        uint8_t *img = save(r.store, q, &size);
        for (int i = 0; i < N_AFTER; i++) {
            toks[i] = argmax_f32(row, r.V);
            feed(&r, q, &toks[i], 1, row);
            memcpy(ref + (size_t)i * r.V, row, bytes);
        }
        kv_seq_free(q);
        kv_store_free(r.store); /* a fresh store: no pool blocks to reuse */
        struct kv_geom g = model_kv_geom(r.m);
        assert_int_equal(kv_store_open(r.be, &g, &(struct kv_store_params){.block_tokens = BT}, &r.store), TIER_OK);
        be_fault_dev_alloc(r.be, 1, true);
        enum tier_status st = kv_seq_load(r.store, img, size, &q);
        be_fault_dev_alloc(r.be, 0, false);
        if (nf) {
            assert_int_equal(st, TIER_ENOMEM_DEV);
            assert_null(q);
            assert_int_equal(kv_store_stats(r.store).host_bytes, 0);
            assert_int_equal(kv_store_stats(r.store).blocks_used, 0);
        } else {
            assert_int_equal(st, TIER_OK);
            struct kv_seq_stats ss = kv_seq_stats(q);
            assert_int_equal(ss.strategy, KV_OFFLOADED);
            assert_int_equal(ss.fallback, KV_FALLBACK_OOM);
            assert_int_equal(ss.resident_layers, 0);
            assert_int_equal(kv_store_stats(r.store).fallbacks, 1);
            for (int i = 0; i < N_AFTER; i++) {
                feed(&r, q, &toks[i], 1, row);
                if (memcmp(row, ref + (size_t)i * r.V, bytes))
                    fail_msg("logits after a fallback load differ at token %d", i);
            }
        }
        kv_seq_free(q);
        free(img);
        free(row);
        free(ref);
        rig_close(&r);
    }
}

/* A block's rows of positions the layer does not store must be zero: a
 * 21-token sequence of 4-token blocks has three such rows in its last
 * block, the image's last bytes. */
static void test_unstored_rows(void **state)
{
    (void)state;
    struct rig r;
    rig_open_bt(&r, M_LLAMA, BT, false);
    float *row = malloc((size_t)r.V * sizeof(float));
    assert_non_null(row);
    int32_t ids[N_PROMPT + 1];
    prompt(ids);
    ids[N_PROMPT] = 7;
    kv_seq *q;
    assert_int_equal(kv_seq_create(r.store, &(struct kv_seq_params){.strategy = KV_DYNAMIC}, &q), TIER_OK);
    feed(&r, q, ids, N_PROMPT + 1, row);
    size_t size;
    uint8_t *img = save(r.store, q, &size);
    kv_seq_free(q);
    struct kv_geom g = model_kv_geom(r.m);
    size_t hrow = (size_t)g.head_dim * be_dtype_size(g.dtype), block = 2 * (size_t)g.n_kv_heads * BT * hrow;
    uint8_t *last = img + size - block;
    for (int t = 0; t < BT; t++) { /* V of the last head, row t */
        uint8_t *x = last + ((size_t)(2 * g.n_kv_heads - 1) * BT + (size_t)t) * hrow + hrow - 1;
        uint8_t was = *x;
        *x ^= 0x40;
        struct kv_store_stats before = kv_store_stats(r.store);
        enum tier_status st = kv_seq_load(r.store, img, size, &q);
        if (t == 0) { /* position 20 is stored: a different value, still an image */
            assert_int_equal(st, TIER_OK);
            kv_seq_free(q);
        } else {
            assert_int_equal(st, TIER_EINVAL);
            assert_null(q);
            assert_non_null(strstr(kv_store_errmsg(r.store), "blocks"));
        }
        assert_int_equal(kv_store_stats(r.store).blocks_used, before.blocks_used);
        *x = was;
    }
    free(img);
    free(row);
    rig_close(&r);
}

/* An image arriving in order: wait() hands out the bytes so far and
 * records the most any fill asked for; fail_from makes the bytes from
 * there on never arrive. */
struct arrival {
    const uint8_t *img;
    size_t size, asked, fail_from;
    int calls;
};

static const void *arrive(void *arg, size_t n)
{
    struct arrival *a = arg;
    assert_true(n <= a->size);
    a->calls++;
    if (n > a->asked)
        a->asked = n;
    return n > a->fail_from ? NULL : a->img;
}

static void test_load_by_layer(void **state)
{
    (void)state;
    const struct kv_seq_params ps[] = {
        {.strategy = KV_DYNAMIC},
        {.strategy = KV_OFFLOADED}, /* the copy-in of the next layer fills it first */
        {.strategy = KV_OFFLOADED_STATIC, .max_cache_len = 64},
        {.strategy = KV_QUANTIZED, .quant = quanto(), .offload = true},
    };
    for (size_t v = 0; v < sizeof(ps) / sizeof(ps[0]); v++) {
        struct rig r;
        rig_open_bt(&r, M_LLAMA, BT, false);
        size_t bytes = (size_t)r.V * sizeof(float);
        float *row = malloc(bytes), *ref = malloc(bytes);
        assert_true(row && ref);
        int32_t ids[N_PROMPT];
        prompt(ids);
        kv_seq *q;
        assert_int_equal(kv_seq_create(r.store, &ps[v], &q), TIER_OK);
        feed(&r, q, ids, N_PROMPT, row);
        size_t size;
        uint8_t *img = save(r.store, q, &size);
        int32_t tok = argmax_f32(row, r.V);
        feed(&r, q, &tok, 1, ref);
        kv_seq_free(q);

        /* the head alone is enough to allocate; nothing is read yet */
        size_t head = kv_image_head_size(r.store);
        uint8_t *h = malloc(head);
        assert_non_null(h);
        memcpy(h, img, head);
        struct arrival a = {.img = img, .size = size, .fail_from = SIZE_MAX};
        struct kv_image_src src = {arrive, &a};
        assert_int_equal(kv_seq_load_begin(r.store, h, size, &src, &q), TIER_OK);
        free(h);
        assert_true(kv_seq_loading(q));
        assert_int_equal(a.calls, 0);
        /* one step fills every layer, in order, as it reaches them */
        feed(&r, q, &tok, 1, row);
        assert_int_equal(a.calls, 2);
        assert_int_equal(a.asked, size);
        assert_false(kv_seq_loading(q));
        if (memcmp(row, ref, bytes))
            fail_msg("variant %zu: logits after a load by layer differ", v);
        kv_seq_free(q);

        /* the layers' bytes never arrive: the step fails, so
         * does every later fill, and the store gets everything back */
        struct kv_store_stats before = kv_store_stats(r.store);
        a = (struct arrival){.img = img, .size = size, .fail_from = head + 1};
        assert_int_equal(kv_seq_load_begin(r.store, img, size, &src, &q), TIER_OK);
        struct fw_seq fs = {.kv = q, .tokens = &tok, .n_tokens = 1, .logits = row};
        assert_int_not_equal(model_forward(r.m, &fs, 1), MODEL_OK);
        assert_int_equal(kv_seq_load_status(q), TIER_EIO);
        assert_false(kv_seq_loading(q));
        assert_int_equal(kv_seq_length(q), N_PROMPT);
        int calls = a.calls;
        assert_int_equal(kv_seq_load_finish(q), TIER_EIO);
        assert_int_equal(a.calls, calls);
        kv_seq_free(q);
        assert_int_equal(kv_store_stats(r.store).blocks_used, before.blocks_used);
        assert_int_equal(kv_store_stats(r.store).host_bytes, before.host_bytes);
        free(img);
        free(row);
        free(ref);
        rig_close(&r);
    }
}


int main(void)
{
    if (make_models(model_args, N_MODELS) != 0) {
        fprintf(stderr, "test_image: tools/mkmodel.py failed (no torch?): skipping\n");
        cleanup();
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrip_every_state),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_load_falls_back),
        cmocka_unit_test(test_unstored_rows),
        cmocka_unit_test(test_load_by_layer),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    cleanup();
    return rc;
}
