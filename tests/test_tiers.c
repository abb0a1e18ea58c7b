/* Description: the tiers under a real forward pass (one file over 1,000
 * lines: every test shares the rig of a real model and store below):
 * identical tokens and bit-identical logits for dynamic, static, offloaded,
 * offloaded_static and adaptive residency, with full, all-sliding and
 * hybrid models, multi-chunk prefills and mixed batches; the SQLite-style
 * device-allocation fault sweep (fail once, fail from N on); a request
 * needing 4x the device budget; the peak device bytes of offloaded mode;
 * host-tier exhaustion; the measured prefetch figures; forks of device
 * extents that fall back to the host tier.
 * The models are random ones from tools/mkmodel.py (skip without it).
 * Every test runs twice: with f32 KV, then with bf16 KV (the default of a
 * bf16 model), where the strategies store the same bf16 values and must
 * still agree bit for bit.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "model/generate.h"
#include "model/model.h"
#include "tiers/quant.h"
#include "tests/python.h"
#include "util/argmax.h"

#define N_PROMPT 20
#define N_GEN 64
#define CHUNK 8 /* rows per forward chunk: the prompt takes three */

static char g_dir[] = "/tmp/kvtier-tiers-XXXXXX";
static enum model_kv_dtype g_kv; /* the pass's KV dtype (the models are f32) */

enum { M_LLAMA, M_MISTRAL, M_QWEN2, M_DEEP, M_LLAMA_W8, M_PHI3_LONG, N_MODELS };
static const char *const model_args[N_MODELS] = {
    [M_LLAMA] = "--arch llama --layers 2 --dim 64 --heads 4 --kv-heads 2 --ffn 128 --vocab 320",
    [M_MISTRAL] = "--arch mistral --layers 2 --dim 64 --heads 4 --kv-heads 2 --ffn 128 --vocab 320 --window 8",
    [M_QWEN2] = "--arch qwen2 --layers 3 --dim 64 --heads 4 --kv-heads 2 --ffn 128 --vocab 320 --window 8 "
                "--max-window-layers 1",
    [M_DEEP] = "--arch llama --layers 8 --dim 32 --heads 2 --kv-heads 1 --ffn 64 --vocab 320",
    /* M_LLAMA's weights (its seed) as a Mistral sliding every layer by 8:
     * the reference for M_LLAMA under the sliding_window strategy */
    [M_LLAMA_W8] = "--arch mistral --layers 2 --dim 64 --heads 4 --kv-heads 2 --ffn 128 --vocab 320 --window 8 --seed 7",
    /* longrope whose long_factor starts past 40 positions: a run of
     * N_PROMPT + N_GEN tokens crosses it at decode step 21 */
    [M_PHI3_LONG] = "--arch phi3 --layers 2 --dim 64 --heads 4 --kv-heads 2 --ffn 128 --vocab 320 "
                    "--rope-scaling longrope --max-pos 96 --orig-max-pos 40",
};

static void model_path(int which, char *out, size_t cap)
{
    snprintf(out, cap, "%s/m%d", g_dir, which);
}

static int make_models(void)
{
    if (!mkdtemp(g_dir))
        return -1;
    for (int i = 0; i < N_MODELS; i++) {
        char dir[128], cmd[512];
        model_path(i, dir, sizeof(dir));
        snprintf(cmd, sizeof(cmd), "%s tools/mkmodel.py --out %s --seed %d %s > /dev/null 2>&1", test_python(), dir,
                 7 + i, model_args[i]);
        if (system(cmd) != 0)
            return -1;
    }
    return 0;
}

/* A backend with a device budget and the model loaded on it. */
struct rig {
    be_backend *be;
    model *m;
    kv_store *store;
    size_t act_bytes; /* device bytes of the model's activations */
};

static void rig_open_dir(struct rig *r, const char *dir, size_t device_mem, size_t host_mem)
{
    char err[MODEL_ERR_LEN];
    struct be_params bp = {.n_threads = 1, .device_mem = device_mem};
    assert_int_equal(be_open("cpu", &bp, &r->be), BE_OK);
    struct model_params mp = {.max_batch_tokens = CHUNK, .kv_dtype = g_kv};
    enum model_status st = model_load(dir, r->be, &mp, &r->m, err);
    if (st != MODEL_OK)
        fail_msg("model_load %s: %s", dir, err);
    r->act_bytes = be_mem_stats(r->be).dev_used;
    struct kv_geom g = model_kv_geom(r->m);
    struct kv_store_params sp = {.host_mem = host_mem};
    assert_int_equal(kv_store_open(r->be, &g, &sp, &r->store), TIER_OK);
    assert_int_equal(kv_store_dtype(r->store), g_kv == MODEL_KV_BF16 ? BE_BF16 : BE_F32);
}

static void rig_open(struct rig *r, int which, size_t device_mem, size_t host_mem)
{
    char dir[128];
    model_path(which, dir, sizeof(dir));
    rig_open_dir(r, dir, device_mem, host_mem);
}

static void rig_close(struct rig *r)
{
    kv_store_free(r->store);
    model_free(r->m);
    be_free(r->be);
}

static int vocab(const struct rig *r)
{
    return model_get_config(r->m)->vocab_size;
}

static void prompt_of(int salt, int32_t *ids)
{
    for (int i = 0; i < N_PROMPT; i++)
        ids[i] = (int32_t)((i * 37 + salt * 101 + 3) % 300 + 4);
}

/* Greedy prefill + N_GEN decode steps on q: toks[N_GEN], logits[N_GEN][vocab]
 * (NULL = not kept).  Returns the first failing status. */
static enum model_status greedy(struct rig *r, kv_seq *q, int salt, int32_t *toks, float *logits)
{
    int V = vocab(r);
    float *row = malloc((size_t)V * sizeof(float));
    assert_non_null(row);
    int32_t ids[N_PROMPT];
    prompt_of(salt, ids);
    struct fw_seq fs = {.kv = q, .tokens = ids, .n_tokens = N_PROMPT, .logits = row};
    enum model_status st = model_forward(r->m, &fs, 1);
    for (int i = 0; i < N_GEN && st == MODEL_OK; i++) {
        toks[i] = argmax_f32(row, V);
        if (logits)
            memcpy(logits + (size_t)i * V, row, (size_t)V * sizeof(float));
        fs = (struct fw_seq){.kv = q, .tokens = &toks[i], .n_tokens = 1, .logits = row};
        if (i + 1 < N_GEN)
            st = model_forward(r->m, &fs, 1);
    }
    free(row);
    return st;
}

struct clean {
    int32_t toks[N_GEN];
    float *logits;
};

static void clean_run(int which, int salt, struct clean *c)
{
    struct rig r;
    rig_open(&r, which, 0, 0);
    kv_seq *q;
    assert_int_equal(kv_seq_create(r.store, NULL, &q), TIER_OK);
    c->logits = malloc((size_t)N_GEN * vocab(&r) * sizeof(float));
    assert_non_null(c->logits);
    assert_int_equal(greedy(&r, q, salt, c->toks, c->logits), MODEL_OK);
    kv_seq_free(q);
    rig_close(&r);
}

static const struct kv_seq_params variants[] = {
    {.strategy = KV_STATIC, .max_cache_len = N_PROMPT + N_GEN},
    {.strategy = KV_OFFLOADED},
    {.strategy = KV_OFFLOADED_STATIC, .max_cache_len = N_PROMPT + N_GEN},
    {.strategy = KV_OFFLOADED, .offload_sliding = KV_OFFLOAD_SLIDING_NO},
    {.strategy = KV_OFFLOADED_STATIC, .max_cache_len = 100, .offload_sliding = KV_OFFLOAD_SLIDING_YES},
    {.strategy = KV_OFFLOADED, .adaptive = true, .max_cache_len = N_PROMPT + N_GEN},
};
#define N_VARIANTS (sizeof(variants) / sizeof(variants[0]))

/* Test 1: every strategy gives the dynamic run's tokens and logits, bit
 * for bit (the same values reach attention in the same order). */
