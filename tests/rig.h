/* rig.h - what the tests of sequence images, dense export and prefix
 * blocks on disk share: random models from tools/mkmodel.py in a temporary
 * directory (model i in g_dir/m<i>, seed 7 + i) and a CPU backend, model
 * and KV store over one of them.  Static inline, so that each test takes
 * what it uses. */
#ifndef KVTIER_TESTS_RIG_H
#define KVTIER_TESTS_RIG_H

#include <stdio.h>
#include <stdlib.h>

#include "model/model.h"
#include "tests/python.h"
#include "util/argmax.h"

/* The shapes the tests use: full attention, every layer sliding by 8, and
 * a hybrid whose first layer is full. */
#define RIG_LLAMA "--arch llama --layers 2 --dim 64 --heads 4 --kv-heads 2 --ffn 128 --vocab 320"
#define RIG_MISTRAL "--arch mistral --layers 2 --dim 64 --heads 4 --kv-heads 2 --ffn 128 --vocab 320 --window 8"
#define RIG_QWEN2                                                                                                   \
    "--arch qwen2 --layers 3 --dim 64 --heads 4 --kv-heads 2 --ffn 128 --vocab 320 --window 8 --max-window-layers 1"

static char g_dir[] = "/tmp/kvtier-rig-XXXXXX";

/* Makes g_dir and model i from args[i]; -1 when mkmodel fails (no torch). */
static inline int make_models(const char *const *args, int n)
{
    if (!mkdtemp(g_dir))
        return -1;
    for (int i = 0; i < n; i++) {
        char cmd[512];
        snprintf(cmd, sizeof(cmd), "%s tools/mkmodel.py --out %s/m%d --seed %d %s > /dev/null 2>&1", test_python(),
                 g_dir, i, 7 + i, args[i]);
        if (system(cmd) != 0)
            return -1;
    }
    return 0;
}

static inline int cleanup(void)
{
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", g_dir);
    return system(cmd);
}

struct rig {
    be_backend *be;
    model *m;
    kv_store *store;
    struct kv_geom g;
    int V;
};

/* Model which on a one-thread CPU backend, a store with sp (NULL: defaults). */
static inline void rig_open(struct rig *r, int which, const struct kv_store_params *sp)
{
    char dir[128], err[MODEL_ERR_LEN];
    snprintf(dir, sizeof(dir), "%s/m%d", g_dir, which);
    struct be_params bp = {.n_threads = 1};
    assert_int_equal(be_open("cpu", &bp, &r->be), BE_OK);
    struct model_params mp = {.max_batch_tokens = 8};
    if (model_load(dir, r->be, &mp, &r->m, err) != MODEL_OK)
        fail_msg("model_load %s: %s", dir, err);
    r->g = model_kv_geom(r->m);
    r->V = model_get_config(r->m)->vocab_size;
    assert_int_equal(kv_store_open(r->be, &r->g, sp, &r->store), TIER_OK);
}

static inline void rig_close(struct rig *r)
{
    kv_store_free(r->store);
    model_free(r->m);
    be_free(r->be);
}

/* One forward call of n tokens of q; row gets the last one's logits. */
static inline void feed(struct rig *r, kv_seq *q, const int32_t *tokens, int n, float *row)
{
    struct fw_seq fs = {.kv = q, .tokens = tokens, .n_tokens = n, .logits = row};
    assert_int_equal(model_forward(r->m, &fs, 1), MODEL_OK);
}

#endif