static void test_strategies_identical(void **state)
{
    (void)state;
    for (int which = M_LLAMA; which <= M_QWEN2; which++) {
        struct clean c;
        clean_run(which, which, &c);
        struct rig r;
        rig_open(&r, which, 0, 0);
        size_t bytes = (size_t)N_GEN * vocab(&r) * sizeof(float);
        float *logits = malloc(bytes);
        assert_non_null(logits);
        for (size_t v = 0; v < N_VARIANTS; v++) {
            kv_seq *q;
            int32_t toks[N_GEN];
            assert_int_equal(kv_seq_create(r.store, &variants[v], &q), TIER_OK);
            assert_int_equal(greedy(&r, q, which, toks, logits), MODEL_OK);
            if (memcmp(toks, c.toks, sizeof(toks)) || memcmp(logits, c.logits, bytes))
                fail_msg("model %d, %s variant %zu differs from dynamic", which,
                         kv_strategy_name(variants[v].strategy), v);
            struct kv_seq_stats ss = kv_seq_stats(q);
            assert_int_equal(ss.fallback, KV_FALLBACK_NONE);
            if (v == 1) { /* plain offloaded streams every layer of every step */
                assert_true(ss.xfer.steps == N_GEN);
                assert_true(ss.xfer.bytes_h2d > 0 && ss.xfer.bytes_d2h > 0);
            }
            kv_seq_free(q);
        }
        free(logits);
        free(c.logits);
        rig_close(&r);
    }
}

/* Test 1, batched: one forward step over sequences with different
 * strategies (one slot holds every streamed sequence's layer) gives each
 * the tokens it gets alone. */
static void test_mixed_batch(void **state)
{
    (void)state;
    enum { B = 3 };
    struct clean c[B];
    for (int i = 0; i < B; i++)
        clean_run(M_QWEN2, 10 + i, &c[i]);
    struct rig r;
    rig_open(&r, M_QWEN2, 0, 0);
    int V = vocab(&r);
    const struct kv_seq_params ps[B] = {
        {.strategy = KV_OFFLOADED},
        {.strategy = KV_DYNAMIC},
        {.strategy = KV_OFFLOADED_STATIC, .max_cache_len = 128, .offload_sliding = KV_OFFLOAD_SLIDING_YES},
    };
    kv_seq *q[B];
    int32_t ids[B][N_PROMPT], toks[B][N_GEN];
    float *rows = malloc((size_t)B * V * sizeof(float));
    assert_non_null(rows);
    struct fw_seq fs[B];
    for (int i = 0; i < B; i++) {
        assert_int_equal(kv_seq_create(r.store, &ps[i], &q[i]), TIER_OK);
        prompt_of(10 + i, ids[i]);
        fs[i] = (struct fw_seq){.kv = q[i], .tokens = ids[i], .n_tokens = N_PROMPT, .logits = rows + i * V};
    }
    assert_int_equal(model_forward(r.m, fs, B), MODEL_OK);
    for (int t = 0; t < N_GEN; t++) {
        for (int i = 0; i < B; i++) {
            toks[i][t] = argmax_f32(rows + i * V, V);
            fs[i] = (struct fw_seq){.kv = q[i], .tokens = &toks[i][t], .n_tokens = 1, .logits = rows + i * V};
        }
        if (t + 1 < N_GEN)
            assert_int_equal(model_forward(r.m, fs, B), MODEL_OK);
    }
    for (int i = 0; i < B; i++) {
        assert_memory_equal(toks[i], c[i].toks, sizeof(toks[i]));
        kv_seq_free(q[i]);
        free(c[i].logits);
    }
    free(rows);
    rig_close(&r);
}

/* Test 1, longrope: two sequences LAG steps apart share every step, so for
 * 12 steps one has passed original_max_position_embeddings and the other
 * not; each must rotate with its own table (long_factor for the first
 * only) and get the logits it gets alone. */
static void test_longrope_batch(void **state)
{
    (void)state;
    enum { B = 2, LAG = 12 };
    struct clean c[B];
    for (int i = 0; i < B; i++)
        clean_run(M_PHI3_LONG, 20 + i, &c[i]);
    struct rig r;
    rig_open(&r, M_PHI3_LONG, 0, 0);
    int V = vocab(&r);
    kv_seq *q[B];
    int32_t ids[B][N_PROMPT], toks[B][N_GEN];
    float *rows = malloc((size_t)B * V * sizeof(float));
    assert_non_null(rows);
    for (int i = 0; i < B; i++) {
        assert_int_equal(kv_seq_create(r.store, NULL, &q[i]), TIER_OK);
        prompt_of(20 + i, ids[i]);
    }
    double worst = 0.0;
    for (int step = 0; step < N_GEN + LAG; step++) {
        struct fw_seq fs[B];
        int n = 0, which[B];
        for (int i = 0; i < B; i++) {
            int t = step - i * LAG; /* sequence i's own step */
            if (t < 0 || t >= N_GEN)
                continue;
            which[n] = i;
            fs[n++] = (struct fw_seq){.kv = q[i], .tokens = t ? &toks[i][t - 1] : ids[i], .n_tokens = t ? 1 : N_PROMPT,
                                      .logits = rows + i * V};
        }
        assert_int_equal(model_forward(r.m, fs, n), MODEL_OK);
        for (int k = 0; k < n; k++) {
            int i = which[k], t = step - i * LAG;
            const float *want = c[i].logits + (size_t)t * V, *got = rows + i * V;
            for (int v = 0; v < V; v++)
                worst = fmax(worst, fabs((double)got[v] - want[v]));
            toks[i][t] = argmax_f32(got, V);
        }
    }
    if (worst > 1e-5)
        fail_msg("batched longrope logits differ from the runs alone by %.3g", worst);

    /* A prefill of 44 tokens (past 40) fed in two steps, as the daemon
     * chunks it: with call_len 44 both chunks take long_factor, as one
     * forward call over the 44 does; without it the first chunk (30 tokens)
     * takes short_factor. */
    enum { H = 44, FIRST = 30 };
    int32_t hist[H];
    memcpy(hist, ids[0], sizeof(ids[0]));
    memcpy(hist + N_PROMPT, c[0].toks, (H - N_PROMPT) * sizeof(int32_t));
    double diff[3];
    for (int how = 0; how < 3; how++) { /* one call, chunked with call_len, chunked without */
        kv_seq *h;
        assert_int_equal(kv_seq_create(r.store, NULL, &h), TIER_OK);
        int64_t call = how == 1 ? H : 0;
        if (how) {
            struct fw_seq f = {.kv = h, .tokens = hist, .n_tokens = FIRST, .logits = rows + V, .call_len = call};
            assert_int_equal(model_forward(r.m, &f, 1), MODEL_OK);
        }
        int from = how ? FIRST : 0;
        struct fw_seq f = {.kv = h, .tokens = hist + from, .n_tokens = H - from, .logits = rows + (how ? V : 0),
                           .call_len = call};
        assert_int_equal(model_forward(r.m, &f, 1), MODEL_OK);
        diff[how] = 0.0;
        for (int v = 0; v < V; v++)
            diff[how] = fmax(diff[how], fabs((double)rows[V + v] - rows[v]));
        kv_seq_free(h);
    }
    if (diff[1] > 1e-5 || diff[2] < 1e-3)
        fail_msg("chunked longrope prefill vs one call: %.3g with call_len, %.3g without", diff[1], diff[2]);

    for (int i = 0; i < B; i++) {
        assert_memory_equal(toks[i], c[i].toks, sizeof(toks[i]));
        kv_seq_free(q[i]);
        free(c[i].logits);
    }
    free(rows);
    rig_close(&r);
}

static int64_t is_static_len(enum kv_strategy st)
{
    return st == KV_STATIC || st == KV_OFFLOADED_STATIC ? N_PROMPT + N_GEN : 0;
}

/* Test 2: fail the Nth device allocation of a whole request for every N it
 * reaches, once and from N on.  Each run gives the clean tokens or stops
 * with the device error and a message; nothing leaks (ASan run). */
static void sweep(enum kv_strategy strategy, bool repeat, const struct clean *c)
{
    int32_t toks[N_GEN];
    for (uint64_t n = 1;; n++) {
        struct rig r;
        rig_open(&r, M_LLAMA, 0, 0);
        kv_seq *q = NULL;
        struct kv_seq_params p = {.strategy = strategy, .max_cache_len = is_static_len(strategy)};
        uint64_t failures = be_mem_stats(r.be).dev_failures;
        be_fault_dev_alloc(r.be, n, repeat);
        enum tier_status ts = kv_seq_create(r.store, &p, &q);
        enum model_status st = ts == TIER_OK ? greedy(&r, q, M_LLAMA, toks, NULL) : MODEL_EDEVMEM;
        bool reached = be_mem_stats(r.be).dev_failures > failures;
        be_fault_dev_alloc(r.be, 0, false);
        if (st == MODEL_OK) {
            if (memcmp(toks, c->toks, sizeof(toks)))
                fail_msg("%s, fault at allocation %llu%s: tokens differ", kv_strategy_name(strategy),
                         (unsigned long long)n, repeat ? " on" : "");
        } else {
            assert_true(repeat);
            assert_int_equal(st, MODEL_EDEVMEM);
            assert_true(strlen(kv_store_errmsg(r.store)) > 0);
        }
        kv_seq_free(q);
        assert_int_equal(kv_store_stats(r.store).host_bytes, 0);
        assert_int_equal(kv_store_stats(r.store).blocks_used, 0);
        rig_close(&r);
        if (!reached)
            break;
    }
}

static void test_fault_sweep(void **state)
{
    (void)state;
    struct clean c;
    clean_run(M_LLAMA, M_LLAMA, &c);
    const enum kv_strategy sts[] = {KV_DYNAMIC, KV_STATIC, KV_OFFLOADED, KV_OFFLOADED_STATIC};
    for (size_t i = 0; i < sizeof(sts) / sizeof(sts[0]); i++) {
        sweep(sts[i], false, &c);
        sweep(sts[i], true, &c);
    }
    free(c.logits);
}

/* KV bytes of one layer of the deep model holding n tokens. */
static size_t layer_kv_bytes(const struct rig *r, int64_t n)
{
    const struct model_config *c = model_get_config(r->m);
    int bt = kv_store_block_tokens(r->store);
    size_t block = 2 * (size_t)c->n_kv_heads * (size_t)bt * (size_t)c->head_dim * be_dtype_size(kv_store_dtype(r->store));
    return (size_t)((n + bt - 1) / bt) * block;
}

/* Test 3: a request whose KV is 4x what the device has left after the
 * activations completes, moved to the host tier, with the clean tokens. */
static void test_four_times_the_budget(void **state)
{
    (void)state;
    struct clean c;
    clean_run(M_DEEP, 1, &c);
    struct rig probe;
    rig_open(&probe, M_DEEP, 0, 0);
    size_t kv = (size_t)model_get_config(probe.m)->n_layers * layer_kv_bytes(&probe, N_PROMPT + N_GEN);
    size_t act = probe.act_bytes;
    rig_close(&probe);

    struct rig r;
    rig_open(&r, M_DEEP, act + kv / 4, 0);
    kv_seq *q;
    int32_t toks[N_GEN];
    assert_int_equal(kv_seq_create(r.store, NULL, &q), TIER_OK);
    assert_int_equal(greedy(&r, q, 1, toks, NULL), MODEL_OK);
    assert_memory_equal(toks, c.toks, sizeof(toks));
    struct kv_seq_stats ss = kv_seq_stats(q);
    assert_int_equal(ss.fallback, KV_FALLBACK_OOM);
    assert_int_equal(ss.strategy, KV_OFFLOADED);
    assert_int_equal(kv_store_stats(r.store).fallbacks, 1);
    assert_int_equal(kv_store_stats(r.store).fallbacks_oom, 1);
    assert_true(be_mem_stats(r.be).dev_peak <= act + kv / 4);
    /* With nothing left in the host tier the two streaming slots go back
     * to the device, or one fallback would keep two layers' worth of device
     * memory and push later requests to the host tier too. */
    size_t with_slots = be_mem_stats(r.be).dev_used;
    kv_seq_free(q);
    assert_int_equal(kv_store_stats(r.store).host_bytes, 0);
    assert_true(be_mem_stats(r.be).dev_used + 2 * layer_kv_bytes(&r, N_PROMPT + N_GEN) <= with_slots);
    rig_close(&r);

    /* announced up front: starts offloaded without a failed step */
    rig_open(&r, M_DEEP, act + kv / 4, 0);
    struct kv_seq_params p = {.max_cache_len = N_PROMPT + N_GEN};
    assert_int_equal(kv_seq_create(r.store, &p, &q), TIER_OK);
    assert_int_equal(kv_seq_stats(q).fallback, KV_FALLBACK_SIZED);
    assert_int_equal(greedy(&r, q, 1, toks, NULL), MODEL_OK);
    assert_memory_equal(toks, c.toks, sizeof(toks));
    assert_int_equal(kv_seq_stats(q).fallback, KV_FALLBACK_SIZED);
    assert_int_equal(kv_store_stats(r.store).fallbacks, 1);
    assert_int_equal(kv_store_stats(r.store).fallbacks_oom, 0);
    kv_seq_free(q);
    rig_close(&r);
    free(c.logits);
}

/* generate() passes a device-budget refusal on as one (MODEL_EDEVMEM,
 * the store's message naming the budget), not as a bad argument. */
static void test_generate_device_refusal(void **state)
{
    (void)state;
    struct rig probe;
    rig_open(&probe, M_DEEP, 0, 0);
    size_t act = probe.act_bytes;
    rig_close(&probe);
    struct rig r;
    rig_open(&r, M_DEEP, act + 1, 0);
    struct kv_seq_params kp = {.strategy = KV_STATIC, .max_cache_len = N_PROMPT + N_GEN, .no_fallback = true};
    struct gen_params gp;
    gen_params_default(&gp);
    gp.max_new_tokens = N_GEN;
    gp.kv = &kp;
    int32_t prompt[N_PROMPT];
    for (int i = 0; i < N_PROMPT; i++)
        prompt[i] = 3 + i;
    struct gen_result res = {0};
    char err[MODEL_ERR_LEN];
    assert_int_equal(generate(r.m, NULL, r.store, prompt, N_PROMPT, &gp, NULL, NULL, &res, err), MODEL_EDEVMEM);
    assert_non_null(strstr(err, "device"));
    gen_seq_free(&res.seq);
    rig_close(&r);
}

/* Test 4: offloaded, the device holds the activations and two layers of
 * KV at most (the pool measures the peak), each streaming slot rounded up
 * to a whole number of 4 blocks when the budget allows (tiers/stream.c). */
static void test_offloaded_peak(void **state)
{
    (void)state;
    struct rig r;
    rig_open(&r, M_DEEP, 0, 0);
    int64_t unit = 4 * kv_store_block_tokens(r.store), n = N_PROMPT + N_GEN;
    kv_seq *q;
    int32_t toks[N_GEN];
    struct kv_seq_params p = {.strategy = KV_OFFLOADED};
    assert_int_equal(kv_seq_create(r.store, &p, &q), TIER_OK);
    be_reset_peak(r.be);
    assert_int_equal(greedy(&r, q, 2, toks, NULL), MODEL_OK);
    size_t two_layers = 2 * layer_kv_bytes(&r, (n + unit - 1) / unit * unit);
    assert_true(be_mem_stats(r.be).dev_peak <= r.act_bytes + two_layers);
    assert_int_equal(kv_seq_stats(q).dev_bytes, 0);
    kv_seq_free(q);
    rig_close(&r);
}

/* Test 6: when the host tier cannot take the KV either, the step fails
 * with an error naming the host budget, the sequence is as it was, and
 * the same step succeeds once host memory is returned. */
static void test_host_exhausted(void **state)
{
    (void)state;
    struct rig probe;
    rig_open(&probe, M_DEEP, 0, 0);
    int L = model_get_config(probe.m)->n_layers;
    size_t act = probe.act_bytes, layer = layer_kv_bytes(&probe, N_PROMPT + N_GEN);
    size_t block = layer_kv_bytes(&probe, 1);
    rig_close(&probe);

    /* the device holds two slots but not the prompt's blocks in every
     * layer; the host holds one offloaded_static request plus one layer:
     * less than the prompt's blocks in every layer, enough for the copy of
     * the last extent a growing request replaces */
    struct rig r;
    rig_open(&r, M_DEEP, act + 2 * layer + block, (size_t)(L + 1) * layer);
    kv_seq *a, *b;
    struct kv_seq_params off = {.strategy = KV_OFFLOADED_STATIC, .max_cache_len = N_PROMPT + N_GEN};
    int32_t toks[N_GEN];
    assert_int_equal(kv_seq_create(r.store, &off, &a), TIER_OK);
    assert_int_equal(greedy(&r, a, 3, toks, NULL), MODEL_OK);
    assert_int_equal(kv_seq_create(r.store, NULL, &b), TIER_OK);
    int32_t ids[N_PROMPT];
    prompt_of(4, ids);
    float *row = malloc((size_t)vocab(&r) * sizeof(float));
    assert_non_null(row);
    struct fw_seq fs = {.kv = b, .tokens = ids, .n_tokens = N_PROMPT, .logits = row};
    enum model_status st = model_forward(r.m, &fs, 1);
    assert_int_equal(st, MODEL_ENOMEM);
    assert_non_null(strstr(kv_store_errmsg(r.store), "host tier budget"));
    assert_int_equal(kv_seq_length(b), 0);
    kv_seq_free(a);
    kv_seq_free(b);

    /* the same request on a fresh sequence now fits and is the clean run */
    struct clean c;
    clean_run(M_DEEP, 4, &c);
    assert_int_equal(kv_seq_create(r.store, NULL, &b), TIER_OK);
    assert_int_equal(greedy(&r, b, 4, toks, NULL), MODEL_OK);
    assert_memory_equal(toks, c.toks, sizeof(toks));
    kv_seq_free(b);
    free(c.logits);
    free(row);
    rig_close(&r);
}

/* The figures: every streamed step moves about one read of the KV in
 * (plus the written blocks out), and the copy time is measured. */
static void test_prefetch_figures(void **state)
{
    (void)state;
    struct rig r;
    rig_open(&r, M_DEEP, 0, 0);
    kv_seq *q;
    int32_t toks[N_GEN];
    struct kv_seq_params p = {.strategy = KV_OFFLOADED};
    assert_int_equal(kv_seq_create(r.store, &p, &q), TIER_OK);
    assert_int_equal(greedy(&r, q, 5, toks, NULL), MODEL_OK);
    struct kv_store_stats s = kv_store_stats(r.store);
    int L = model_get_config(r.m)->n_layers;
    /* the last step read the blocks of the 83 tokens before it per layer
     * and wrote one */
    assert_int_equal(s.last_step.bytes_h2d, (uint64_t)L * layer_kv_bytes(&r, N_PROMPT + N_GEN - 1));
    assert_int_equal(s.last_step.bytes_d2h, (uint64_t)L * layer_kv_bytes(&r, 1));
    assert_int_equal(s.last_step.tokens, 1);
    assert_true(s.xfer.transfer_s > 0);
    assert_true(s.xfer.compute_s > 0);
    kv_seq_free(q);
    rig_close(&r);
}

/* Feeds tokens[0, n) to q in one step; row gets the last token's logits. */
static void feed(struct rig *r, kv_seq *q, const int32_t *tokens, int n, float *row)
{
    struct fw_seq fs = {.kv = q, .tokens = tokens, .n_tokens = n, .logits = row};
    assert_int_equal(model_forward(r->m, &fs, 1), MODEL_OK);
}

/* Greedy decoding of n tokens from the logits in row (which it reuses). */
static void decode(struct rig *r, kv_seq *q, float *row, int n, int32_t *toks)
{
    for (int i = 0; i < n; i++) {
        toks[i] = argmax_f32(row, vocab(r));
        feed(r, q, &toks[i], 1, row);
    }
}

/* The prompt toks[0, N_PROMPT), then n greedy tokens appended to toks,
 * keeping every step's logits: logits[n + 1][vocab]. */
static void greedy_logits(struct rig *r, kv_seq *q, int32_t *toks, int n, float *logits)
{
    int nv = vocab(r);
    feed(r, q, toks, N_PROMPT, logits);
    for (int i = 0; i < n; i++) {
        toks[N_PROMPT + i] = argmax_f32(logits + (size_t)i * nv, nv);
        feed(r, q, &toks[N_PROMPT + i], 1, logits + (size_t)(i + 1) * nv);
    }
}

/* Crop then regenerate gives the tokens and logits of never having
 * generated the cropped tokens, for every strategy crop applies to; a
 * sliding model needs past recording (refused without it, and on static
 * strategies whose sliding layers are fixed). */
static void test_crop_regenerate(void **state)
{
    (void)state;
    enum { K = 12, J = 7 };
    static const struct kv_seq_params crop_variants[] = {
        {.strategy = KV_DYNAMIC},
        {.strategy = KV_STATIC, .max_cache_len = N_PROMPT + N_GEN},
        {.strategy = KV_OFFLOADED},
        {.strategy = KV_OFFLOADED_STATIC, .max_cache_len = N_PROMPT + N_GEN},
    };
    for (int which = M_LLAMA; which <= M_MISTRAL; which++) {
        struct clean c;
        clean_run(which, which, &c);
        struct rig r;
        rig_open(&r, which, 0, 0);
        int V = vocab(&r);
        float *row = malloc((size_t)V * sizeof(float));
        assert_non_null(row);
        int32_t ids[N_PROMPT], garbage[J];
        prompt_of(which, ids);
        for (int j = 0; j < J; j++)
            garbage[j] = (int32_t)(j * 13 + 5);
        for (size_t v = 0; v < sizeof(crop_variants) / sizeof(crop_variants[0]); v++) {
            kv_seq *q;
            assert_int_equal(kv_seq_create(r.store, &crop_variants[v], &q), TIER_OK);
            enum tier_status rec = kv_seq_activate_past_recording(q);
            bool sliding = which == M_MISTRAL, fixed = crop_variants[v].strategy == KV_STATIC ||
                                                       crop_variants[v].strategy == KV_OFFLOADED_STATIC;
            assert_int_equal(rec, sliding && fixed ? TIER_ENOTSUP : TIER_OK);
            feed(&r, q, ids, N_PROMPT, row);
            feed(&r, q, c.toks, K, row);
            feed(&r, q, garbage, J, row); /* then taken back */
            assert_int_equal(kv_seq_crop(q, -J), rec == TIER_OK ? TIER_OK : TIER_ECONFLICT);
            if (rec == TIER_OK) {
                assert_int_equal(kv_seq_length(q), N_PROMPT + K);
                for (int i = K; i < N_GEN - 1; i++) {
                    feed(&r, q, &c.toks[i], 1, row);
                    if (memcmp(row, c.logits + (size_t)(i + 1) * V, (size_t)V * sizeof(float)))
                        fail_msg("model %d, %s: logits after the crop differ at token %d", which,
                                 kv_strategy_name(crop_variants[v].strategy), i);
                }
            }
            kv_seq_free(q);
        }
        free(row);
        free(c.logits);
        rig_close(&r);
    }
}

/* Forks of a 2k-token prefix share its blocks (at the default block size,
 * 16, one fork's first new block is 1/128 of the prefix: 8 forks hold
 * 1.0625x the bytes of one, within the 1.1x target), and decoding from a fork
 * gives the tokens of a fresh prefill of the same text, parent freed first. */
static void test_forks_share(void **state)
{
    (void)state;
    enum { P = 2048, F = 8, G = 16 };
    struct rig r;
    rig_open(&r, M_LLAMA, 0, 0);
    int V = vocab(&r);
    float *row = malloc((size_t)V * sizeof(float)), *prow = malloc((size_t)V * sizeof(float));
    int32_t *ids = malloc(P * sizeof(int32_t)), fresh[G], forked[G];
    assert_true(row && prow && ids);
    for (int i = 0; i < P; i++)
        ids[i] = (int32_t)((i * 37 + i / 7) % 300 + 4);
    kv_seq *ref, *parent, *kids[F];
    assert_int_equal(kv_seq_create(r.store, NULL, &ref), TIER_OK);
    feed(&r, ref, ids, P, row);
    decode(&r, ref, row, G, fresh);
    kv_seq_free(ref);
    assert_int_equal(kv_store_stats(r.store).blocks_used, 0);

    assert_int_equal(kv_seq_create(r.store, NULL, &parent), TIER_OK);
    feed(&r, parent, ids, P, prow);
    size_t one = kv_seq_bytes(parent),
           block = one / (size_t)(P / kv_store_block_tokens(r.store) * model_get_config(r.m)->n_layers);
    for (int k = 0; k < F; k++)
        assert_int_equal(kv_seq_fork(parent, &kids[k]), TIER_OK);
    size_t all = kv_store_stats(r.store).blocks_used * block;
    assert_int_equal(all, one); /* nothing copied by forking */
    int32_t first = argmax_f32(prow, V);
    for (int k = 0; k < F; k++)
        feed(&r, kids[k], &first, 1, row);
    all = kv_store_stats(r.store).blocks_used * block;
    print_message("8 forks of %d tokens after one decode step each: %.4fx the KV bytes of one\n", P,
                  (double)all / (double)one);
    assert_true((double)all <= 1.1 * (double)one);
    for (int k = 0; k < F; k++) /* 2048 tokens fill their blocks: the step wrote into a new one */
        assert_int_equal(kv_seq_stats(kids[k]).copied_bytes, 0);
    /* a fork of a sequence whose last block is partly filled copies that
     * block, once per layer, on its first step, and nothing after */
    kv_seq *kb;
    int n_layers = model_get_config(r.m)->n_layers;
    assert_int_equal(kv_seq_fork(kids[0], &kb), TIER_OK);
    assert_int_equal(kv_seq_stats(kb).copied_bytes, 0);
    feed(&r, kb, &first, 1, row);
    assert_int_equal(kv_seq_stats(kb).copied_bytes, (uint64_t)n_layers * block);
    feed(&r, kb, &first, 1, row);
    assert_int_equal(kv_seq_stats(kb).copied_bytes, (uint64_t)n_layers * block);
    assert_int_equal(kv_seq_stats(kids[0]).copied_bytes, 0);
    kv_seq_free(kb);
    kv_seq_free(parent);
    memcpy(row, prow, (size_t)V * sizeof(float));
    kv_seq *k0;
    assert_int_equal(kv_seq_fork(kids[F - 1], &k0), TIER_OK); /* a fork of a fork, after its first step */
    assert_int_equal(kv_seq_crop(k0, -1), TIER_OK);            /* back to the bare prefix */
    decode(&r, k0, row, G, forked);
    assert_memory_equal(forked, fresh, sizeof(fresh));
    kv_seq_free(k0);
    for (int k = 0; k < F; k++)
        kv_seq_free(kids[k]);
    assert_int_equal(kv_store_stats(r.store).blocks_used, 0);
    free(ids);
    free(row);
    free(prow);
    rig_close(&r);
}

/* A fork of KV in device extents, on a device with room for the parent
 * and the streaming slots but not for a second copy, starts in the host
 * tier (the offloaded form of the parent's strategy, KV_FALLBACK_SIZED) and
 * decodes with the logits of the same fork made on a free device, bit for
 * bit; the parent is untouched and decodes the same.  With no_fallback the
 * fork is refused and the store is as before. */
static void test_fork_fallback(void **state)
{
    (void)state;
    enum { G = 24 };
    static const struct kv_seq_params fps[] = {
        {.strategy = KV_STATIC, .max_cache_len = N_PROMPT + N_GEN},
        {.strategy = KV_STATIC, .max_cache_len = N_PROMPT + N_GEN, .window_length = 16},
        {.strategy = KV_OFFLOADED, .adaptive = true, .max_cache_len = N_PROMPT + N_GEN},
        {.strategy = KV_OFFLOADED_STATIC, .adaptive = true, .max_cache_len = N_PROMPT + N_GEN},
    };
    int32_t ids[N_PROMPT];
    prompt_of(5, ids);
    for (size_t v = 0; v < sizeof(fps) / sizeof(fps[0]); v++) {
        /* the reference: the same fork with the device free */
        struct rig r;
        rig_open(&r, M_DEEP, 0, 0);
        int V = vocab(&r);
        size_t bytes = (size_t)G * V * sizeof(float);
        float *row = malloc((size_t)V * sizeof(float)), *want = malloc(bytes), *got = malloc(bytes);
        assert_true(row && want && got);
        kv_seq *parent, *kid;
        assert_int_equal(kv_seq_create(r.store, &fps[v], &parent), TIER_OK);
        feed(&r, parent, ids, N_PROMPT, row);
        size_t parent_dev = kv_seq_stats(parent).dev_bytes, act = r.act_bytes;
        assert_true(parent_dev > 0);
        assert_int_equal(kv_seq_fork(parent, &kid), TIER_OK);
        assert_int_equal(kv_seq_stats(kid).fallback, KV_FALLBACK_NONE);
        int32_t first = argmax_f32(row, V), tok = first;
        for (int i = 0; i < G; i++) {
            feed(&r, kid, &tok, 1, want + (size_t)i * V);
            tok = argmax_f32(want + (size_t)i * V, V);
        }
        kv_seq_free(kid);
        kv_seq_free(parent);
        rig_close(&r);

        /* room for the parent and half as much again: the slots of a
         * streamed fork (two layers) fit, its copy of every layer does not */
        for (int nofb = 1; nofb >= 0; nofb--) {
            rig_open(&r, M_DEEP, act + parent_dev + parent_dev / 2, 0);
            struct kv_seq_params p = fps[v];
            p.no_fallback = nofb;
            assert_int_equal(kv_seq_create(r.store, &p, &parent), TIER_OK);
            assert_int_equal(kv_seq_stats(parent).dev_bytes, parent_dev);
            feed(&r, parent, ids, N_PROMPT, row);
            struct kv_store_stats before = kv_store_stats(r.store);
            if (nofb) {
                assert_int_equal(kv_seq_fork(parent, &kid), TIER_ENOMEM_DEV);
                assert_null(kid);
                assert_non_null(strstr(kv_store_errmsg(r.store), "device tier budget"));
                struct kv_store_stats after = kv_store_stats(r.store);
                assert_int_equal(after.dev_bytes, before.dev_bytes);
                assert_int_equal(after.host_bytes, before.host_bytes);
                assert_int_equal(after.fallbacks, 0);
                kv_seq_free(parent);
                rig_close(&r);
                continue;
            }
            assert_int_equal(kv_seq_fork(parent, &kid), TIER_OK);
            struct kv_seq_stats ks = kv_seq_stats(kid);
            assert_int_equal(ks.fallback, KV_FALLBACK_SIZED);
            assert_int_equal(ks.requested, fps[v].strategy);
            assert_int_equal(ks.strategy, fps[v].strategy == KV_OFFLOADED ? KV_OFFLOADED : KV_OFFLOADED_STATIC);
            assert_int_equal(ks.dev_bytes, 0);
            assert_int_equal(ks.streamed_layers, model_get_config(r.m)->n_layers);
            assert_int_equal(kv_store_stats(r.store).fallbacks, 1);
            assert_int_equal(kv_store_stats(r.store).fallbacks_oom, 0);
            assert_int_equal(kv_seq_stats(parent).fallback, KV_FALLBACK_NONE);
            assert_int_equal(kv_seq_stats(parent).dev_bytes, parent_dev);
            tok = first;
            for (int i = 0; i < G; i++) {
                feed(&r, kid, &tok, 1, got + (size_t)i * V);
                tok = argmax_f32(got + (size_t)i * V, V);
            }
            if (memcmp(got, want, bytes))
                fail_msg("%s variant %zu: the fork in the host tier differs from the resident one",
                         kv_strategy_name(fps[v].strategy), v);
            tok = first;
            for (int i = 0; i < G; i++) {
                feed(&r, parent, &tok, 1, got + (size_t)i * V);
                tok = argmax_f32(got + (size_t)i * V, V);
            }
            if (memcmp(got, want, bytes))
                fail_msg("%s variant %zu: the parent differs after the fork", kv_strategy_name(fps[v].strategy), v);
            kv_seq_free(kid);
            kv_seq_free(parent);
            rig_close(&r);
        }
        free(row);
        free(want);
        free(got);
    }
}

/* The prefix cache: a second request with the same 2k-token prefix feeds
 * only its suffix and gets the first request's logits and tokens. */
static void test_prefix_cache(void **state)
{
    (void)state;
    enum { P = 2048, S = 9, G = 16 };
    struct rig r;
    rig_open(&r, M_LLAMA, 0, 0);
    kv_store_free(r.store);
    struct kv_geom g = model_kv_geom(r.m);
    assert_int_equal(kv_store_open(r.be, &g, &(struct kv_store_params){.prefix_cache = true}, &r.store), TIER_OK);
    int V = vocab(&r);
    float *row = malloc((size_t)V * sizeof(float)), *row2 = malloc((size_t)V * sizeof(float));
    int32_t *ids = malloc((P + S) * sizeof(int32_t)), t1[G], t2[G];
    assert_true(row && row2 && ids);
    for (int i = 0; i < P + S; i++)
        ids[i] = (int32_t)((i * 53 + i / 5) % 300 + 4);
    kv_seq *a, *b;
    int64_t cached;
    assert_int_equal(kv_seq_create(r.store, NULL, &a), TIER_OK);
    assert_int_equal(kv_seq_match_prefix(a, ids, P + S, &cached), TIER_OK);
    assert_int_equal(cached, 0);
    feed(&r, a, ids, P + S, row);
    decode(&r, a, row, G, t1);
    kv_seq_free(a);
    assert_int_equal(kv_seq_create(r.store, NULL, &b), TIER_OK);
    assert_int_equal(kv_seq_match_prefix(b, ids, P + S, &cached), TIER_OK);
    assert_int_equal(cached, P);
    feed(&r, b, ids + cached, (int)(P + S - cached), row2);
    decode(&r, b, row2, G, t2);
    assert_memory_equal(t1, t2, sizeof(t1));
    assert_memory_equal(row, row2, (size_t)V * sizeof(float));
    kv_seq_free(b);
    free(ids);
    free(row);
    free(row2);
    rig_close(&r);
}

/* The sliding_window strategy on a full-attention model: window_length 8
 * gives, bit for bit, what the same weights give as a model whose config
 * slides by 8 (checked against PyTorch by tests/reference.test.sh), for
 * dynamic, static and offloaded storage; storage stays bounded while the
 * length counts every token. */
static void test_sliding_window_strategy(void **state)
{
    (void)state;
    struct clean c;
    clean_run(M_LLAMA_W8, 0, &c);
    struct rig r;
    rig_open(&r, M_LLAMA, 0, 0);
    size_t bytes = (size_t)N_GEN * vocab(&r) * sizeof(float);
    float *logits = malloc(bytes);
    assert_non_null(logits);
    static const struct kv_seq_params sw[] = {
        {.strategy = KV_DYNAMIC, .window_length = 8},
        {.strategy = KV_STATIC, .max_cache_len = 8, .window_length = 8},
        {.strategy = KV_OFFLOADED, .window_length = 8},
        {.strategy = KV_OFFLOADED_STATIC, .max_cache_len = 8, .window_length = 8,
         .offload_sliding = KV_OFFLOAD_SLIDING_YES},
    };
    for (size_t v = 0; v < sizeof(sw) / sizeof(sw[0]); v++) {
        kv_seq *q;
        int32_t toks[N_GEN];
        assert_int_equal(kv_seq_create(r.store, &sw[v], &q), TIER_OK);
        assert_int_equal(greedy(&r, q, 0, toks, logits), MODEL_OK);
        if (memcmp(toks, c.toks, sizeof(toks)) || memcmp(logits, c.logits, bytes))
            fail_msg("sliding_window over %s differs from the sliding model", kv_strategy_name(sw[v].strategy));
        assert_int_equal(kv_seq_length(q), N_PROMPT + N_GEN - 1);
        /* 8 tokens of 2 layers in blocks of 32: at most two blocks a layer */
        assert_true(kv_seq_bytes(q) <= (size_t)2 * 2 * 2 * 2 * 32 * 16 * be_dtype_size(kv_store_dtype(r.store)));
        kv_seq_free(q);
    }
    kv_seq *q;
    struct kv_seq_params bad = {.strategy = KV_STATIC, .max_cache_len = 4, .window_length = 8};
    assert_int_equal(kv_seq_create(r.store, &bad, &q), TIER_EINVAL);
    bad = (struct kv_seq_params){.window_length = -1};
    assert_int_equal(kv_seq_create(r.store, &bad, &q), TIER_EINVAL);
    free(logits);
    free(c.logits);
    rig_close(&r);
}

/* Sink strategy: 3000 tokens of the built-in model through a window of 64
 * with 4 sinks.  Once the window has filled (and its edge has crossed
 * every block phase, and for a quantized cache every residual phase: after
 * `settle` tokens) the KV bytes never exceed what they reached then nor
 * `bound`, neither do the device's bytes (pool, rotation table), and no
 * logit is NaN or infinite. */
static void sink_bounded(struct rig *r, const struct kv_seq_params *p, size_t bound, int settle)
{
    kv_seq *q;
    assert_int_equal(kv_seq_create(r->store, p, &q), TIER_OK);
    float *row = malloc((size_t)vocab(r) * sizeof(float));
    assert_non_null(row);
    size_t settled = 0, dev_settled = 0;
    int32_t tok = 2044;
    feed(r, q, &tok, 1, row);
    for (int i = 1; i < 3000; i++) {
        for (int v = 0; v < vocab(r); v++)
            if (!isfinite(row[v]))
                fail_msg("logit %d after %d tokens is %f", v, i, row[v]);
        tok = argmax_f32(row, vocab(r));
        feed(r, q, &tok, 1, row);
        size_t bytes = kv_seq_bytes(q);
        if (bytes > bound)
            fail_msg("%zu KV bytes after %d tokens, above the bound of %zu", bytes, i, bound);
        if (i <= settle)
            settled = bytes > settled ? bytes : settled;
        else if (bytes > settled)
            fail_msg("%zu KV bytes after %d tokens, above the %zu reached by token %d", bytes, i, settled, settle);
        size_t dev = be_mem_stats(r->be).dev_used;
        if (i <= settle)
            dev_settled = dev > dev_settled ? dev : dev_settled;
        else if (dev > dev_settled)
            fail_msg("%zu device bytes after %d tokens, above the %zu reached by token %d", dev, i, dev_settled, settle);
    }
    assert_int_equal(kv_seq_length(q), 3000);
    kv_seq_free(q);
    free(row);
}

static void test_sink_bounded(void **state)
{
    (void)state;
    struct rig r;
    rig_open_dir(&r, "model/builtin", 0, 0);
    struct kv_seq_params p = {.sink = true, .window_length = 64, .num_sink_tokens = 4};
    struct kv_geom g = model_kv_geom(r.m);
    int bt = kv_store_block_tokens(r.store);
    size_t block = 2 * (size_t)g.n_kv_heads * (size_t)bt * (size_t)g.head_dim * be_dtype_size(g.dtype);
    sink_bounded(&r, &p, (size_t)g.n_layers * (size_t)((64 - 4 + bt - 1) / bt + 2) * block, 64 + 2 * bt);
    rig_close(&r);
}

/* The same over a quantized cache (KIVI int4, residual_length 128, twice
 * the window, so the window often starts inside the residual).  Per layer
 * the bound is the sink block, the quantized blocks W-S tokens touch plus
 * the one a flush reopens, and the residual's blocks. */
static void test_sink_quantized_bounded(void **state)
{
    (void)state;
    struct rig r;
    rig_open_dir(&r, "model/builtin", 0, 0);
    struct kv_seq_params p = {.strategy = KV_QUANTIZED, .quant = kv_quant_defaults(KVQ_QUANTO), .sink = true,
                              .window_length = 64, .num_sink_tokens = 4};
    p.quant.axis_key = -1; /* KIVI: keys per channel */
    struct kv_geom g = model_kv_geom(r.m);
    struct be_kvq_format f;
    struct kvq_error e;
    int bt = kv_store_block_tokens(r.store), T = kvq_block_tokens(&p.quant, bt);
    assert_int_equal(kvq_format_init(&f, &p.quant, g.n_kv_heads, g.head_dim, T, &e), TIER_OK);
    size_t block = 2 * (size_t)g.n_kv_heads * (size_t)bt * (size_t)g.head_dim * be_dtype_size(g.dtype);
    size_t per_layer = block + (size_t)((64 - 4 + T - 1) / T + 2) * f.block_bytes +
                       (size_t)((p.quant.residual_length + bt - 1) / bt + 2) * block;
    sink_bounded(&r, &p, (size_t)g.n_layers * per_layer, 64 + 3 * p.quant.residual_length);
    rig_close(&r);
}

/* Sinks over a quantized cache against the same tokens through the dense
 * sink cache (M_LLAMA, window 24, 2 sinks, 200 decode steps, each step's
 * logits): KIVI int8 (keys per channel, residual 8, so the window is
 * mostly quantized) stays within the int8 bound of tests/test_kvquant.c,
 * relative to the largest logit; int2 must break it, or the comparison
 * could not tell a quantized window from a dense one. */
static double sink_quantized_error(struct rig *r, const int32_t *toks, int n, const float *dense, int nbits)
{
    int nv = vocab(r);
    struct kv_seq_params p = {.strategy = KV_QUANTIZED, .quant = kv_quant_defaults(KVQ_QUANTO), .sink = true,
                              .window_length = 24, .num_sink_tokens = 2};
    p.quant.nbits = nbits;
    p.quant.axis_key = -1;
    p.quant.q_group_size = 16;
    p.quant.residual_length = 8;
    kv_seq *q;
    assert_int_equal(kv_seq_create(r->store, &p, &q), TIER_OK);
    float *row = malloc((size_t)nv * sizeof(float));
    assert_non_null(row);
    double worst = 0.0;
    feed(r, q, toks, N_PROMPT, row);
    for (int i = 0; i <= n; i++) {
        const float *want = dense + (size_t)i * nv;
        double top = 0.0, err = 0.0;
        for (int v = 0; v < nv; v++) {
            top = fmax(top, fabs(want[v]));
            err = fmax(err, fabs((double)want[v] - row[v]));
        }
        worst = fmax(worst, err / top);
        if (i < n)
            feed(r, q, &toks[N_PROMPT + i], 1, row);
    }
    kv_seq_free(q);
    free(row);
    return worst;
}

static void test_sink_quantized_logits(void **state)
{
    (void)state;
    struct rig r;
    rig_open(&r, M_LLAMA, 0, 0);
    int nv = vocab(&r), n = 200;
    struct kv_seq_params p = {.sink = true, .window_length = 24, .num_sink_tokens = 2};
    kv_seq *q;
    assert_int_equal(kv_seq_create(r.store, &p, &q), TIER_OK);
    int32_t toks[N_PROMPT + 200];
    prompt_of(9, toks);
    float *dense = malloc((size_t)(n + 1) * (size_t)nv * sizeof(float));
    assert_non_null(dense);
    greedy_logits(&r, q, toks, n, dense);
    kv_seq_free(q);
    double e8 = sink_quantized_error(&r, toks, n, dense, 8), e2 = sink_quantized_error(&r, toks, n, dense, 2);
    print_message("sink + quantized vs dense sink logits: int8 %.2g, int2 %.2g of the largest logit\n", e8, e2);
    if (e8 > 1e-2 || e2 <= 1e-2)
        fail_msg("int8 error %g (bound 1e-2), int2 error %g (must exceed it)", e8, e2);
    free(dense);
    rig_close(&r);
}

/* One forward batch holding a dense sink, a quantized sink, a plain
 * quantized and a plain dense sequence (so be_attention_quant reads
 * rotated and unrotated keys, dense and quantized, in one call): each
 * sequence's logits equal its run alone. */
static void test_sink_quantized_batch(void **state)
{
    (void)state;
    struct rig r;
    rig_open(&r, M_LLAMA, 0, 0);
    int nv = vocab(&r), n = 60;
    struct kv_quant_params qp = kv_quant_defaults(KVQ_QUANTO);
    qp.q_group_size = 16;
    qp.residual_length = 8;
    const struct kv_seq_params ps[4] = {
        {.sink = true, .window_length = 16, .num_sink_tokens = 2},
        {.strategy = KV_QUANTIZED, .quant = qp, .sink = true, .window_length = 16, .num_sink_tokens = 2},
        {.strategy = KV_QUANTIZED, .quant = qp},
        {0},
    };
    int32_t toks[4][N_PROMPT + 60];
    float *alone = malloc((size_t)4 * (size_t)(n + 1) * (size_t)nv * sizeof(float));
    float *rows = malloc((size_t)4 * (size_t)nv * sizeof(float));
    assert_true(alone && rows);
    for (int k = 0; k < 4; k++) {
        kv_seq *q;
        assert_int_equal(kv_seq_create(r.store, &ps[k], &q), TIER_OK);
        prompt_of(k, toks[k]);
        greedy_logits(&r, q, toks[k], n, alone + (size_t)k * (size_t)(n + 1) * (size_t)nv);
        kv_seq_free(q);
    }
    kv_seq *qs[4];
    for (int k = 0; k < 4; k++)
        assert_int_equal(kv_seq_create(r.store, &ps[k], &qs[k]), TIER_OK);
    double worst = 0.0;
    for (int i = 0; i <= n; i++) {
        struct fw_seq fs[4];
        for (int k = 0; k < 4; k++)
            fs[k] = (struct fw_seq){.kv = qs[k], .tokens = i ? &toks[k][N_PROMPT + i - 1] : toks[k],
                                    .n_tokens = i ? 1 : N_PROMPT, .logits = rows + (size_t)k * nv};
        assert_int_equal(model_forward(r.m, fs, 4), MODEL_OK);
        for (int k = 0; k < 4; k++) {
            const float *a = alone + ((size_t)k * (size_t)(n + 1) + (size_t)i) * (size_t)nv;
            for (int v = 0; v < nv; v++)
                worst = fmax(worst, fabs((double)a[v] - rows[(size_t)k * nv + v]) / (1.0 + fabs(a[v])));
        }
    }
    if (worst > 1e-5)
        fail_msg("a mixed batch differs from each sequence alone by %g", worst);
    for (int k = 0; k < 4; k++)
        kv_seq_free(qs[k]);
    free(alone);
    free(rows);
    rig_close(&r);
}

/* Forks of a sink sequence, before its first eviction (block 0 shared,
 * copied on write) and after it (the sink block shared by reference),
 * decode exactly like their parent; any can be freed first. */
static void test_sink_forks(void **state)
{
    (void)state;
    struct rig r;
    rig_open(&r, M_LLAMA, 0, 0);
    int nv = vocab(&r), n = 120, at = 100;
    struct kv_seq_params p = {.sink = true, .window_length = 16, .num_sink_tokens = 2};
    kv_seq *parent, *early, *late = NULL;
    assert_int_equal(kv_seq_create(r.store, &p, &parent), TIER_OK);
    int32_t prompt[N_PROMPT], toks[120];
    prompt_of(3, prompt);
    float *rows = malloc((size_t)(n + 1) * (size_t)nv * sizeof(float)), *row = malloc((size_t)nv * sizeof(float));
    assert_true(rows && row);
    feed(&r, parent, prompt, N_PROMPT, rows);
    assert_int_equal(kv_seq_fork(parent, &early), TIER_OK);
    for (int i = 0; i < n; i++) {
        if (i == at)
            assert_int_equal(kv_seq_fork(parent, &late), TIER_OK);
        toks[i] = argmax_f32(rows + (size_t)i * nv, nv);
        feed(&r, parent, &toks[i], 1, rows + (size_t)(i + 1) * nv);
    }
    kv_seq_free(parent);
    for (int i = 0; i < n; i++) {
        feed(&r, early, &toks[i], 1, row);
        assert_memory_equal(row, rows + (size_t)(i + 1) * nv, (size_t)nv * sizeof(float));
    }
    kv_seq_free(early);
    for (int i = at; i < n; i++) {
        feed(&r, late, &toks[i], 1, row);
        assert_memory_equal(row, rows + (size_t)(i + 1) * nv, (size_t)nv * sizeof(float));
    }
    kv_seq_free(late);
    assert_int_equal(kv_store_stats(r.store).blocks_used, 0);
    free(rows);
    free(row);
    rig_close(&r);
}

/* What the sink strategy refuses, each with a message naming the
 * combination (the daemon's 400/409 body), and what it allows. */
static void expect_refused(kv_store *s, const struct kv_seq_params *p, enum tier_status want, const char *what)
{
    kv_seq *q = NULL;
    assert_int_equal(kv_seq_create(s, p, &q), want);
    assert_null(q);
    if (!strstr(kv_store_errmsg(s), what))
        fail_msg("expected \"%s\" in \"%s\"", what, kv_store_errmsg(s));
}

static void test_sink_refusals(void **state)
{
    (void)state;
    struct rig r;
    rig_open(&r, M_LLAMA, 0, 0);
    struct kv_seq_params p = {.sink = true, .window_length = 16, .num_sink_tokens = 2};
    p.strategy = KV_STATIC;
    p.max_cache_len = 64;
    expect_refused(r.store, &p, TIER_ENOTSUP, "sink + static");
    p.strategy = KV_OFFLOADED;
    expect_refused(r.store, &p, TIER_ENOTSUP, "sink + offloaded");
    p.strategy = KV_OFFLOADED_STATIC;
    expect_refused(r.store, &p, TIER_ENOTSUP, "sink + offloaded_static");
    p.strategy = KV_QUANTIZED; /* allowed: the sinks stay full precision, the window is quantized */
    p.max_cache_len = 0;
    p.quant = kv_quant_defaults(KVQ_QUANTO);
    kv_seq *sq;
    assert_int_equal(kv_seq_create(r.store, &p, &sq), TIER_OK);
    kv_seq_free(sq);
    p.offload = true;
    expect_refused(r.store, &p, TIER_ENOTSUP, "sink + offloaded quantized");
    p.offload = false;
    p = (struct kv_seq_params){.sink = true, .window_length = 0, .num_sink_tokens = 2};
    expect_refused(r.store, &p, TIER_EINVAL, "window_length");
    p.window_length = 16;
    p.num_sink_tokens = 16;
    expect_refused(r.store, &p, TIER_EINVAL, "num_sink_tokens");
    p.window_length = 64;
    p.num_sink_tokens = 33; /* more than a block */
    expect_refused(r.store, &p, TIER_EINVAL, "num_sink_tokens");

    /* crop works until the first eviction, then 409 */
    p = (struct kv_seq_params){.sink = true, .window_length = 16, .num_sink_tokens = 2};
    kv_seq *q;
    assert_int_equal(kv_seq_create(r.store, &p, &q), TIER_OK);
    assert_int_equal(kv_seq_activate_past_recording(q), TIER_ENOTSUP);
    assert_non_null(strstr(kv_store_errmsg(r.store), "past recording + sink"));
    int32_t prompt[N_PROMPT];
    prompt_of(5, prompt);
    float *row = malloc((size_t)vocab(&r) * sizeof(float));
    assert_non_null(row);
    feed(&r, q, prompt, 10, row);
    assert_int_equal(kv_seq_crop(q, -3), TIER_OK);
    assert_int_equal(kv_seq_length(q), 7);
    feed(&r, q, prompt + 7, 13, row); /* 20 tokens: past the window */
    assert_int_equal(kv_seq_crop(q, -1), TIER_ECONFLICT);
    assert_non_null(strstr(kv_store_errmsg(r.store), "crop + sink"));
    assert_int_equal(kv_seq_crop(q, 0), TIER_OK); /* a no-op is no rollback */
    assert_int_equal(kv_seq_length(q), 20);
    /* the OOM continuation cannot move it to the host tier */
    assert_int_equal(kv_seq_offload(q, KV_FALLBACK_OOM), TIER_ENOTSUP);
    assert_non_null(strstr(kv_store_errmsg(r.store), "sink + offloaded"));
    kv_seq_free(q);
    free(row);

    /* a model with sliding layers */
    struct rig w;
    rig_open(&w, M_MISTRAL, 0, 0);
    expect_refused(w.store, &p, TIER_ENOTSUP, "sink + sliding layers");
    rig_close(&w);
    rig_close(&r);
}

/* Sinks + the prefix cache: the sequence takes no part (nothing matched,
 * nothing published) and runs normally. */
static void test_sink_prefix_cache(void **state)
{
    (void)state;
    struct rig r;
    rig_open(&r, M_LLAMA, 0, 0);
    kv_store *pc;
    struct kv_geom g = model_kv_geom(r.m);
    assert_int_equal(kv_store_open(r.be, &g, &(struct kv_store_params){.prefix_cache = true}, &pc), TIER_OK);
    int32_t ids[80];
    for (int i = 0; i < 80; i++)
        ids[i] = (int32_t)(i * 7 % 300);
    float *row = malloc((size_t)vocab(&r) * sizeof(float));
    assert_non_null(row);
    struct kv_seq_params p = {.sink = true, .window_length = 16, .num_sink_tokens = 2};
    for (int round = 0; round < 2; round++) {
        kv_seq *q;
        int64_t cached = -1;
        assert_int_equal(kv_seq_create(pc, &p, &q), TIER_OK);
        assert_int_equal(kv_seq_match_prefix(q, ids, 80, &cached), TIER_OK);
        assert_int_equal(cached, 0);
        feed(&r, q, ids, 80, row);
        kv_seq_free(q);
    }
    assert_int_equal(kv_store_stats(pc).prefix_entries, 0);
    kv_store_free(pc);
    free(row);
    rig_close(&r);
}

static int cleanup(void)
{
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", g_dir);
    return system(cmd);
}

int main(void)
{
    if (make_models() != 0) {
        fprintf(stderr, "test_tiers: tools/mkmodel.py failed (no torch?): skipping\n");
        cleanup();
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_strategies_identical),
        cmocka_unit_test(test_mixed_batch),
        cmocka_unit_test(test_longrope_batch),
        cmocka_unit_test(test_fault_sweep),
        cmocka_unit_test(test_four_times_the_budget),
        cmocka_unit_test(test_generate_device_refusal),
        cmocka_unit_test(test_offloaded_peak),
        cmocka_unit_test(test_host_exhausted),
        cmocka_unit_test(test_prefetch_figures),
        cmocka_unit_test(test_crop_regenerate),
        cmocka_unit_test(test_forks_share),
        cmocka_unit_test(test_fork_fallback),
        cmocka_unit_test(test_prefix_cache),
        cmocka_unit_test(test_sliding_window_strategy),
        cmocka_unit_test(test_sink_bounded),
        cmocka_unit_test(test_sink_quantized_bounded),
        cmocka_unit_test(test_sink_quantized_logits),
        cmocka_unit_test(test_sink_quantized_batch),
        cmocka_unit_test(test_sink_forks),
        cmocka_unit_test(test_sink_refusals),
        cmocka_unit_test(test_sink_prefix_cache),
    };
    g_kv = MODEL_KV_F32;
    int rc = cmocka_run_group_tests_name("f32 KV", tests, NULL, NULL);
    g_kv = MODEL_KV_BF16;
    rc |= cmocka_run_group_tests_name("bf16 KV", tests, NULL, NULL);
    cleanup();
    return rc;
}
